"""Where a single-stage batch ends (``LogSource.batch_end``) and reading up to it
(``LogSource.read(..., end=)``, ``LogSource.read_grouped``), against a plain-Python scan
of the lines; the ``batch.single-stage-bytes`` setting."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from statebackend.errors import ConfigurationError, SourceError
from statebackend.spark.conf import DEFAULT_SINGLE_STAGE_BYTES, StateBackendConf
from statebackend.spark.source import LogSource, partition_path

KEY = "spark.statebackend.batch.single-stage-bytes"


def _expected_end(data: bytes, offset: int, max_lines: int, max_bytes: int) -> int | None:
    """Plain Python: after ``max_lines`` newlines from ``offset`` (or after the last one),
    None if that is past ``max_bytes`` (or, with fewer lines, the file's end is)."""
    position, lines = offset, 0
    while lines < max_lines and (newline := data.find(b"\n", position)) >= 0:
        position, lines = newline + 1, lines + 1
    spanned = (position if lines == max_lines else len(data)) - offset
    return position if spanned <= max_bytes else None


def test_batch_end_matches_a_plain_scan(tmp_path: Path) -> None:
    rng = random.Random(7)
    source = LogSource(str(tmp_path))
    for _ in range(400):
        lines = [b"x" * rng.randint(0, 20) + b"\n" for _ in range(rng.randint(0, 40))]
        data = b"".join(lines) + b"y" * rng.randint(0, 5)  # maybe an incomplete last line
        partition_path(tmp_path, 0).write_bytes(data)
        offset = sum(map(len, lines[: rng.randint(0, len(lines))]))
        max_lines, max_bytes = rng.randint(1, 50), rng.randint(0, 400)
        expected = _expected_end(data, offset, max_lines, max_bytes)
        assert source.batch_end(0, offset, max_lines, max_bytes) == expected


def test_read_up_to_the_end_gives_the_lines_before_it(tmp_path: Path) -> None:
    events = [{"user": f"u{i % 7}", "amount": i} for i in range(50)]
    partition_path(tmp_path, 0).write_text(
        "".join(json.dumps(e) + "\n" for e in events) + '{"user": "incomplete', encoding="utf-8"
    )
    source = LogSource(str(tmp_path))
    start = source.read(0, 0, 10, lambda r: r["user"]).offset
    end = source.batch_end(0, start, 25, 1 << 20)
    assert end is not None
    batch = source.read(0, start, 1000, lambda r: r["user"], end)
    assert [record for _, record in batch.records] == events[10:35]
    assert batch.offset == end
    # Without an end the same call reads on, up to the incomplete line.
    rest = source.read(0, start, 1000, lambda r: r["user"])
    assert [record for _, record in rest.records] == events[10:]


def test_read_with_an_end_skips_malformed_lines_before_it(tmp_path: Path) -> None:
    partition_path(tmp_path, 0).write_text(
        '{"user": "a"}\nnot json\n{"user": "b"}\n{"user": "c"}\n'
    )
    source = LogSource(str(tmp_path), on_malformed="skip")
    end = source.batch_end(0, 0, 3, 1 << 20)
    batch = source.read(0, 0, 3, lambda r: r["user"], end)
    assert [key for key, _ in batch.records] == ["a", "b"]
    assert (batch.offset, batch.skipped) == (end, 1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", 0), ("512k", 512 << 10), ("2m", 2 << 20), ("512KB", 512 << 10), ("2mb", 2 << 20)],
)
def test_single_stage_bytes_setting(text: str, expected: int) -> None:
    assert StateBackendConf.from_pairs([(KEY, text)]).single_stage_bytes == expected
    assert StateBackendConf().single_stage_bytes == DEFAULT_SINGLE_STAGE_BYTES


@pytest.mark.parametrize("text", ["-1", "lots", "2x", "", "1.5m", "-1k"])
def test_single_stage_bytes_rejects_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ConfigurationError, match="single-stage-bytes"):
        StateBackendConf.from_pairs([(KEY, text)])


_LINES = [
    '{"user": "a", "amount": 1}',
    '{"user": "bé", "amount": -2.5}',  # not ASCII: byte offsets differ from characters
    '{"user": "\\u00e9\\n", "amount": [1, {"x": null}]}',
    '  {"user": "c"}',  # leading whitespace: json.loads takes it
    '{"user": "d"}  ',
    '{"user": "e"}\r',
    '{"amount": 3}',  # no key
    '{"user": "f"',  # not JSON
    '{"user": "g"} {"user": "h"}',  # two values
    "[1, 2]",
    "\ufeff" + '{"user": "i"}',  # a byte-order mark
    '{"user": "j", "user": "k"}',  # the last duplicate wins, as in json.loads
]


def _expected_read(lines: list[str], on_malformed: str) -> tuple[list[tuple[str, object]], int]:
    """Plain Python: json.loads of each line's bytes, the record's ``user`` as its key."""
    records, skipped = [], 0
    for line in lines:
        try:
            record = json.loads((line + "\n").encode())
            records.append((record["user"], record))
        except Exception:
            if on_malformed == "fail":
                raise
            skipped += 1
    return records, skipped


def _grouped(records: list[tuple[str, object]], wanted: set[str]) -> dict[str, list[object]]:
    """Plain Python: the records of the wanted keys, grouped by key in line order."""
    groups: dict[str, list[object]] = {}
    for key, record in records:
        if key in wanted:
            groups.setdefault(key, []).append(record)
    return groups


@pytest.mark.parametrize("on_malformed", ["fail", "skip"])
def test_read_to_an_end_parses_as_json_loads_per_line(tmp_path: Path, on_malformed: str) -> None:
    """A batch read to its end gives what json.loads of each line gives, the same as
    reading the same lines without an end; read grouped (in one pass, ``_group_whole``,
    falling back line by line for anything unusual), it gives the wanted keys' records."""
    rng = random.Random(11)
    source = LogSource(str(tmp_path), on_malformed=on_malformed)
    for _ in range(300):
        usual = rng.random() < 0.5
        lines = [rng.choice(_LINES[:3] if usual else _LINES) for _ in range(rng.randint(0, 12))]
        data = "".join(line + "\n" for line in lines).encode()
        partition_path(tmp_path, 0).write_bytes(data + b'{"user": "z"')  # incomplete tail
        end = source.batch_end(0, 0, len(lines) + 5, 1 << 20)
        assert end == len(data)
        try:
            expected = _expected_read(lines, on_malformed)
        except Exception:
            with pytest.raises(SourceError, match="malformed record"):
                source.read(0, 0, 1000, lambda r: r["user"], end)
            with pytest.raises(SourceError, match="malformed record"):
                source.read_grouped(0, 0, 1000, lambda r: r["user"], end, bool)
            continue
        for batch in (
            source.read(0, 0, 1000, lambda r: r["user"], end),
            source.read(0, 0, 1000, lambda r: r["user"]),
        ):
            assert (batch.records, batch.skipped) == expected
            assert batch.offset == len(data)
        wanted = {"a", "c", "e", "k", "\u00e9\n"}
        grouped = source.read_grouped(0, 0, 1000, lambda r: r["user"], end, wanted.__contains__)
        assert grouped.groups == _grouped(expected[0], wanted)
        assert list(grouped.groups) == list(_grouped(expected[0], wanted))  # first-seen order
        assert (grouped.offset, grouped.skipped) == (len(data), expected[1])
