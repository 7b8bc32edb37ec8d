"""The savepoint request protocol between ``statebackend savepoint trigger`` and a driver,
and the key parsing of ``statebackend read --key``."""

from __future__ import annotations

import datetime
import decimal
import json
import re
import uuid
from typing import Any

import pytest

from statebackend.checkpoint.filesystem import CheckpointFileSystem, open_filesystem
from statebackend.checkpoint.layout import join
from statebackend.checkpoint.requests import (
    REQUESTS_DIR,
    answer_savepoint_request,
    pending_savepoint_requests,
    request_savepoint,
    wait_for_savepoint,
)
from statebackend.errors import CheckpointCorruptedError, CheckpointError, ConfigurationError
from statebackend.serializers import (
    IntSerializer,
    JsonSerializer,
    PickleSerializer,
    RowTupleSerializer,
    Serializer,
    StrSerializer,
    TupleSerializer,
)
from statebackend.tools.reader import parse_key, to_jsonable


def _schema(*fields: tuple[str, str]) -> str:
    """A key schema's JSON, as ``StructType.json()`` writes it."""
    return json.dumps(
        {
            "type": "struct",
            "fields": [
                {"name": name, "type": kind, "nullable": True, "metadata": {}}
                for name, kind in fields
            ],
        }
    )


ONE_STRING = _schema(("user", "string"))
ONE_LONG = _schema(("n", "long"))
STRING_AND_LONG = _schema(("user", "string"), ("n", "long"))


@pytest.fixture
def fs() -> CheckpointFileSystem:
    return open_filesystem("memory://")


@pytest.fixture
def job_dir() -> str:
    return f"memory://requests-{uuid.uuid4().hex}/job"


def test_requests_are_pending_until_answered(fs: CheckpointFileSystem, job_dir: str) -> None:
    first = request_savepoint(fs, job_dir)
    second = request_savepoint(fs, job_dir, "memory://elsewhere/sp")
    pending = pending_savepoint_requests(fs, job_dir)
    assert [r.request_id for r in pending] == [first, second]
    assert pending[0].savepoint_dir(job_dir) == join(
        job_dir, "savepoints", f"savepoint-request-{first}"
    )
    assert pending[1].savepoint_dir(job_dir) == "memory://elsewhere/sp"
    answer_savepoint_request(fs, job_dir, pending[0], savepoint_path="memory://x/sp")
    answer_savepoint_request(fs, job_dir, pending[1], error="disk full")
    assert pending_savepoint_requests(fs, job_dir) == []
    assert wait_for_savepoint(fs, job_dir, first, 0) == "memory://x/sp"
    with pytest.raises(CheckpointError, match="disk full"):
        wait_for_savepoint(fs, job_dir, second, 0)


def test_an_answer_needs_exactly_a_path_or_an_error(fs: CheckpointFileSystem, job_dir: str) -> None:
    request_savepoint(fs, job_dir)
    [request] = pending_savepoint_requests(fs, job_dir)
    for kwargs in ({}, {"savepoint_path": "p", "error": "e"}):
        with pytest.raises(ConfigurationError):
            answer_savepoint_request(fs, job_dir, request, **kwargs)


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"requested_at": 1' + b"0" * 400 + b', "target_dir": null}',  # no float holds it
        b"[" * 100_000 + b"]" * 100_000,  # nested too deep for json.loads
    ],
    ids=["not JSON", "huge time", "deep nesting"],
)
def test_malformed_requests_are_answered_with_an_error(
    fs: CheckpointFileSystem, job_dir: str, content: bytes
) -> None:
    """A request file read by the running job's driver: a time no float holds raised a raw
    OverflowError there, nesting too deep a RecursionError, failing the job."""
    request_id = "0000000000001-abcdef01"
    fs.write_atomic(join(job_dir, REQUESTS_DIR, f"savepoint-{request_id}.json"), content)
    assert pending_savepoint_requests(fs, job_dir) == []
    with pytest.raises(CheckpointError, match="malformed"):
        wait_for_savepoint(fs, job_dir, request_id, 0)


@pytest.mark.parametrize("target", ["{job}", "{job}/chk-9", "{job}/shared", "s3://b/sp"])
def test_a_request_into_the_jobs_own_files_is_answered_with_an_error(
    fs: CheckpointFileSystem, job_dir: str, target: str
) -> None:
    """A request file written by hand (or an older command) into the job's own directory,
    or onto another storage than the job's, was served as given by the job's driver."""
    request_id = "0000000000001-abcdef01"
    document = {"request_id": request_id, "requested_at": 1.0}
    document["target_dir"] = target.format(job=job_dir)
    path = join(job_dir, REQUESTS_DIR, f"savepoint-{request_id}.json")
    fs.write_atomic(path, json.dumps(document).encode())
    assert pending_savepoint_requests(fs, job_dir) == []
    with pytest.raises(CheckpointError, match=re.escape(document["target_dir"])):
        wait_for_savepoint(fs, job_dir, request_id, 0)


def test_waiting_times_out_with_a_clear_error(fs: CheckpointFileSystem, job_dir: str) -> None:
    request_id = request_savepoint(fs, job_dir)
    slept: list[float] = []
    with pytest.raises(CheckpointError, match="no answer"):
        wait_for_savepoint(fs, job_dir, request_id, 0.05, poll_interval=0.01, sleep=slept.append)
    assert slept and all(s <= 0.01 for s in slept)


@pytest.mark.parametrize(
    ("text", "serializer", "expected"),
    [
        ("alice", StrSerializer(), "alice"),
        ("42", StrSerializer(), "42"),
        ("42", IntSerializer(), 42),
        ('["alice", 3]', TupleSerializer(StrSerializer(), IntSerializer()), ("alice", 3)),
        ('{"a": 1}', JsonSerializer(), {"a": 1}),
        ("[1, 2]", PickleSerializer(), (1, 2)),
        ("plain text", PickleSerializer(), "plain text"),
        ("u8", RowTupleSerializer(ONE_STRING), ("u8",)),
        ('["u8"]', RowTupleSerializer(ONE_STRING), ("u8",)),
        ("7", RowTupleSerializer(ONE_LONG), (7,)),
        ('["a", 7]', RowTupleSerializer(STRING_AND_LONG), ("a", 7)),
    ],
)
def test_keys_are_parsed_for_their_serializer(
    text: str, serializer: Serializer[Any], expected: object
) -> None:
    assert parse_key(text, serializer.config()) == expected


def test_a_key_as_read_prints_it_is_parsed_back_for_every_key_type() -> None:
    """What ``statebackend read`` prints for a key of date, timestamp, decimal and binary
    columns, given back to ``read --key``, is that key: such keys were refused ("is not
    a datetime.date"), and a decimal given as a JSON number was the float nearest to it."""
    schema = _schema(
        ("day", "date"),
        ("at", "timestamp"),
        ("wall", "timestamp_ntz"),
        ("amount", "decimal(38,18)"),
        ("raw", "binary"),
    )
    key = (
        datetime.date(1969, 7, 20),
        datetime.datetime(1969, 7, 20, 20, 17, 40, 123456),
        datetime.datetime(2024, 2, 29, 23, 59, 59),
        decimal.Decimal("0.100000000000000000"),
        b"\x00\xffa'",
    )
    printed = json.dumps(to_jsonable(key))
    config = RowTupleSerializer(schema).config()
    assert parse_key(printed, config) == key
    assert RowTupleSerializer(schema).serialize(parse_key(printed, config)) == (
        RowTupleSerializer(schema).serialize(key)
    )
    one_decimal = RowTupleSerializer(_schema(("amount", "decimal(38,18)"))).config()
    assert parse_key("0.1", one_decimal) == (decimal.Decimal("0.1"),)
    assert parse_key('["ab"]', RowTupleSerializer(_schema(("raw", "binary"))).config()) == (b"ab",)


@pytest.mark.parametrize("kind", ["double", "float"])
def test_a_negative_zero_or_nan_key_finds_the_key_transform_with_state_stored(kind: str) -> None:
    """``transform_with_state`` stores a float key's -0.0 as 0.0 and every NaN as one NaN
    (as Spark's groupBy keys them); ``read --key -0.0`` looked up the bits of -0.0 and
    found nothing."""
    serializer = RowTupleSerializer(_schema(("reading", kind), ("n", "long")))
    stored_zero = serializer.serialize((0.0, 1))
    stored_nan = serializer.serialize((float("nan"), 1))
    for text in ("[-0.0, 1]", "[0.0, 1]", "[0, 1]"):
        assert serializer.serialize(parse_key(text, serializer.config())) == stored_zero
    assert serializer.serialize(parse_key("[NaN, 1]", serializer.config())) == stored_nan
    one = RowTupleSerializer(_schema(("reading", kind)))
    assert one.serialize(parse_key("-0.0", one.config())) == one.serialize((0.0,))


def test_a_key_that_does_not_fit_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="does not fit"):
        parse_key("abc", IntSerializer().config())
    with pytest.raises(ConfigurationError, match=r"2 key columns \['user', 'n'\]"):
        parse_key("alice", RowTupleSerializer(STRING_AND_LONG).config())


def test_a_map_state_with_tuple_user_keys_prints_as_a_json_object() -> None:
    """A transform_with_state map state's user keys are tuples of its key schema: they
    become the JSON text of their fields, so the map stays a JSON object, not a repr."""
    value = {("x", 1): [9], ("y", 2): {"nested": (3, 4)}}
    jsonable = to_jsonable(value)
    assert jsonable == {'["x", 1]': [9], '["y", 2]': {"nested": [3, 4]}}
    assert {tuple(json.loads(k)): v for k, v in json.loads(json.dumps(jsonable)).items()} == {
        ("x", 1): [9],
        ("y", 2): {"nested": [3, 4]},
    }


def test_dates_times_and_decimals_print_as_json_text() -> None:
    """A transform_with_state value with timestamp, date and decimal fields prints as
    JSON (ISO 8601 text, the decimal's digits), not as the repr of the whole value."""
    at = datetime.datetime(2024, 1, 1, 0, 4, 37, 120, tzinfo=datetime.UTC)
    value = [40, at, datetime.date(2024, 7, 1), decimal.Decimal("1871.50"), datetime.time(9, 30)]
    assert to_jsonable(value) == [
        40,
        "2024-01-01T00:04:37.000120+00:00",
        "2024-07-01",
        "1871.50",
        "09:30:00",
    ]
    assert to_jsonable({"naive": datetime.datetime(2024, 1, 1)}) == {"naive": "2024-01-01T00:00:00"}


@pytest.mark.parametrize(
    "content", [b"{not json", b"[1, 2]", b'{"error": null}', b'{"savepoint": 5, "error": null}']
)
def test_a_malformed_answer_is_one_corruption_error(
    fs: CheckpointFileSystem, job_dir: str, content: bytes
) -> None:
    """An answer file that is no answer made ``savepoint trigger`` raise a raw
    JSONDecodeError, AttributeError or KeyError (a traceback), or print a number as the
    savepoint's path."""
    request_id = request_savepoint(fs, job_dir)
    path = join(job_dir, REQUESTS_DIR, f"savepoint-{request_id}.done.json")
    fs.write_atomic(path, content)
    with pytest.raises(CheckpointCorruptedError, match=re.escape(path)):
        wait_for_savepoint(fs, job_dir, request_id, 0)
