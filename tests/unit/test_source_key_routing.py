"""A line whose key the job cannot route (the key serializer cannot encode it, or it
cannot be hashed) is a malformed line in both batch reads, checked against a plain-Python
reading of the lines: ``source_task`` (source stage and shuffle) and
``single_stage_input`` report the first malformed line's number, or skip and count such
lines with ``on_malformed="skip"``, and route every other record to its key group's
subtask."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from statebackend.errors import SourceError
from statebackend.keygroups import assign_to_key_group, compute_operator_index_for_key_group
from statebackend.serializers import StrSerializer
from statebackend.spark.source import LogSource, key_selector, partition_path
from statebackend.spark.tasks import MARKER, RECORD, SourcePlan, single_stage_input, source_task

MAX_PARALLELISM = 16
GOOD = st.builds(
    lambda key, value: json.dumps({"k": key, "v": value}),
    st.sampled_from(["a", "b", "c", "é", ""]),
    st.integers(0, 9),
)
BAD = st.sampled_from(
    ["not json", '{"v": 1}', '{"k": 5}', '{"k": null}', '{"k": [1]}', '{"k": {"a": 1}}']
)


def _expected(lines: list[str], start: int, max_records: int, skip: bool) -> Any:
    """(records, line after the last one read, skipped lines), or ("error", line number)."""
    records, skipped, position = [], 0, start
    for number in range(start, len(lines)):
        if len(records) >= max_records:
            break
        try:
            record = json.loads(lines[number])
            key = record["k"]
            if not isinstance(key, str):
                raise TypeError(key)
        except Exception:
            if not skip:
                return "error", number + 1
            skipped += 1
            position = number + 1
            continue
        records.append((key, record))
        position = number + 1
    return records, position, skipped


def _subtask(key: str, parallelism: int) -> int:
    group = assign_to_key_group(key.encode(), MAX_PARALLELISM)
    return compute_operator_index_for_key_group(MAX_PARALLELISM, parallelism, group)


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.one_of(GOOD, GOOD, BAD), max_size=12),
    data=st.data(),
    skip=st.booleans(),
    max_records=st.integers(1, 15),
    parallelism=st.integers(1, 3),
)
def test_both_batch_reads_treat_an_unroutable_key_as_a_malformed_line(
    lines: list[str], data: st.DataObject, skip: bool, max_records: int, parallelism: int
) -> None:
    directory = Path(tempfile.mkdtemp())
    partition_path(directory, 0).write_text("".join(line + "\n" for line in lines), "utf-8")
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode()) + 1)
    start = data.draw(st.integers(0, len(lines)))
    expected = _expected(lines, start, max_records, skip)
    plan = SourcePlan(
        LogSource(str(directory), "skip" if skip else "fail"),
        [[(0, offsets[start])]] + [[] for _ in range(parallelism - 1)],
        max_records,
        key_selector("k"),
        StrSerializer(),
        parallelism,
        MAX_PARALLELISM,
        {0: offsets[-1]},
    )
    if expected[0] == "error":
        for read in (lambda: list(source_task(plan, 0)), lambda: single_stage_input(plan, 0)):
            try:
                read()
            except SourceError as exc:
                assert f"partition-0.jsonl line {expected[1]}: malformed record" in str(exc)
            else:
                raise AssertionError(f"no SourceError for line {expected[1]}")
        return
    records, position, skipped = expected
    emitted = list(source_task(plan, 0))
    assert emitted[:-1] == [(_subtask(k, parallelism), (RECORD, k, r)) for k, r in records]
    assert emitted[-1] == (0, (MARKER, 0, [(0, offsets[position])], skipped))
    for subtask in range(parallelism):
        keyed = single_stage_input(plan, subtask)
        groups: dict[str, list[Any]] = {}
        for key, record in records:
            if _subtask(key, parallelism) == subtask:
                groups.setdefault(key, []).append(record)
        assert keyed.groups == groups
        if subtask == 0:
            assert keyed.source_offsets == {0: [(0, offsets[position])]}
            assert keyed.skipped == skipped
