"""What the ``statebackend`` command prints: sizes, times, tables, JSON, records and a
progress bar on stderr."""

from __future__ import annotations

import csv
import errno
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from typing import Any, TextIO

from statebackend.tools.reader import Record, to_jsonable


def out(line: str = "") -> None:
    """Print one line of the command's answer on stdout."""
    print(encodable(line), file=sys.stdout)


def encodable(text: str) -> str:
    """``text`` with each lone surrogate (text read from storage may hold one: JSON's
    ``\\udce9``, a message decoded with ``surrogateescape``) as its ``\\uXXXX`` escape,
    which UTF-8 can encode; inside a JSON string the escape reads back as the same text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def size(n: int | None) -> str:
    """A byte count for people: ``512 B``, ``1.5 MiB``; ``-`` when unknown."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def state_size(info: dict[str, Any]) -> str:
    """``inspect``'s state size: all of it, and where it is kept."""
    inline = info["inline_bytes"]
    in_files = f"{size(info['state_bytes'] - inline)} in {info['files']} files"
    if not inline:
        return in_files
    return f"{size(info['state_bytes'])}: {in_files}, {size(inline)} inline in _metadata"


def local_time(timestamp: float | None) -> str:
    """A Unix timestamp as local ISO time to the second; ``-`` when unknown."""
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "") -> None:
    """Print rows as columns aligned under their headers."""
    rows = [list(map(str, row)) for row in rows]
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=False)]
    for row in [list(headers), *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        out((indent + "  ".join(cells)).rstrip())


def json_document(document: Any) -> None:
    """Print a document as indented JSON with sorted keys."""
    out(json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, default=repr))


def cell(value: Any) -> str:
    """A value in a CSV or table cell: strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(to_jsonable(value), ensure_ascii=False, sort_keys=True)


@contextmanager
def progress(description: str, total: int, unit: str = "bytes") -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr counting bytes (else ``total`` things named ``unit``),
    shown only when stderr is a terminal; the callable advances it by n."""
    with _bar(description, unit) as update:
        update(total=total)
        yield lambda n: update(advance=n)


@contextmanager
def progress_of(description: str, unit: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr of things named ``unit`` whose number is learnt on the
    way, shown only when stderr is a terminal; the callable takes (done, total)."""
    with _bar(description, unit) as update:
        yield lambda done, total: update(completed=done, total=total)


@contextmanager
def _bar(description: str, unit: str) -> Iterator[Callable[..., None]]:
    """A transient rich progress bar on stderr (nothing unless stderr is a terminal); the
    callable takes ``Progress.update``'s keywords (``total``, ``completed``, ``advance``)."""
    if not sys.stderr.isatty():
        yield lambda **_: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn() if unit == "bytes" else MofNCompleteColumn(),
        TextColumn("" if unit == "bytes" else unit),
        TimeRemainingColumn(),
    )
    # stdout in a file or pipe stays there; on the terminal, it goes above the bar
    redirect = sys.stdout.isatty()
    with Progress(
        *columns, console=Console(stderr=True), transient=True, redirect_stdout=redirect
    ) as bar:
        task = bar.add_task(description, total=None)
        yield lambda **fields: bar.update(task, **fields)


def write_file(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to the local file ``path`` all or nothing: into a new file
    beside it, renamed over ``path`` once written, so a failure (a full disk, Ctrl-C)
    leaves what ``path`` held. A path that is not a regular file (``/dev/null``, a named
    pipe, ``/dev/stdout``) is written as it is: a rename would replace it. An OSError
    names ``path``."""
    directory, name = os.path.split(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(encodable(text))
        return
    temporary = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "x", encoding="utf-8") as f:
            f.write(encodable(text))
        os.replace(temporary, path)
    except BaseException as exc:
        with suppress(OSError):
            os.unlink(temporary)
        if isinstance(exc, OSError) and exc.filename in (None, temporary):
            raise OSError(exc.errno, exc.strerror, path) from exc
        raise


def write_records(records: Iterator[Record], output_format: str, stream: TextIO) -> int:
    """Write records as ``jsonl``, ``csv`` or an aligned ``table`` (on stdout); returns how many."""
    count = 0
    if output_format == "jsonl":
        for record in records:
            jsonable = {k: to_jsonable(v) for k, v in record.items()}
            stream.write(json.dumps(jsonable, ensure_ascii=False, sort_keys=True) + "\n")
            count += 1
        return count
    rows = []
    headers: list[str] = []
    writer = csv.writer(stream) if output_format == "csv" else None
    for record in records:
        if not headers:
            headers = list(record)
            if writer is not None:
                writer.writerow(headers)
        row = [cell(record[h]) for h in headers]
        if writer is not None:
            writer.writerow(row)
        else:
            rows.append(row)
        count += 1
    if writer is None and headers:
        table([h.upper() for h in headers], rows)
    return count
