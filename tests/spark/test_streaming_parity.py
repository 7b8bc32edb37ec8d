"""Parity with Spark: value, list and map state processors (Row and pandas mode) give
the same output per micro-batch through Spark's transformWithState and through ours,
and both equal a plain-Python computation."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from pyspark import cloudpickle
from pyspark.sql import Row, SparkSession
from pyspark.sql.streaming.stateful_processor import (
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from tests.spark import streaming_parity
from tests.spark.streaming_parity import ParityCase, run_parity

# Spark's workers cannot import test modules: ship their classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(streaming_parity)

INPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("item", StringType()),
        StructField("amount", LongType()),
    ]
)
OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("count", LongType()),
        StructField("total", LongType()),
        StructField("listed", LongType()),
        StructField("distinct", LongType()),
    ]
)
BATCHES = [
    [
        {"user": "alice", "item": "x", "amount": 3},
        {"user": "bob", "item": "y", "amount": 4},
        {"user": "alice", "item": "y", "amount": 5},
    ],
    [
        {"user": "carol", "item": "x", "amount": 1},
        {"user": "alice", "item": "x", "amount": 2},
    ],
    [
        {"user": "bob", "item": "z", "amount": 10},
        {"user": "bob", "item": "y", "amount": 1},
        {"user": "dave", "item": "x", "amount": 7},
        {"user": "carol", "item": "z", "amount": 6},
    ],
]


class AllStates(StatefulProcessor):
    """Value state (count, total), list state (every amount) and map state (item ->
    count), each declared its own way (DDL string, StructType); one row per key."""

    use_pandas = False

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count_total = handle.getValueState("count_total", "count long, total long")
        self.amounts = handle.getListState("amounts", StructType([StructField("v", LongType())]))
        self.items = handle.getMapState("items", "item string", "n long")

    def update(self, records: list[dict[str, Any]]) -> tuple[int, int, int, int]:
        count, total = self.count_total.get() or (0, 0)
        count += len(records)
        total += sum(int(r["amount"]) for r in records)
        self.count_total.update((count, total))
        self.amounts.appendList([(int(r["amount"]),) for r in records])
        for r in records:
            current = self.items.getValue((r["item"],))
            self.items.updateValue((r["item"],), ((current[0] if current else 0) + 1,))
        listed = sum(v for (v,) in self.amounts.get())
        return count, total, listed, len(list(self.items.keys()))

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        if self.use_pandas:
            count, total, listed, distinct = self.update(
                [r for df in rows for r in df.to_dict("records")]
            )
            yield pd.DataFrame(
                {
                    "user": [key[0]],
                    "count": [count],
                    "total": [total],
                    "listed": [listed],
                    "distinct": [distinct],
                }
            )
        else:
            values = self.update([row.asDict() for row in rows])
            yield Row(
                user=key[0], count=values[0], total=values[1], listed=values[2], distinct=values[3]
            )

    def close(self) -> None:
        pass


class PandasAllStates(AllStates):
    """The same in pandas mode (transformWithStateInPandas)."""

    use_pandas = True


def _expected(batches: list[list[dict[str, Any]]]) -> Counter[tuple[int, tuple[Any, ...]]]:
    """Plain Python: per batch, one row per key that had input."""
    amounts: dict[str, list[int]] = {}
    items: dict[str, set[str]] = {}
    out: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(batches):
        for user in {r["user"] for r in batch}:
            rows = [r for r in batch if r["user"] == user]
            amounts.setdefault(user, []).extend(r["amount"] for r in rows)
            items.setdefault(user, set()).update(r["item"] for r in rows)
            total = sum(amounts[user])
            out[(batch_id, (user, len(amounts[user]), total, total, len(items[user])))] += 1
    return out


@pytest.mark.parametrize("processor", [AllStates, PandasAllStates], ids=["row", "pandas"])
def test_same_output_as_spark_per_batch(
    spark_local: SparkSession, tmp_path: Path, processor: type[AllStates]
) -> None:
    case = ParityCase(INPUT, ["user"], processor, OUTPUT, use_pandas=processor.use_pandas)
    theirs, ours = run_parity(spark_local, case, BATCHES, tmp_path)
    expected = _expected(BATCHES)
    assert theirs == expected
    assert ours == expected


TIMED_INPUT = StructType([*INPUT.fields, StructField("ts", TimestampType())])


def _at(second: int) -> str:
    return f"2026-01-01T00:00:{second:02d}Z"


def test_event_time_drops_late_rows_like_spark(spark_local: SparkSession, tmp_path: Path) -> None:
    """Batch N drops rows at or below the watermark of batch N-1 (offsets/N-1)."""
    batches = [
        [
            {"user": "a", "item": "x", "amount": 1, "ts": _at(10)},
            {"user": "b", "item": "x", "amount": 2, "ts": _at(20)},
        ],
        [
            {"user": "a", "item": "y", "amount": 3, "ts": _at(5)},  # on time: watermark 0
            {"user": "c", "item": "x", "amount": 4, "ts": _at(30)},
        ],
        [
            {"user": "a", "item": "z", "amount": 5, "ts": _at(20)},  # late: watermark 20 s
            {"user": "b", "item": "y", "amount": 6, "ts": _at(21)},
        ],
    ]
    case = ParityCase(
        TIMED_INPUT,
        ["user"],
        AllStates,
        OUTPUT,
        time_mode="EventTime",
        watermark=("ts", "0 seconds"),
    )
    theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    on_time = [batch if n != 2 else batch[1:] for n, batch in enumerate(batches)]
    expected = _expected(on_time)
    assert theirs == expected
    assert ours == expected
