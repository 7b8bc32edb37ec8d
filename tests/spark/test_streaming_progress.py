"""A transform_with_state query's ``lastProgress`` and ``recentProgress`` have the state
operator Spark's own transformWithState reports: rows written and removed, rows total
(where the backend counts them), late rows dropped, timers registered, deleted and
fired, per batch, equal to Spark's figures and to a plain-Python count."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import Row, SparkSession
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from statebackend.spark.streaming import transform_with_state
from statebackend.spark.streaming_progress import NOT_COUNTED, OPERATOR_NAME
from tests.spark import streaming_parity
from tests.spark.streaming_parity import parity_settings, write_batches

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(streaming_parity)

INPUT = StructType([StructField("user", StringType()), StructField("ts", TimestampType())])
OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("what", StringType()),
        StructField("count", LongType()),
    ]
)
DELAY_S = 5
TIMER_AFTER_MS = 10_000
"""A key's timer is due this long after its newest event: beyond the watermark (the
delay is shorter), so no timer fires in the batch that registers it."""
LIMIT = 3
"""A key whose count reaches this is cleared, and its timer deleted."""

# (user, second) per batch; a row at or below the previous batch's watermark is late
# (``expected_counts``).
BATCHES = [
    [("a", 10), ("b", 11), ("c", 12)],
    [("a", 20), ("a", 21), ("b", 22), ("d", 23)],  # a reaches 3: cleared, timer deleted
    [("a", 9), ("b", 30), ("e", 31), ("c", 40)],  # b reaches 3
    [("b", 50), ("f", 51), ("f", 52), ("c", 1)],  # c@1 late; timers of a, d fire
]


class CountUntilLimit(StatefulProcessor):
    """Per user a count: updated once per batch, or cleared (timer deleted) when it
    reaches ``LIMIT``; an event-time timer ``TIMER_AFTER_MS`` after the newest event
    clears it too. Each key's state is written at most once a batch, so Spark's counts
    of calls equal our counts of entries written."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", "count long, timer long")

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        times = [int(row.ts.timestamp() * 1000) for row in rows]
        count, timer = self.count.get() if self.count.exists() else (0, None)
        count += len(times)
        if timer is not None:
            self.handle.deleteTimer(timer)
        if count >= LIMIT:
            self.count.clear()
            yield Row(user=key[0], what="cleared", count=count)
            return
        timer = max(times) + TIMER_AFTER_MS
        self.handle.registerTimer(timer)
        self.count.update((count, timer))
        yield Row(user=key[0], what="counted", count=count)

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Row]:
        count = self.count.get()[0]
        self.count.clear()
        yield Row(user=key[0], what="expired", count=count)


def _watermarks() -> list[int]:
    """Spark's watermark for each batch N (ms): the newest event time of batches < N
    minus the delay; 0 before any."""
    watermarks = [0]
    newest = 0
    for batch in BATCHES:
        newest = max([newest, *(second * 1000 for _, second in batch)])
        watermarks.append(max(watermarks[-1], newest - DELAY_S * 1000))
    return watermarks


def expected_counts() -> list[dict[str, int]]:
    """Plain Python, per batch (``_watermarks``): rows at or below batch N-1's watermark
    are dropped, and timers at or below batch N's fire after the input."""
    watermarks = _watermarks()
    state: dict[str, tuple[int, int]] = {}
    counts = []
    for number, batch in enumerate(BATCHES):
        late_below = watermarks[number - 1] if number else 0
        on_time = [(u, s * 1000) for u, s in batch if s * 1000 > late_below]
        written = removed = registered = deleted = expired = 0
        for user in sorted({u for u, _ in on_time}):
            times = [t for u, t in on_time if u == user]
            count, timer = state.get(user, (0, None))
            count += len(times)
            if timer is not None:
                deleted += 1
            if count >= LIMIT:
                state.pop(user, None)
                removed += 1
                continue
            state[user] = (count, max(times) + TIMER_AFTER_MS)
            registered += 1
            written += 1
        for user, (_, timer) in sorted(state.items()):
            if timer <= watermarks[number]:
                del state[user]
                removed += 1
                deleted += 1  # Spark counts a fired timer as deleted too
                expired += 1
        counts.append(
            {
                "written": written,
                "removed": removed,
                "total": len(state),
                "late": len(batch) - len(on_time),
                "registered": registered,
                "deleted": deleted,
                "expired": expired,
            }
        )
    return counts


def _figures(query: StreamingQuery) -> list[dict[str, int]]:
    """Per batch, in batch order, what the query's progress says of its state operator."""
    figures = []
    for progress in sorted(query.recentProgress, key=lambda p: p.batchId):
        (operator,) = progress.stateOperators
        assert operator.operatorName == OPERATOR_NAME
        timers = operator.customMetrics
        figures.append(
            {
                "written": operator.numRowsUpdated,
                "removed": operator.numRowsRemoved,
                "total": operator.numRowsTotal,
                "late": operator.numRowsDroppedByWatermark,
                "registered": timers["numRegisteredTimers"],
                "deleted": timers["numDeletedTimers"],
                "expired": timers["numExpiredTimers"],
            }
        )
    return figures


def _source(spark: SparkSession, input_dir: Path) -> Any:
    df = spark.readStream.schema(INPUT).option("maxFilesPerTrigger", 1).json(str(input_dir))
    return df.withWatermark("ts", f"{DELAY_S} seconds")


def _consume(df: Any, batch_id: int) -> None:
    df.write.format("noop").mode("overwrite").save()  # Spark checks that all ran


def _rows() -> list[list[dict[str, Any]]]:
    return [
        [{"user": user, "ts": f"2026-01-01T00:00:{second:02d}Z"} for user, second in batch]
        for batch in BATCHES
    ]


def _run_both(
    spark: SparkSession, input_dir: Path, processor: type[StatefulProcessor], tmp_path: Path
) -> tuple[StreamingQuery, StreamingQuery]:
    """``processor`` over ``input_dir`` in EventTime mode through Spark's
    ``transformWithState`` and through ours (parallelism 2), each to its end; both queries."""
    outputs = {
        "spark": _source(spark, input_dir)
        .groupBy("user")
        .transformWithState(processor(), OUTPUT, "Update", "EventTime"),
        "ours": transform_with_state(
            _source(spark, input_dir),
            key_by="user",
            processor=processor(),
            output_schema=OUTPUT,
            job_id="progress",
            time_mode="EventTime",
            parallelism=2,
        ),
    }
    queries = []
    for name, output in outputs.items():
        query = (
            output.writeStream.foreachBatch(_consume)
            .option("checkpointLocation", str(tmp_path / f"{name}-checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        queries.append(query)
    theirs, ours = queries
    return theirs, ours


@pytest.mark.parametrize("backend", ["rocksdb", "heap"])
def test_progress_has_the_state_operator_spark_reports(
    spark_local: SparkSession, tmp_path: Path, backend: str
) -> None:
    input_dir = tmp_path / "input"
    write_batches(input_dir, _rows())
    with parity_settings(spark_local, tmp_path, backend=backend):
        theirs, ours = _run_both(spark_local, input_dir, CountUntilLimit, tmp_path)

    expected = expected_counts()
    # Spark's Python operator leaves numExpiredTimers at 0 (its JVM one counts them).
    assert [{**b, "expired": 0} for b in _figures(theirs)] == [
        {**b, "expired": 0} for b in expected
    ]
    if backend == "rocksdb":  # RocksDB cannot count its entries without reading them
        expected = [{**batch, "total": NOT_COUNTED} for batch in expected]
    assert _figures(ours) == expected
    last = ours.lastProgress
    assert last is not None and last.batchId == len(BATCHES) - 1
    assert last.stateOperators[0].numShufflePartitions == 2
    assert (last.stateOperators[0].memoryUsedBytes > 0) == (backend == "rocksdb")


FAR_MS = 4_000_000_000_000
"""A timer time no watermark of the test reaches."""
NEVER_MS = 1
"""A timer time no key ever registers."""


class TimerCalls(StatefulProcessor):
    """Per key and batch: registers its timer at ``FAR_MS`` again (there from the key's
    first batch on), registers a timer and deletes it, and deletes a timer it never
    registered; no timer fires. Spark counts each call."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        newest = max(int(row.ts.timestamp() * 1000) for row in rows)
        self.handle.registerTimer(FAR_MS)
        self.handle.registerTimer(newest + TIMER_AFTER_MS)
        self.handle.deleteTimer(newest + TIMER_AFTER_MS)
        self.handle.deleteTimer(NEVER_MS)
        yield Row(user=key[0], what="timers", count=0)


def test_timer_counts_are_calls_as_spark_counts_them(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """``numRegisteredTimers`` and ``numDeletedTimers`` count every ``registerTimer`` and
    ``deleteTimer`` call, as Spark's do: a timer registered again, one registered and
    deleted in the same batch, one deleted that was never there."""
    input_dir = tmp_path / "input"
    write_batches(input_dir, _rows())
    watermarks = _watermarks()  # rows at or below batch N-1's are late
    want = []
    for number, batch in enumerate(BATCHES):
        late_below = watermarks[number - 1] if number else 0
        users = {user for user, second in batch if second * 1000 > late_below}
        want.append({"registered": 2 * len(users), "deleted": 2 * len(users)})
    with parity_settings(spark_local, tmp_path):
        theirs, ours = _run_both(spark_local, input_dir, TimerCalls, tmp_path)

    def timers(query: StreamingQuery) -> list[dict[str, int]]:
        return [
            {"registered": batch["registered"], "deleted": batch["deleted"]}
            for batch in _figures(query)
        ]

    assert timers(theirs) == want
    assert timers(ours) == want
