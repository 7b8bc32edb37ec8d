"""A keyed subtask orders its input itself (``sorted_by_key``), as Spark's sort did."""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa
from pyspark.sql.streaming.stateful_processor import StatefulProcessor
from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

from statebackend.spark.arrow_path import (
    SORTED_BATCH_ROWS,
    KeyedBatchPlan,
    batch_fields,
    sorted_by_key,
    stream_part,
    with_batch_fields,
)
from statebackend.spark.local_state import LocalVersion
from statebackend.spark.processor_handle import BatchTimes, SchemaCatalog
from statebackend.spark.processor_runner import (
    CONTROL,
    INITIAL,
    INPUT,
    KEY_GROUP_COLUMN,
    KIND_COLUMN,
    SEQUENCE_COLUMN,
    SUBTASK_COLUMN,
    ProcessorSpec,
)
from statebackend.spark.tasks import StorageSpec

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


class _Nothing(StatefulProcessor):
    def init(self, handle: Any) -> None:
        """No state."""

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:  # noqa: N802,N803
        """No output."""
        return iter(())


def test_a_batch_plan_travels_as_its_streams_part_and_its_own_fields() -> None:
    """The keyed task's UDF holds ``stream_part`` (the same for every batch of a stream);
    the batch's own fields, read back from ``BATCH_PROPERTY``'s JSON, complete it to the
    very plan the driver made."""
    spec = ProcessorSpec(
        processor=_Nothing(),
        use_pandas=False,
        time_mode="ProcessingTime",
        key_columns=("user",),
        input_columns=("user", "amount"),
        initial_columns=(),
        output_schema_json=_schema_json(LongType()),
        catalog=SchemaCatalog(),
    )
    storage = StorageSpec("file:///tmp/ckpt", "job", {}, 4, "none")

    def plan(batch_id: int, checkpoint_id: int | None) -> KeyedBatchPlan:
        restore = batch_id - 1 if batch_id else None
        return KeyedBatchPlan(
            spec=spec,
            key_schema_json=_schema_json(LongType()),
            parallelism=3,
            max_parallelism=128,
            batch_id=batch_id,
            times=BatchTimes(1_000 + batch_id, 10 * batch_id, 20 * batch_id),
            version=LocalVersion(
                "binding",
                restore,
                None,
                3,
                128,
                restore,
                None if restore is None else ("run-17", "run-9", "run-170"),
            ),
            restore_batch=restore,
            storage=storage,
            local_dir="/tmp/local",
            checkpoint_id=checkpoint_id,
            run_id="run" if checkpoint_id else "",
            wait_for_upload=True,
        )

    plans = [plan(0, None), plan(1, 7), plan(2, None)]
    parts = [stream_part(each) for each in plans]
    assert parts[0] == parts[1] == parts[2]
    for each in plans:
        assert with_batch_fields(parts[0], batch_fields(each)) == each
    # The accepted attempts travel as their common prefix and the rest of each.
    assert batch_fields(plans[1]).count("run-") == 1
