"""The ``statebackend`` command: look into, check, read, copy and clean checkpoints and
batch manifests.

A thin layer over ``statebackend.tools``: it parses arguments, opens storage, prints
results, and turns statebackend errors into one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import posixpath
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from statebackend.checkpoint.filesystem import normalize_url
from statebackend.checkpoint.requests import request_savepoint, wait_for_savepoint
from statebackend.checkpoint.savepoints import copy_checkpoint
from statebackend.checkpoint.signing import SigningKey, load_signing_key
from statebackend.errors import CheckpointCorruptedError, ConfigurationError, StateBackendError
from statebackend.serializers import serializer_from_config
from statebackend.snapshot.frames import CODECS
from statebackend.tools.bootstrap import KINDS, bootstrap_from_files, parse_state_file
from statebackend.tools.gc import DEFAULT_GRACE_SECONDS, delete_garbage, find_garbage
from statebackend.tools.listing import (
    COMPLETED,
    CheckpointSummary,
    ManifestSummary,
    find_job_dirs,
    inspect_checkpoint,
    list_jobs,
)
from statebackend.tools.location import (
    CheckpointRef,
    ManifestRef,
    checkpoint_directory,
    open_checkpoint,
    open_location,
    open_state,
)
from statebackend.tools.manifests import (
    committed_source_offsets,
    fold_manifest,
    inspect_manifest,
    manifest_bytes,
    parallelism_of,
    plan_manifest,
    plan_manifest_imbalance,
    verified_files,
    verify_manifest,
)
from statebackend.tools.plan import plan_checkpoint, plan_imbalance
from statebackend.tools.reader import (
    NO_KEY,
    Record,
    parse_selection_key,
    read_bytes,
    read_state,
    read_timers,
    select_state,
    select_timers,
    to_jsonable,
)
from statebackend.tools.report import build_report, render_html
from statebackend.tools.transform import parse_state_ref, plan_transform, transform_savepoint
from statebackend.tools.verify import referenced_bytes, verify_checkpoint

PROG = "statebackend"

# -- output helpers -----------------------------------------------------------------------


def _out(line: str = "") -> None:
    print(line, file=sys.stdout)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _state_size(info: dict[str, Any]) -> str:
    """``inspect``'s state size: all of it, and where it is kept."""
    inline = info["inline_bytes"]
    in_files = f"{_size(info['state_bytes'] - inline)} in {info['files']} files"
    if not inline:
        return in_files
    return f"{_size(info['state_bytes'])}: {in_files}, {_size(inline)} inline in _metadata"


def _time(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "") -> None:
    rows = [list(map(str, row)) for row in rows]
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=False)]
    for row in [list(headers), *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        _out((indent + "  ".join(cells)).rstrip())


def _json(document: Any) -> None:
    _out(json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, default=repr))


def _cell(value: Any) -> str:
    """A value in a CSV or table cell: strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(to_jsonable(value), ensure_ascii=False, sort_keys=True)


@contextmanager
def _progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A byte-counting progress bar on stderr, shown only when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(args.storage_option)


def _signing_key(args: argparse.Namespace) -> SigningKey | None:
    return load_signing_key(key_file=args.signing_key_file)


# -- commands -----------------------------------------------------------------------------


def _operators(parallelisms: dict[str, int]) -> str:
    return ", ".join(f"{op} (P={p})" for op, p in sorted(parallelisms.items()))


def _summary_row(summary: CheckpointSummary, label: str) -> list[str]:
    md = summary.metadata
    batch = "-" if summary.materializes is None else f"batch {summary.materializes}"
    if md is None:
        return [label, summary.status, "-", "-", "-", batch, "-"]
    return [
        label,
        COMPLETED,
        _time(md.completed_at),
        _size(md.state_bytes()),
        str(md.max_parallelism),
        batch,
        _operators({op: s.parallelism for op, s in md.operators.items()}),
    ]


def _manifest_row(summary: ManifestSummary) -> list[str]:
    info = summary.to_json()
    base = info["base"]
    return [
        f"manifests/{summary.batch_id}",
        summary.status,
        _time(info["committed_at"]),
        "-" if base is None else f"{posixpath.basename(base['path'])} (batch {base['batch_id']})",
        str(info["records"]),
        _size(info["record_bytes"]),
        _operators(info["operators"]),
    ]


def cmd_list(args: argparse.Namespace) -> int:
    """``statebackend list``."""
    fs = open_location(args.directory, _options(args))
    jobs = list_jobs(fs, args.directory)
    if args.json:
        _json([job.to_json() for job in jobs])
        return 0
    headers = ["CHECKPOINT", "STATUS", "COMPLETED", "SIZE", "MAX-P", "MATERIALIZES", "OPERATORS"]
    manifest_headers = ["MANIFEST", "STATUS", "COMMITTED", "BASE", "RECORDS", "BYTES", "OPERATORS"]
    for job in jobs:
        _out(f"job {job.job_dir}")
        rows = [_summary_row(c, f"chk-{c.checkpoint_id}") for c in job.checkpoints]
        rows += [_summary_row(s, s.path.rsplit("/", 1)[-1]) for s in job.savepoints]
        if rows:
            _table(headers, rows, "  ")
        else:
            _out("  no checkpoints")
        if job.manifests:
            _table(manifest_headers, [_manifest_row(m) for m in job.manifests], "  ")
    return 0


def _inspect_manifest(ref: ManifestRef, as_json: bool) -> int:
    info = inspect_manifest(ref)
    if as_json:
        _json(info)
        return 0
    _out(f"manifest of batch {info['batch_id']} of job {info['job_id']}: {info['path']}")
    base = info["base"]
    _out(
        f"  committed {_time(info['committed_at'])}, max parallelism {info['max_parallelism']}, "
        f"{info['records']} changelog records, {_size(info['record_bytes'])}, "
        f"{info['changes']} changes"
    )
    if base is None:
        _out("  base: none (no materialization yet: every batch is in the changelog)")
    else:
        _out(
            f"  base: chk-{base['checkpoint_id']} (state of batch {base['batch_id']}), "
            f"{_size(base['state_bytes'])} in {base['files']} files: {base['path']}"
        )
    for operator_id, op in info["operators"].items():
        _out(
            f"operator {operator_id}: parallelism {op['parallelism']}, base "
            f"{_size(op['base_bytes'])}, changelog {_size(op['record_bytes'])}"
        )
        _keyed_states_table(op["keyed_states"])
        _operator_states_table(op["operator_states"])
        rows = [
            [
                batch["batch_id"],
                sub["subtask"],
                f"{sub['key_group_range'][0]}-{sub['key_group_range'][1]}",
                sub["changes"],
                _size(sub["bytes"]),
                sub["attempt"],
            ]
            for batch in op["batches"]
            for sub in batch["subtasks"]
        ]
        if rows:
            _out("  changelog records:")
            headers = ["BATCH", "SUBTASK", "KEY-GROUPS", "CHANGES", "BYTES", "ATTEMPT"]
            _table(headers, rows, "    ")
    return 0


def _keyed_states_table(states: dict[str, dict[str, Any]]) -> None:
    """Print an operator's keyed states (name, kind, key and value serializers), if any."""
    if states:
        _out("  keyed state:")
        _table(
            ["NAME", "KIND", "KEY", "SERIALIZERS"],
            ([name, s["kind"], s["key_serializer"], s["serializer"]] for name, s in states.items()),
            "    ",
        )


def _operator_states_table(states: dict[str, dict[str, Any]]) -> None:
    """Print an operator's operator states (name, mode, elements, serializers), if any."""
    if states:
        _out("  operator state:")
        _table(
            ["NAME", "MODE", "ELEMENTS", "SERIALIZERS"],
            ([name, s["mode"], s["elements"], s["serializer"]] for name, s in states.items()),
            "    ",
        )


def cmd_inspect(args: argparse.Namespace) -> int:
    """``statebackend inspect``."""
    ref = open_state(args.checkpoint, _options(args), _signing_key(args))
    if isinstance(ref, ManifestRef):
        return _inspect_manifest(ref, args.json)
    info = inspect_checkpoint(ref)
    if args.json:
        _json(info)
        return 0
    _out(f"{info['kind']} {info['checkpoint_id']} of job {info['job_id']}: {info['path']}")
    _out(
        f"  completed {_time(info['completed_at'])}, max parallelism {info['max_parallelism']}, "
        + _state_size(info)
    )
    for operator_id, op in info["operators"].items():
        _out(f"operator {operator_id}: parallelism {op['parallelism']}, {_size(op['state_bytes'])}")
        _keyed_states_table(op["keyed_states"])
        timers = op["timers"]
        if timers is not None and (timers["event"]["count"] or timers["processing"]["count"]):
            _out("  timers:")
            clocks = {"event": timers["watermark"], "processing": timers["processing_time"]}
            rows = []
            for domain, clock in clocks.items():
                earliest = timers[domain]["earliest"]
                rows.append(
                    [domain, timers[domain]["count"], "-" if earliest is None else earliest, clock]
                )
            _table(["DOMAIN", "TIMERS", "EARLIEST", "CLOCK (EARLIEST SUBTASK)"], rows, "    ")
        _operator_states_table(op["operator_states"])
        if op["raw_keyed_bytes"]:
            groups = sum(sub.get("raw_keyed_key_groups", 0) for sub in op["subtasks"])
            _out(f"  raw keyed state: {_size(op['raw_keyed_bytes'])} in {groups} key groups")
        _out("  subtasks:")
        rows = []
        for sub in op["subtasks"]:
            groups = sub["key_group_range"]
            elements = sub["operator_state_elements"]
            rows.append(
                [
                    sub["subtask"],
                    "-" if groups is None else f"{groups[0]}-{groups[1]}",
                    _size(sub.get("keyed_bytes")),
                    ", ".join(f"{n}: {c}" for n, c in sorted(elements.items())) or "-",
                    _size(sub["operator_state_bytes"])
                    + (" inline" if sub["operator_state_inline"] else ""),
                ]
            )
        headers = ["SUBTASK", "KEY-GROUPS", "KEYED", "OPERATOR-STATE ELEMENTS", "OP-BYTES"]
        _table(headers, rows, "    ")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """``statebackend verify``."""
    ref = open_state(args.checkpoint, _options(args), _signing_key(args))
    if isinstance(ref, ManifestRef):
        where, total, files = ref.path, manifest_bytes(ref), verified_files(ref)
        with _progress("verifying", total) as advance:
            problems = verify_manifest(ref, advance)
    else:
        where, total, files = ref.directory, referenced_bytes(ref), len(ref.metadata.files())
        with _progress("verifying", total) as advance:
            problems = verify_checkpoint(ref, advance)
    for problem in problems:
        _out(f"FAILED {problem.path}: {problem.message}")
    if problems:
        paths = sorted({p.path for p in problems})
        raise CheckpointCorruptedError(
            f"{where} failed verification: {len(problems)} problem(s) in {', '.join(paths)}"
        )
    _out(f"OK {where}: {files} files, {_size(total)} verified")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """``statebackend plan``."""
    ref = open_state(args.checkpoint, _options(args), _signing_key(args))
    if isinstance(ref, ManifestRef):
        plans = plan_manifest(ref, args.parallelism, args.operator)
        max_parallelism = ref.manifest.max_parallelism
        old = {op: parallelism_of(ref, op) for op in plans}
    else:
        plans = plan_checkpoint(ref, args.parallelism, args.operator)
        max_parallelism = ref.metadata.max_parallelism
        old = {op: ref.metadata.operators[op].parallelism for op in plans}
    if args.json:
        _json(plans)
        return 0
    for operator_id, subtasks in plans.items():
        imbalance = (
            plan_manifest_imbalance(ref, operator_id, args.parallelism)
            if isinstance(ref, ManifestRef)
            else plan_imbalance(ref, operator_id, args.parallelism)
        )
        _out(
            f"operator {operator_id}: {old[operator_id]} -> "
            f"{args.parallelism} subtasks (max parallelism {max_parallelism})"
            + ("" if imbalance is None else f", keyed imbalance {imbalance:.2f} (max/mean)")
        )
        for sub in subtasks:
            start, end = sub["key_group_range"]
            sources = ", ".join(
                f"{s['old_subtask']} ({s['key_groups'][0]}-{s['key_groups'][1]})"
                for s in sub["keyed_sources"]
            )
            keyed = (
                f"{_size(sub['keyed_bytes'])} keyed state from old subtasks {sources}"
                if sources
                else "no keyed state"
            )
            _out(f"  subtask {sub['subtask']}: key groups {start}-{end}, {keyed}")
            if "changelog_sources" in sub:
                _out(
                    f"    changelog: {_size(sub['changelog_bytes'])} in "
                    f"{len(sub['changelog_sources'])} records of batches "
                    + (
                        ", ".join(
                            sorted({str(s["batch_id"]) for s in sub["changelog_sources"]}, key=int)
                        )
                        or "none"
                    )
                )
            for name, share in sub["operator_state"].items():
                slices = ", ".join(f"old {o}[{b}:{e}]" for o, b, e in share["slices"]) or "none"
                line = f"    {name}: {share['elements']} elements ({slices})"
                if "values" in share:
                    line += " = " + ", ".join(
                        " -> ".join(map(repr, record.values())) for record in share["values"]
                    )
                _out(line)
    return 0


def _write_records(records: Iterator[Record], output_format: str, out: TextIO) -> int:
    count = 0
    if output_format == "jsonl":
        for record in records:
            jsonable = {k: to_jsonable(v) for k, v in record.items()}
            out.write(json.dumps(jsonable, ensure_ascii=False, sort_keys=True) + "\n")
            count += 1
        return count
    rows = []
    headers: list[str] = []
    writer = csv.writer(out) if output_format == "csv" else None
    for record in records:
        if not headers:
            headers = list(record)
            if writer is not None:
                writer.writerow(headers)
        row = [_cell(record[h]) for h in headers]
        if writer is not None:
            writer.writerow(row)
        else:
            rows.append(row)
        count += 1
    if writer is None and headers:
        _table([h.upper() for h in headers], rows)
    return count


def cmd_read(args: argparse.Namespace) -> int:
    """``statebackend read``."""
    if (args.state is None) == (not args.timers):
        raise ConfigurationError("give either --state NAME or --timers")
    ref = open_state(args.checkpoint, _options(args), _signing_key(args))
    operators, properties = (
        (ref.metadata.operators, ref.metadata.properties)
        if isinstance(ref, CheckpointRef)
        else (ref.manifest.operators, ref.manifest.properties)
    )
    offsets = committed_source_offsets(properties, args.operator, args.state)
    if args.operator not in operators and offsets is not None:
        _write_records(iter(offsets), args.format, sys.stdout)  # the driver's, in the properties
        return 0
    if isinstance(ref, CheckpointRef):
        return _read(args, ref)
    with tempfile.TemporaryDirectory(prefix="statebackend-read-") as local:
        folded = fold_manifest(
            ref, Path(local, "state").as_uri(), allow_pickle=args.allow_pickle, parallelism=1
        )
        return _read(args, open_checkpoint(folded))


def _read(args: argparse.Namespace, ref: CheckpointRef) -> int:
    if args.timers:
        selection = select_timers(ref, args.operator)
        key = NO_KEY if args.key is None else parse_selection_key(selection, args.key)
        with _progress("reading", read_bytes(ref, selection, key)) as advance:
            timers = read_timers(ref, selection, key, advance, allow_pickle=args.allow_pickle)
            written = _write_records(timers, args.format, sys.stdout)
        _note_absent_key(args, written, "timers")
        return 0
    selection = select_state(ref, args.operator, args.state)
    key = NO_KEY if args.key is None else parse_selection_key(selection, args.key)
    with _progress("reading", read_bytes(ref, selection, key)) as advance:
        records = read_state(ref, selection, key, progress=advance, allow_pickle=args.allow_pickle)
        written = _write_records(records, args.format, sys.stdout)
    _note_absent_key(args, written, f"state {args.state!r}")
    return 0


def _note_absent_key(args: argparse.Namespace, written: int, what: str) -> None:
    """An empty answer to ``--key`` says so on stderr, so a mistyped key is not mistaken for
    an empty state."""
    if args.key is not None and written == 0:
        print(
            f"{PROG}: note: key {args.key!r} has no {what} in operator {args.operator!r}",
            file=sys.stderr,
        )


def cmd_savepoint_create(args: argparse.Namespace) -> int:
    """``statebackend savepoint create``."""
    key = _signing_key(args)
    source = open_state(args.source, _options(args), key)
    if isinstance(source, ManifestRef):
        _out(
            fold_manifest(
                source,
                args.target,
                storage_options=_options(args),
                parallelism=args.parallelism,
                allow_pickle=args.allow_pickle,
            )
        )
        print(
            f"{PROG}: note: {args.target} is not signed (folded savepoints are not)",
            file=sys.stderr,
        )
        return 0
    if args.parallelism is not None:
        raise ConfigurationError(
            "--parallelism applies to a savepoint folded from a batch manifest; a copy of a "
            "checkpoint keeps its parallelism (restore it at any parallelism, or use "
            "`savepoint transform --parallelism`)"
        )
    target_fs = open_location(args.target, _options(args))
    target = checkpoint_directory(args.target)
    with _progress("copying", referenced_bytes(source)) as advance:
        copy_checkpoint(source.fs, source.directory, target_fs, target, advance, key)
    if key is None:
        print(f"{PROG}: note: {target} is not signed (no --signing-key-file)", file=sys.stderr)
    _out(target)
    return 0


def _rename(text: str) -> tuple[str, str, str]:
    ref, sep, new = text.partition("=")
    if not sep or not new:
        raise ConfigurationError(f"{text!r} is not OPERATOR/STATE=NEW: e.g. user-totals/count=n")
    return (*parse_state_ref(ref), new)


def cmd_savepoint_transform(args: argparse.Namespace) -> int:
    """``statebackend savepoint transform``."""
    source = open_checkpoint(args.source, _options(args))
    rewrites = plan_transform(
        source,
        drop_operators=args.drop_operator,
        drop_states=[parse_state_ref(text) for text in args.drop_state],
        rename_states=[_rename(text) for text in args.rename_state],
        parallelism=args.parallelism,
    )
    _out(
        transform_savepoint(
            source,
            args.target,
            rewrites,
            storage_options=_options(args),
            compression=args.compression,
        )
    )
    return 0


def cmd_savepoint_bootstrap(args: argparse.Namespace) -> int:
    """``statebackend savepoint bootstrap``."""

    def serializer(identity: str) -> Any:
        return serializer_from_config({"identity": identity})

    _out(
        bootstrap_from_files(
            args.target,
            args.operator,
            [parse_state_file(text) for text in args.state],
            parallelism=args.parallelism,
            max_parallelism=args.max_parallelism,
            key_serializer=serializer(args.key_serializer),
            value_serializer=serializer(args.value_serializer),
            map_key_serializer=serializer(args.map_key_serializer),
            job_id=args.job_id,
            storage_options=_options(args),
        )
    )
    return 0


def cmd_savepoint_trigger(args: argparse.Namespace) -> int:
    """``statebackend savepoint trigger``."""
    job_dir = args.job_dir.rstrip("/")
    fs = open_location(job_dir, _options(args))
    jobs = find_job_dirs(fs, job_dir)
    if jobs != [job_dir]:
        raise ConfigurationError(
            f"{job_dir} holds several jobs, not one job's checkpoints: give one of {jobs}"
        )
    request_id = request_savepoint(fs, job_dir, args.target)
    if args.wait is None:
        _out(f"requested savepoint {request_id} of {job_dir}")
        return 0
    _out(wait_for_savepoint(fs, job_dir, request_id, args.wait))
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """``statebackend gc``."""
    fs = open_location(args.directory, _options(args))
    total_files = total_bytes = 0
    for job_dir in find_job_dirs(fs, args.directory):
        garbage = find_garbage(fs, job_dir, grace_seconds=args.grace)
        if args.apply:
            garbage = delete_garbage(fs, job_dir, garbage, grace_seconds=args.grace)
        for item in garbage:
            _out(f"{item.size:>12}  {item.path}  ({item.reason})")
        total_files += len(garbage)
        total_bytes += sum(item.size for item in garbage)
    if args.apply:
        _out(f"deleted {total_files} files, {_size(total_bytes)}")
    else:
        _out(
            f"{total_files} unreferenced files, {_size(total_bytes)}"
            + ("; run with --apply to delete them" if total_files else "")
        )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``statebackend report``."""
    report = build_report(open_location(args.job_dir, _options(args)), args.job_dir)
    if args.json and args.output is None:
        _json(report)
        return 0
    output = args.output or "report.html"
    with open(output, "w", encoding="utf-8") as f:
        f.write(json.dumps(report, indent=2, sort_keys=True) if args.json else render_html(report))
    _out(output)
    return 0


# -- the parser ---------------------------------------------------------------------------

_S3 = "--storage-option endpoint_url=http://127.0.0.1:9000"

_EXAMPLES = {
    "list": f"""examples:
  {PROG} list /data/checkpoints
  {PROG} list s3://bucket/checkpoints {_S3}
  {PROG} list file:///data/checkpoints/my-job --json
a job's batch manifests (manifests/B: a base checkpoint + changelog records) are listed
after its checkpoints; MATERIALIZES names the batch a checkpoint holds when a manifest
builds on it""",
    "inspect": f"""examples:
  {PROG} inspect /data/checkpoints/my-job/chk-42
  {PROG} inspect s3://bucket/checkpoints/my-job/chk-42/_metadata --json {_S3}
  {PROG} inspect /data/checkpoints/my-job/manifests/57
  {PROG} inspect /data/checkpoints/my-job/latest""",
    "verify": f"""examples:
  {PROG} verify /data/checkpoints/my-job/chk-42
  {PROG} verify s3://bucket/savepoints/before-upgrade {_S3}
  {PROG} verify /data/checkpoints/my-job/manifests/57
exit status 1 and the failing files named when a file is missing, truncated or corrupted;
a manifest's base checkpoint is verified as a checkpoint, then every changelog record""",
    "plan": f"""examples:
  {PROG} plan /data/checkpoints/my-job/chk-42 --parallelism 8
  {PROG} plan /data/checkpoints/my-job/chk-42 --parallelism 2 --operator source --json
  {PROG} plan /data/checkpoints/my-job/latest --parallelism 8
from a manifest, each subtask also replays the changelog records that hold its key groups""",
    "read": f"""examples:
  {PROG} read /data/checkpoints/my-job/chk-42 --operator user-totals --state total
  {PROG} read /data/checkpoints/my-job/chk-42 --operator user-totals --state total --key alice
  {PROG} read /data/checkpoints/my-job/chk-42 --operator user-totals --timers
  {PROG} read /data/checkpoints/my-job/chk-42 --operator source --state offsets --format table
  {PROG} read s3://bucket/ckpt/my-job/chk-42 --operator user-totals --state items \\
      --format csv {_S3} > items.csv
  {PROG} read /data/checkpoints/my-job/latest --operator user-totals --state total
a manifest's state is rebuilt (base + changelog) in a temporary local directory first.
--key takes the key as text for str keys, a number for int keys, JSON otherwise
(e.g. '["alice", 3]' for a tuple key); a transform_with_state key as the value of its
one key column or a JSON array of its key columns. Pickled keys and values are printed as
{{"serializer": "pickle", "base64": ...}}: unpickling runs code named by the checkpoint, so
--allow-pickle is only for checkpoints nobody else can write (or that are signed)""",
    "savepoint": f"""examples:
  {PROG} savepoint create --from /data/checkpoints/my-job/chk-42 --to /data/savepoints/v1
  {PROG} savepoint trigger s3://bucket/checkpoints/my-job --wait 300 {_S3}
  {PROG} savepoint transform --from /data/savepoints/v1 --to /data/savepoints/v2 \\
      --drop-state user-totals/recent
  {PROG} savepoint bootstrap --to /data/savepoints/initial --operator user-totals \\
      --state count:value=counts.jsonl --value-serializer int -p 4""",
    "savepoint create": f"""examples:
  {PROG} savepoint create --from /data/checkpoints/my-job/chk-42 --to /data/savepoints/v1
  {PROG} savepoint create --from s3://bucket/ckpt/my-job/chk-42 --to file:///backup/sp-42 \\
      {_S3}
  {PROG} savepoint create --from /data/checkpoints/my-job/manifests/57 --to /data/sp/b57
the copy is checked file by file; _metadata is written last. With --signing-key-file the
source must be signed with that key and the savepoint is signed with it; without, the
savepoint is not signed. From a batch manifest the state is folded: each subtask is
rebuilt from base + changelog and written in the full format (at --parallelism), so the
savepoint needs neither the base nor the changelog""",
    "savepoint transform": f"""examples:
  {PROG} savepoint transform --from /data/savepoints/v1 --to /data/savepoints/v2 \\
      --drop-state user-totals/recent --rename-state user-totals/count=events
  {PROG} savepoint transform --from s3://bucket/ckpt/my-job/chk-42 --to s3://bucket/sp/v2 \\
      --drop-operator old-enricher --parallelism 8 {_S3}
the source is only read; each subtask is restored (at --parallelism, default the
operator's), changed and written, _metadata last. Other changes (mapping values, a new
serializer, added state): statebackend.spark.state_writer.StateWriter""",
    "savepoint bootstrap": f"""examples:
  {PROG} savepoint bootstrap --to /data/savepoints/initial --operator user-totals \\
      --state count:value=counts.jsonl --state categories:map=categories.jsonl \\
      --value-serializer int --parallelism 4
each line of a FILE is {{"key": ..., "value": ...}}: a value, a list (list state) or an
object (map state). Reducing and aggregating state, and DataFrames as input:
statebackend.spark.state_writer.StateWriter""",
    "savepoint trigger": f"""examples:
  {PROG} savepoint trigger /data/checkpoints/my-job
  {PROG} savepoint trigger s3://bucket/ckpt/my-job --to s3://bucket/savepoints/v2 --wait 300 \\
      {_S3}
the running job's driver picks the request up between micro-batches; with --wait the
savepoint's path is printed once it is complete""",
    "gc": f"""examples:
  {PROG} gc /data/checkpoints/my-job
  {PROG} gc s3://bucket/checkpoints --apply {_S3}
lists (or with --apply deletes) files no checkpoint, savepoint or batch manifest
references: files of aborted checkpoints older than the newest completed one, stray files
in completed checkpoints, unused files in shared/, changelog records of committed batches
that no manifest references (below every base, or rejected task attempts). Safe while the
job runs: files modified within the grace period, referenced by a pending checkpoint's
acknowledgements, or in shared/ and written since the newest completed checkpoint was
triggered are kept, directories newer than the newest completed checkpoint and records of
batches after the newest manifest are never touched, manifests are never deleted, and
--apply decides again from a fresh listing before it deletes. Keep the grace period above
the checkpoint timeout.""",
    "report": f"""examples:
  {PROG} report /data/checkpoints/my-job -o report.html
  {PROG} report s3://bucket/checkpoints/my-job -o report.html {_S3}
  {PROG} report /data/checkpoints/my-job --json > report.json
one HTML file that opens without network access: checkpoint durations and sizes, bytes
per batch, state per subtask, bytes per key group with the imbalance of every parallelism
up to twice the current one, restores and failures. Batches, the sync/async split,
restores and failures come from the job's metrics history (metrics/), the rest from its
checkpoints' _metadata""",
}


_SIMPLE_SERIALIZERS = ("str", "int", "float", "bool", "json", "pickle")

_NAMES = (
    "a checkpoint or savepoint directory, a batch manifest (JOBDIR/manifests/B), or "
    "JOBDIR/latest (the newest manifest or completed checkpoint)"
)


def _add_signing_key(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--signing-key-file",
        metavar="PATH",
        help="the job's checkpoint signing key (spark.statebackend.checkpoint."
        "signing-key-file): refuse the checkpoint unless it is signed with it and "
        "unchanged, before anything in it is decoded",
    )


def _add_allow_pickle(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help=f"{what}. Unpickling runs any code the checkpoint names: only for checkpoints "
        "that nobody but you could have written, or that pass --signing-key-file",
    )


def _storage_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--storage-option",
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        default=[],
        help="an fsspec storage option for remote URLs, e.g. endpoint_url=http://host:9000 "
        "for s3 (repeatable; VALUE is parsed as JSON if it can be). AWS credentials come "
        "from the usual AWS environment variables and files",
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``statebackend`` command."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Look into, verify, read, copy and clean statebackend checkpoints and "
        "savepoints on any fsspec storage (local paths, file://, s3://, ...).",
        epilog="examples:\n  "
        + "\n  ".join(
            [
                f"{PROG} list /data/checkpoints",
                f"{PROG} inspect /data/checkpoints/my-job/chk-42",
                f"{PROG} read /data/checkpoints/my-job/chk-42 --operator op --state total",
                f"{PROG} <command> --help",
            ]
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parent = _storage_parent()

    def command(
        name: str, help_text: str, run: Callable[[argparse.Namespace], int], sub: Any = commands
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(
            name.rsplit(" ", 1)[-1],
            help=help_text,
            description=help_text,
            epilog=_EXAMPLES[name],
            parents=[parent],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(run=run, command_parser=p)
        return p

    p = command("list", "the jobs in a directory and their checkpoints and savepoints", cmd_list)
    p.add_argument(
        "directory", metavar="DIR", type=normalize_url, help="the checkpoint directory, or a job's"
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("inspect", "operators, states and subtasks of a checkpoint", cmd_inspect)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help=_NAMES)
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_signing_key(p)

    p = command("verify", "check every file of a checkpoint by size and checksum", cmd_verify)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help=_NAMES)
    _add_signing_key(p)

    p = command("plan", "what each subtask would restore at another parallelism", cmd_plan)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help=_NAMES)
    _add_signing_key(p)
    p.add_argument("--parallelism", "-p", type=int, required=True, metavar="P")
    p.add_argument("--operator", metavar="OP", help="only this operator")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("read", "print a state's entries, without Spark", cmd_read)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help=_NAMES)
    p.add_argument("--operator", required=True, metavar="OP")
    p.add_argument("--state", metavar="NAME", help="the state to read")
    p.add_argument(
        "--timers", action="store_true", help="read the timers (domain, timestamp, key) instead"
    )
    p.add_argument("--key", metavar="K", help="only this key (reads only its key group)")
    p.add_argument("--format", choices=("jsonl", "csv", "table"), default="jsonl")
    _add_allow_pickle(p, "unpickle pickled keys and values (default: shown as base64)")
    _add_signing_key(p)

    savepoint = commands.add_parser(
        "savepoint",
        help="create, trigger, transform or bootstrap a savepoint",
        description="Create a savepoint from a checkpoint, ask a running job for one, write "
        "a changed copy of one, or bootstrap one from data.",
        epilog=_EXAMPLES["savepoint"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = savepoint.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = command(
        "savepoint create",
        "copy a completed checkpoint into a self-contained savepoint",
        cmd_savepoint_create,
        actions,
    )
    p.add_argument("--from", dest="source", required=True, metavar="CHECKPOINT", help=_NAMES)
    p.add_argument("--to", dest="target", required=True, metavar="DIR")
    p.add_argument(
        "--parallelism",
        "-p",
        type=int,
        metavar="P",
        help="for a batch manifest: write the folded state at P subtasks (default: the "
        "operators' parallelism at that batch)",
    )
    _add_allow_pickle(
        p, "for a batch manifest whose rebuild migrates pickled values to a changed serializer"
    )
    _add_signing_key(p)
    p = command(
        "savepoint transform",
        "write a new savepoint with operators or states dropped or states renamed",
        cmd_savepoint_transform,
        actions,
    )
    p.add_argument("--from", dest="source", required=True, metavar="CHECKPOINT")
    p.add_argument("--to", dest="target", required=True, metavar="DIR")
    p.add_argument("--drop-operator", action="append", default=[], metavar="OP", help="repeatable")
    p.add_argument(
        "--drop-state", action="append", default=[], metavar="OP/STATE", help="repeatable"
    )
    p.add_argument(
        "--rename-state", action="append", default=[], metavar="OP/STATE=NEW", help="repeatable"
    )
    p.add_argument("--parallelism", "-p", type=int, metavar="P", help="default: unchanged")
    p.add_argument("--compression", choices=CODECS, default="none")
    p = command(
        "savepoint bootstrap",
        "write a new savepoint of one operator's keyed state from JSON Lines files",
        cmd_savepoint_bootstrap,
        actions,
    )
    p.add_argument("--to", dest="target", required=True, metavar="DIR")
    p.add_argument("--operator", required=True, metavar="OP")
    p.add_argument(
        "--state",
        action="append",
        required=True,
        metavar="NAME:KIND=FILE",
        help=f"a state, KIND one of {', '.join(KINDS)} (repeatable)",
    )
    p.add_argument("--parallelism", "-p", type=int, required=True, metavar="P")
    p.add_argument("--max-parallelism", type=int, metavar="M", help="default: from P")
    for flag, default in (("--key-serializer", "str"), ("--value-serializer", "json")):
        p.add_argument(flag, choices=_SIMPLE_SERIALIZERS, default=default)
    p.add_argument(
        "--map-key-serializer", choices=_SIMPLE_SERIALIZERS, default="str", help="for map state"
    )
    p.add_argument("--job-id", default="bootstrap", metavar="ID")
    p = command(
        "savepoint trigger",
        "ask the running job in JOBDIR to take a savepoint",
        cmd_savepoint_trigger,
        actions,
    )
    p.add_argument(
        "job_dir", metavar="JOBDIR", type=normalize_url, help="the job's checkpoint directory"
    )
    p.add_argument(
        "--to",
        dest="target",
        metavar="DIR",
        type=normalize_url,
        help="where (default: JOBDIR/savepoints)",
    )
    p.add_argument(
        "--wait", type=float, metavar="SECONDS", help="wait this long and print the path"
    )

    p = command("gc", "list or delete files no checkpoint or savepoint uses", cmd_gc)
    p.add_argument(
        "directory",
        metavar="DIR",
        type=normalize_url,
        help="a job's directory, or the directory of jobs",
    )
    p.add_argument("--apply", action="store_true", help="delete them (default: only list)")
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        metavar="SECONDS",
        help=f"keep files modified less than this long ago (default {DEFAULT_GRACE_SECONDS:g})",
    )

    p = command("report", "an HTML page (or JSON) of a job's checkpoints and metrics", cmd_report)
    p.add_argument(
        "job_dir", metavar="JOBDIR", type=normalize_url, help="the job's checkpoint directory"
    )
    p.add_argument(
        "--output", "-o", metavar="FILE", help="where (default report.html; for --json stdout)"
    )
    p.add_argument("--json", action="store_true", help="the report's data as JSON")
    return parser


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that what it buffers is not written at exit."""
    with suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's, names what it takes
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.run(args))
    except StateBackendError as exc:
        message = " ".join(str(exc).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. piped into head: stop quietly, as other tools do
        _discard_stdout()
        return 141
    except OSError as exc:  # a local file or the output stream (a full disk, a directory)
        _discard_stdout()  # what stdout still buffers would fail again at exit
        where = f": {exc.filename}" if exc.filename else " (writing the output)"
        print(f"{PROG}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
