"""A keyed subtask orders its input itself (``sorted_by_key``), as Spark's sort did."""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa
from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

from statebackend.spark.arrow_path import SORTED_BATCH_ROWS, sorted_by_key
from statebackend.spark.processor_runner import (
    CONTROL,
    INITIAL,
    INPUT,
    KEY_GROUP_COLUMN,
    KIND_COLUMN,
    SEQUENCE_COLUMN,
    SUBTASK_COLUMN,
)

Record = tuple[Any, ...]
"""(key, amount, kind, sequence, key group)"""


def _records(rng: random.Random, keys: list[Any], count: int) -> list[Record]:
    """Input and initial-state rows of a few keys in arrival order, and one control row."""
    groups = {repr(key): rng.randrange(8) for key in keys}
    records: list[Record] = [(None, None, CONTROL, 0, -1)]
    for sequence in range(count):
        key = rng.choice(keys)
        kind = INITIAL if rng.random() < 0.2 else INPUT
        records.append((key, rng.randrange(100), kind, sequence, groups[repr(key)]))
    rng.shuffle(records)  # the shuffle delivers them in any order
    return records


def _batches(records: list[Record], key_type: pa.DataType, size: int) -> list[pa.RecordBatch]:
    columns = list(zip(*records, strict=True))
    table = pa.table(
        {
            "user": pa.array(columns[0], key_type),
            "amount": pa.array(columns[1], pa.int64()),
            KIND_COLUMN: pa.array(columns[2], pa.int8()),
            SEQUENCE_COLUMN: pa.array(columns[3], pa.int64()),
            KEY_GROUP_COLUMN: pa.array(columns[4], pa.int32()),
            SUBTASK_COLUMN: pa.array([0] * len(records), pa.int32()),
        }
    )
    return table.to_batches(max_chunksize=size)


def _rows(batches: list[pa.RecordBatch]) -> list[Record]:
    table = pa.Table.from_batches(batches)
    names = ["user", "amount", KIND_COLUMN, SEQUENCE_COLUMN, KEY_GROUP_COLUMN]
    return list(zip(*(table.column(name).to_pylist() for name in names), strict=True))


def _schema_json(key_type: Any) -> str:
    return str(StructType([StructField("user", key_type)]).json())


def test_rows_are_ordered_by_key_group_key_kind_and_arrival() -> None:
    rng = random.Random(7)
    records = _records(rng, [f"user-{i}" for i in range(40)], 2_000)
    batches = _batches(records, pa.string(), 300)

    ordered = sorted_by_key(batches, ("user",), _schema_json(StringType()))

    control, *others = sorted(records, key=lambda r: r[4])  # key group -1 first
    expected = [control, *sorted(others, key=lambda r: (r[4], r[0], r[2], r[3]))]
    assert _rows(ordered) == expected
    assert max(batch.num_rows for batch in ordered) <= SORTED_BATCH_ROWS


def test_keys_arrow_cannot_sort_are_grouped_by_their_serialized_bytes() -> None:
    rng = random.Random(11)
    keys = [[i % 3, i] for i in range(30)] + [[], [None]]
    records = _records(rng, keys, 1_000)
    batches = _batches(records, pa.list_(pa.int64()), 128)

    ordered = _rows(sorted_by_key(batches, ("user",), _schema_json(ArrayType(LongType()))))

    assert sorted(map(repr, ordered)) == sorted(map(repr, records))
    assert [r[4] for r in ordered] == sorted(r[4] for r in records)
    runs: list[tuple[str, list[Record]]] = []
    for record in ordered[1:]:  # after the control row
        if not runs or runs[-1][0] != repr(record[0]):
            runs.append((repr(record[0]), []))
        runs[-1][1].append(record)
    # each key's rows are together, initial state first, each kind in arrival order
    assert len(runs) == len({name for name, _ in runs}) == len(keys)
    for name, rows in runs:
        mine = [r for r in records if repr(r[0]) == name]
        assert rows == sorted(mine, key=lambda r: (r[2], r[3]))
