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
from pyspark.sql.types import LongType, StringType, StructField, StructType

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
        StructField("a", LongType()),
        StructField("b", LongType()),
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


class _Base(StatefulProcessor):
    """Row or pandas plumbing around ``update(records) -> (a, b)`` over some state."""

    use_pandas = False

    def update(self, records: list[dict[str, Any]]) -> tuple[int, int]:
        raise NotImplementedError

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        if self.use_pandas:
            records = [r for df in rows for r in df.to_dict("records")]
            a, b = self.update(records)
            yield pd.DataFrame({"user": [key[0]], "a": [a], "b": [b]})
        else:
            a, b = self.update([row.asDict() for row in rows])
            yield Row(user=key[0], a=a, b=b)

    def close(self) -> None:
        pass


class CountSum(_Base):
    """Value state: (count, sum of amounts) so far."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.state = handle.getValueState("count_sum", "count long, total long")

    def update(self, records: list[dict[str, Any]]) -> tuple[int, int]:
        count, total = self.state.get() or (0, 0)
        count += len(records)
        total += sum(int(r["amount"]) for r in records)
        self.state.update((count, total))
        return count, total


class AmountList(_Base):
    """List state: every amount so far; (length, sum)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.state = handle.getListState("amounts", StructType([StructField("v", LongType())]))

    def update(self, records: list[dict[str, Any]]) -> tuple[int, int]:
        self.state.appendList([(int(r["amount"]),) for r in records])
        amounts = [v for (v,) in self.state.get()]
        return len(amounts), sum(amounts)


class ItemCounts(_Base):
    """Map state: item -> count; (distinct items, total count)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.state = handle.getMapState("items", "item string", "n long")

    def update(self, records: list[dict[str, Any]]) -> tuple[int, int]:
        for r in records:
            current = self.state.getValue((r["item"],))
            self.state.updateValue((r["item"],), ((current[0] if current else 0) + 1,))
        counts = [n for (n,) in self.state.values()]
        return len(counts), sum(counts)


def _pandas(cls: type[_Base]) -> type[_Base]:
    return type(f"Pandas{cls.__name__}", (cls,), {"use_pandas": True})


def _expected(kind: str) -> Counter[tuple[int, tuple[Any, ...]]]:
    """Plain Python: per batch, one row per key that had input."""
    amounts: dict[str, list[int]] = {}
    items: dict[str, Counter[str]] = {}
    out: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(BATCHES):
        for user in sorted({r["user"] for r in batch}):
            rows = [r for r in batch if r["user"] == user]
            amounts.setdefault(user, []).extend(r["amount"] for r in rows)
            items.setdefault(user, Counter()).update(r["item"] for r in rows)
            if kind == "map":
                a, b = len(items[user]), sum(items[user].values())
            else:
                a, b = len(amounts[user]), sum(amounts[user])
            out[(batch_id, (user, a, b))] += 1
    return out


@pytest.mark.parametrize(
    ("processor", "kind", "use_pandas"),
    [
        (CountSum, "value", False),
        (_pandas(CountSum), "value", True),
        (AmountList, "list", False),
        (_pandas(ItemCounts), "map", True),
        (ItemCounts, "map", False),
    ],
    ids=["value-row", "value-pandas", "list-row", "map-pandas", "map-row"],
)
def test_same_output_as_spark_per_batch(
    spark_local: SparkSession, tmp_path: Path, processor: type, kind: str, use_pandas: bool
) -> None:
    case = ParityCase(INPUT, ["user"], processor, OUTPUT, use_pandas=use_pandas)
    theirs, ours = run_parity(spark_local, case, BATCHES, tmp_path)
    expected = _expected(kind)
    assert theirs == expected
    assert ours == expected
