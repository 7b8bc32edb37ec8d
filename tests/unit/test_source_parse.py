"""The log source's line parser (``parse_line``) and its one-pass batch read
(``LogSource.read_grouped``) give exactly what ``json.loads`` of each line gives: the same
values of the same types, or the same exception type, including where orjson, which reads
the usual lines, and json.loads disagree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statebackend.spark.source import LogSource, parse_line, partition_path

_EDGE_LINES = [
    b'{"user": "a", "amount": 3}\n',
    b'  {"user": "a"}  \r\n',
    b"1\n",
    b"1, 2\n",
    b"[1,\n",
    b'{"user": "\xc3\xa9"}\n',
    b'{"user": "\xff"}\n',
    b"\xef\xbb\xbf{}\n",  # a byte-order mark: json.loads takes it, orjson does not
    b"NaN\n",
    b"[Infinity, -Infinity]\n",
    b"\n",
    b'{"id": 99999999999999999999999}\n',  # beyond 64 bits: orjson would give a float
    b"18446744073709551615\n",  # the largest unsigned 64-bit integer
    b"18446744073709551616\n",
    b"-9223372036854775809\n",
    b'{"x": 1e400}\n',  # json.loads: inf; orjson rejects it
    b'"\\ud800"\n',  # a lone surrogate
    b'{"a": 1, "a": 2, "b": 3}\n',  # the last duplicate wins, at the first one's place
    b'{"\\u0075ser": "u"}\n',
    b'"\x01"\n',
    b"\x0c1\n",
    b"-0\n",
    b"0.1\n",
]


def _same(got: object, expected: object) -> bool:
    """Equal with the same types all the way down (1.0 is not 1), NaN equal to NaN."""
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(got, float) and math.isnan(got)
    if type(got) is not type(expected):
        return False
    if isinstance(expected, dict):
        assert isinstance(got, dict)
        return list(got) == list(expected) and all(_same(got[k], expected[k]) for k in expected)
    if isinstance(expected, list):
        assert isinstance(got, list)
        return len(got) == len(expected) and all(map(_same, got, expected))
    return got == expected


def _check_line(line: bytes) -> None:
    try:
        expected: object = json.loads(line)
    except Exception as exc:
        with pytest.raises(type(exc)):
            parse_line(line)
        return
    assert _same(parse_line(line), expected)


@pytest.mark.parametrize("line", _EDGE_LINES)
def test_parse_line_is_json_loads(line: bytes) -> None:
    _check_line(line)


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats()
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(_JSON_VALUES, st.booleans())
def test_parse_line_is_json_loads_for_any_value(value: object, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only) + "\n"
    _check_line(text.encode("utf-8", "surrogatepass"))


@settings(max_examples=300, deadline=None)
@given(st.text("0123456789.eE+-", min_size=1, max_size=30))
def test_parse_line_is_json_loads_for_any_number_text(text: str) -> None:
    _check_line(text.encode() + b"\n")


def test_read_grouped_is_json_loads_per_line(tmp_path: Path) -> None:
    """A batch with a line orjson would read differently, or not at all, falls back to the
    line-by-line read: the grouped records are json.loads's, of the same types."""
    records = [
        {"user": "a", "n": 1},
        {"user": "b", "n": 99999999999999999999999},
        {"user": "a", "n": float("inf")},
        {"user": "c", "n": float("nan")},
        {"user": "\ud800", "n": 2},
    ]
    for shown in range(1, len(records) + 1):
        data = "".join(json.dumps(r) + "\n" for r in records[:shown]).encode()
        partition_path(tmp_path, 0).write_bytes(data)
        grouped = LogSource(str(tmp_path)).read_grouped(
            0, 0, 100, lambda r: r["user"], len(data), lambda key: True
        )
        expected: dict[str, list[object]] = {}
        for line in data.splitlines(keepends=True):
            record = json.loads(line)
            expected.setdefault(record["user"], []).append(record)
        assert _same(grouped.groups, expected)
        assert grouped.offset == len(data)
