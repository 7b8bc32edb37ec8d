"""Parity with Spark: value, list and map state processors (Row and pandas mode) give
the same output per micro-batch through Spark's transformWithState and through ours,
and both equal a plain-Python computation."""

from __future__ import annotations

import json
import math
import struct
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, date, datetime
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
import pytest
from pyspark import cloudpickle
from pyspark.errors import StreamingQueryException
from pyspark.sql import Row, SparkSession
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from pyspark.sql.types import (
    ArrayType,
    ByteType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from statebackend.errors import StatefulProcessorError
from tests.spark import streaming_parity
from tests.spark.streaming_parity import (
    ParityCase,
    parity_settings,
    run_ours,
    run_parity,
    run_spark,
    write_batches,
)

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
            current = self.items.getValue((r["item"],))  # a Row, read by field name
            self.items.updateValue((r["item"],), ((current.n if current else 0) + 1,))
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


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_the_backend_setting_chooses_where_the_state_lives(
    spark_local: SparkSession, tmp_path: Path, backend: str
) -> None:
    """``spark.statebackend.backend=heap`` keeps a query's state in the Python workers:
    no RocksDB is opened under ``local.dir`` (with ``rocksdb``, every subtask opens one)."""
    case = ParityCase(INPUT, ["user"], AllStates, OUTPUT)
    input_dir = tmp_path / "input"
    write_batches(input_dir, BATCHES)
    with parity_settings(spark_local, tmp_path, backend=backend):
        ours = run_ours(spark_local, case, input_dir, tmp_path / "checkpoint", job_id="where")
    assert ours == _expected(BATCHES)
    databases = {path.parent for path in (tmp_path / "local").rglob("CURRENT")}
    assert len(databases) == (2 if backend == "rocksdb" else 0)


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


SESSION_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("kind", StringType()),
        *[StructField(name, LongType()) for name in ("a", "b", "c", "d", "e")],
        StructField("tags", ArrayType(StringType())),
        StructField("span", StructType([StructField(n, LongType()) for n in ("first", "last")])),
        StructField("counts", MapType(StringType(), LongType())),
    ]
)
INITIAL_SCHEMA = StructType(
    [
        StructField("user", StringType()),
        StructField("start", LongType()),
        StructField("tag", StringType()),
    ]
)
HOUR_MS = 3_600_000


class Sessions(StatefulProcessor):
    """ProcessingTime: TTL'd value, list and map state (1 ms: gone by the next batch; one
    hour: kept), a composite value (array, struct, map) echoed in the output, timers at
    now (fire after this batch's input), now + 1 (fire in the next batch) and now + 1 h
    (never), initial state. Output columns a..e (see ``_expected_sessions``)."""

    use_pandas = False

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.recent = handle.getValueState("recent", "amount long", 1)
        self.kept = handle.getListState("kept", "amount long", HOUR_MS)
        self.short = handle.getListState("short", "amount long", 1)
        self.seen = handle.getMapState("seen", "item string", "n long", 1)
        self.profile = handle.getValueState(
            "profile",
            "tags array<string>, span struct<first: long, last: long>, counts map<string, long>",
        )

    def _profile(self) -> tuple[list[str], tuple[int, int], dict[str, int]]:
        current = self.profile.get()
        if current is None:
            return [], (0, 0), {}
        tags, span, counts = current
        return list(tags), (int(span[0]), int(span[1])), dict(counts)

    def _extend(self, tag: str, amount: int) -> None:
        tags, span, counts = self._profile()
        first = span[0] if tags else amount
        counts[tag] = counts.get(tag, 0) + amount
        self.profile.update((tags + [tag], Row(first=first, last=amount), counts))

    def _row(self, key: Any, kind: str, values: tuple[int, ...]) -> Any:
        tags, (first, last), counts = self._profile()
        row = {"user": key[0], "kind": kind, **dict(zip("abcde", values, strict=True))}
        row.update(tags=tags, span={"first": first, "last": last}, counts=counts)
        if self.use_pandas:
            return pd.DataFrame({name: [value] for name, value in row.items()})
        return Row(**{**row, "span": Row(**row["span"])})

    def _timers(self) -> int:
        return len(list(self.handle.listTimers()))

    def handleInitialState(self, key: Any, initialState: Any, timerValues: TimerValues) -> None:
        rows = initialState.to_dict("records") if self.use_pandas else [initialState.asDict()]
        for row in rows:
            self.kept.appendValue((int(row["start"]),))
            self._extend(row["tag"], int(row["start"]))
            self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + 1)

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        records = (
            [r for df in rows for r in df.to_dict("records")]
            if self.use_pandas
            else [row.asDict() for row in rows]
        )
        had_recent = int(self.recent.exists())
        short_before = len(list(self.short.get()))
        seen_before = len(list(self.seen.keys()))
        for record in records:
            amount = int(record["amount"])
            self.recent.update((amount,))
            self.kept.appendValue((amount,))
            self.short.appendValue((amount,))
            self.seen.updateValue((record["item"],), (amount,))
            self._extend(record["item"], amount)
        now = timerValues.getCurrentProcessingTimeInMs()
        for expiry in (now, now + 1, now + HOUR_MS):
            self.handle.registerTimer(expiry)
        kept = len(list(self.kept.get()))
        yield self._row(key, "in", (had_recent, short_before, seen_before, kept, self._timers()))

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Any]:
        due_now = expiredTimerInfo.getExpiryTimeInMs() == timerValues.getCurrentProcessingTimeInMs()
        values = (
            int(due_now),
            int(self.recent.exists()),
            len(list(self.seen.keys())),
            len(list(self.kept.get())),
            self._timers(),
        )
        yield self._row(key, "timer", values)

    def close(self) -> None:
        pass


class PandasSessions(Sessions):
    """The same in pandas mode."""

    use_pandas = True


SESSION_INITIAL = [
    {"user": "a", "start": 100, "tag": "init"},
    {"user": "d", "start": 7, "tag": "init"},
]
SESSION_BATCHES = [
    [
        {"user": "a", "item": "x", "amount": 1},
        {"user": "b", "item": "y", "amount": 2},
        {"user": "a", "item": "y", "amount": 3},
    ],
    [{"user": "a", "item": "y", "amount": 4}],
    [{"user": "b", "item": "z", "amount": 5}, {"user": "c", "item": "x", "amount": 6}],
]


def _expected_sessions(
    batches: list[list[dict[str, Any]]], initial: list[dict[str, Any]]
) -> Counter[tuple[int, tuple[Any, ...]]]:
    """Plain Python over abstract batch times 1000 * (n + 1): a 1 ms TTL has expired by
    the next batch, a timer at now + 1 fires in the next batch, one at now + 1 h never;
    a firing timer is listed by listTimers until its handler returns (as Spark does)."""
    timers: dict[str, set[int]] = {}
    kept: dict[str, int] = {}
    written: dict[str, int] = {}  # batch of the TTL'd writes (value, list, map)
    seen: dict[str, set[str]] = {}
    short: dict[str, int] = {}
    profile: dict[str, tuple[list[str], tuple[int, int], dict[str, int]]] = {}
    out: Counter[tuple[int, tuple[Any, ...]]] = Counter()

    def extend(user: str, tag: str, amount: int) -> None:
        tags, span, counts = profile.get(user, ([], (0, 0), {}))
        counts = {**counts, tag: counts.get(tag, 0) + amount}
        profile[user] = (tags + [tag], (span[0] if tags else amount, amount), counts)

    def row(user: str, kind: str, values: tuple[int, ...]) -> tuple[Any, ...]:
        tags, span, counts = profile.get(user, ([], (0, 0), {}))
        return (user, kind, *values, tuple(tags), span, tuple(sorted(counts.items())))

    for batch_id, batch in enumerate(batches):
        now = 1000 * (batch_id + 1)
        for record in initial if batch_id == 0 else []:
            user = record["user"]
            kept[user] = kept.get(user, 0) + 1
            extend(user, record["tag"], record["start"])
            timers.setdefault(user, set()).add(now + 1)
        for user in sorted({r["user"] for r in batch}):
            records = [r for r in batch if r["user"] == user]
            fresh = written.get(user) == batch_id
            values = (
                int(fresh),
                short[user] if fresh else 0,
                len(seen[user]) if fresh else 0,
            )
            if not fresh:
                short[user], seen[user] = 0, set()
            written[user] = batch_id
            for r in records:
                kept[user] = kept.get(user, 0) + 1
                short[user] += 1
                seen[user].add(r["item"])
                extend(user, r["item"], r["amount"])
            timers.setdefault(user, set()).update({now, now + 1, now + HOUR_MS})
            out[(batch_id, row(user, "in", (*values, kept[user], len(timers[user]))))] += 1
        for user, user_timers in timers.items():
            for expiry in sorted(t for t in user_timers if t <= now):
                fresh = written.get(user) == batch_id
                values = (
                    int(expiry == now),
                    int(fresh),
                    len(seen[user]) if fresh else 0,
                    kept[user],
                    len(user_timers),
                )
                out[(batch_id, row(user, "timer", values))] += 1
                user_timers.discard(expiry)
    return out


@pytest.mark.parametrize("processor", [Sessions, PandasSessions], ids=["row", "pandas"])
def test_processing_time_timers_ttl_initial_state_composite_types_like_spark(
    spark_local: SparkSession, tmp_path: Path, processor: type[Sessions]
) -> None:
    case = ParityCase(
        INPUT,
        ["user"],
        processor,
        SESSION_OUTPUT,
        use_pandas=processor.use_pandas,
        time_mode="ProcessingTime",
        initial_state=SESSION_INITIAL,
        initial_schema=INITIAL_SCHEMA,
    )
    theirs, ours = run_parity(spark_local, case, SESSION_BATCHES, tmp_path)
    expected = _expected_sessions(SESSION_BATCHES, SESSION_INITIAL)
    assert theirs == expected
    assert ours == expected


def test_initial_state_grouped_by_other_columns_pairs_them_with_the_keys_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """``initialState=init.groupBy("uid")`` for a query keyed by ``user``: Spark pairs
    the initial state's grouping columns with the keys by position, so its rows seed the
    users they name; the processor sees the initial state's own columns."""
    renamed = StructType([StructField("uid", StringType()), *INITIAL_SCHEMA.fields[1:]])
    case = ParityCase(
        INPUT,
        ["user"],
        Sessions,
        SESSION_OUTPUT,
        time_mode="ProcessingTime",
        initial_state=[
            {"uid": row["user"], "start": row["start"], "tag": row["tag"]}
            for row in SESSION_INITIAL
        ],
        initial_schema=renamed,
        initial_key_by=["uid"],
    )
    theirs, ours = run_parity(spark_local, case, SESSION_BATCHES, tmp_path)
    expected = _expected_sessions(SESSION_BATCHES, SESSION_INITIAL)
    assert theirs == expected
    assert ours == expected


EVENT_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("kind", StringType()),
        StructField("at_ms", LongType()),
        StructField("watermark_ms", LongType()),
        StructField("timers", LongType()),
    ]
)
TIMER_DELAY_MS = 5_000


def _ms(second: int) -> int:
    return (1_767_225_600 + second) * 1000  # 2026-01-01T00:00:00Z + second


class EventTimers(StatefulProcessor):
    """EventTime: a timer at (event time + 5 s) per row; rows and fired timers are
    echoed with the watermark the processor sees and how many timers the key has."""

    use_pandas = False

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.latest = handle.getValueState("latest", "at_ms long")

    def _row(self, key: Any, kind: str, at_ms: int, timer_values: TimerValues) -> Any:
        row = {
            "user": key[0],
            "kind": kind,
            "at_ms": at_ms,
            "watermark_ms": timer_values.getCurrentWatermarkInMs(),
            "timers": len(list(self.handle.listTimers())),
        }
        if self.use_pandas:
            return pd.DataFrame({name: [value] for name, value in row.items()})
        return Row(**row)

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        times = (
            [int(t.timestamp() * 1000) for df in rows for t in df["ts"]]
            if self.use_pandas
            else [int(row.ts.timestamp() * 1000) for row in rows]
        )
        for at_ms in times:
            self.handle.registerTimer(at_ms + TIMER_DELAY_MS)
        latest = max([*times, *(self.latest.get() or ())])
        self.latest.update((latest,))
        yield self._row(key, "in", latest, timerValues)

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Any]:
        yield self._row(key, "timer", expiredTimerInfo.getExpiryTimeInMs(), timerValues)

    def close(self) -> None:
        pass


class PandasEventTimers(EventTimers):
    """The same in pandas mode."""

    use_pandas = True


REARM_MS = 1_000


class RearmingEventTimers(EventTimers):
    """``EventTimers`` whose first fired timer of each key registers another one
    ``REARM_MS`` earlier, already due, and deletes the key's timer ``REARM_MS`` later.
    Spark fires the new one in a later batch, not in this one, and the deleted one, if it
    was due, all the same (unlisted)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        super().init(handle)
        self.rearmed = handle.getValueState("rearmed", "done boolean")

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Any]:
        if not self.rearmed.exists():
            self.rearmed.update((True,))
            self.handle.registerTimer(expiredTimerInfo.getExpiryTimeInMs() - REARM_MS)
            self.handle.deleteTimer(expiredTimerInfo.getExpiryTimeInMs() + REARM_MS)
        return super().handleExpiredTimer(key, timerValues, expiredTimerInfo)


EVENT_DELAY_MS = 5_000
EVENT_BATCHES = [
    [{"user": "a", "second": 10}, {"user": "b", "second": 20}],
    [{"user": "a", "second": 12}, {"user": "c", "second": 30}],
    [{"user": "a", "second": 14}, {"user": "b", "second": 40}],  # a@14 is late
    [{"user": "d", "second": 50}],
]


def _event_rows(batches: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    return [
        [{"user": r["user"], "item": "x", "amount": 1, "ts": _at_ms(_ms(r["second"]))} for r in b]
        for b in batches
    ]


def _at_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat()


def expected_event_timers(
    batches: list[list[dict[str, Any]]], batch_count: int, rearm: bool = False
) -> Counter[tuple[int, tuple[Any, ...]]]:
    """Plain Python, as Spark defines it: batch N's watermark is the largest event time
    of batches < N minus the delay (0 before any); rows at or below batch N-1's
    watermark are dropped; the timers at or below batch N's when its timer phase begins
    fire after its input. Batches from ``len(batches)`` to ``batch_count - 1`` have no
    input. ``rearm``: ``RearmingEventTimers``."""
    rearmed: set[str] = set()
    timers: dict[str, set[int]] = {}
    latest: dict[str, int] = {}
    out: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    watermarks = [0]
    seen = 0
    for batch in batches:
        seen = max([seen, *(_ms(r["second"]) for r in batch)])
        watermarks.append(max(watermarks[-1], seen - EVENT_DELAY_MS))
    watermarks += [watermarks[-1]] * batch_count
    for batch_id in range(batch_count):
        watermark = watermarks[batch_id]
        late = watermarks[batch_id - 1] if batch_id else 0
        batch = batches[batch_id] if batch_id < len(batches) else []
        for user in sorted({r["user"] for r in batch}):
            times = [_ms(r["second"]) for r in batch if r["user"] == user]
            times = [t for t in times if t > late]
            if not times:
                continue
            timers.setdefault(user, set()).update(t + TIMER_DELAY_MS for t in times)
            latest[user] = max([*times, latest.get(user, 0)])
            row = (user, "in", latest[user], watermark, len(timers[user]))
            out[(batch_id, row)] += 1
        for user, user_timers in timers.items():
            for expiry in sorted(t for t in user_timers if t <= watermark):
                if rearm and user not in rearmed:
                    rearmed.add(user)
                    user_timers.add(expiry - REARM_MS)
                    user_timers.discard(expiry + REARM_MS)  # fires all the same if due
                out[(batch_id, (user, "timer", expiry, watermark, len(user_timers)))] += 1
                user_timers.discard(expiry)
    return out


@pytest.mark.parametrize("processor", [EventTimers, PandasEventTimers], ids=["row", "pandas"])
def test_event_time_timers_like_spark(
    spark_local: SparkSession, tmp_path: Path, processor: type[EventTimers]
) -> None:
    case = ParityCase(
        TIMED_INPUT,
        ["user"],
        processor,
        EVENT_OUTPUT,
        use_pandas=processor.use_pandas,
        time_mode="EventTime",
        watermark=("ts", f"{EVENT_DELAY_MS // 1000} seconds"),
    )
    batches = _event_rows(EVENT_BATCHES)
    theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    expected = expected_event_timers(EVENT_BATCHES, len(EVENT_BATCHES))
    assert theirs == expected
    assert ours == expected


def test_a_batch_run_again_after_our_commit_still_moves_the_watermark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """A driver dies after our manifest 1 and before Spark's ``commits/1`` (the commit
    removed): the restarted query runs batch 1 again, which we publish as committed;
    Spark must still see its event times, or batch 2's watermark stays at batch 1's and
    timers fire late. Every batch's rows equal plain Python; batch 1's are published
    again unchanged."""
    case = ParityCase(
        TIMED_INPUT,
        ["user"],
        EventTimers,
        EVENT_OUTPUT,
        time_mode="EventTime",
        watermark=("ts", f"{EVENT_DELAY_MS // 1000} seconds"),
    )
    batches = _event_rows(EVENT_BATCHES)
    input_dir, checkpoint = tmp_path / "input", tmp_path / "our-checkpoint"
    with parity_settings(spark_local, tmp_path):
        write_batches(input_dir, batches[:2])
        first = run_ours(spark_local, case, input_dir, checkpoint, job_id="rerun")
        for name in ("1", ".1.crc"):
            (checkpoint / "commits" / name).unlink()
        write_batches(input_dir, batches[2:], first=2)
        second = run_ours(spark_local, case, input_dir, checkpoint, job_id="rerun")
    expected = expected_event_timers(EVENT_BATCHES, len(EVENT_BATCHES))
    assert first == Counter({k: n for k, n in expected.items() if k[0] < 2})
    assert second == Counter({k: n for k, n in expected.items() if k[0] >= 1})


def test_a_timer_registered_while_timers_fire_waits_for_the_next_batch_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    case = ParityCase(
        TIMED_INPUT,
        ["user"],
        RearmingEventTimers,
        EVENT_OUTPUT,
        time_mode="EventTime",
        watermark=("ts", f"{EVENT_DELAY_MS // 1000} seconds"),
    )
    # a's timers at 15 and 16 s fall due together in batch 2, at the watermark 25 s.
    rearm_batches = [
        [{"user": "a", "second": 10}, {"user": "a", "second": 11}],
        [{"user": "b", "second": 30}],
        [{"user": "b", "second": 31}],
        [{"user": "c", "second": 40}],
    ]
    batches = _event_rows(rearm_batches)
    theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    expected = expected_event_timers(rearm_batches, len(rearm_batches), rearm=True)
    assert theirs == expected
    assert ours == expected


def _watermarks(batches: list[list[dict[str, Any]]]) -> list[int]:
    """Plain Python, as Spark defines it: batch N's watermark is the largest event time of
    batches < N minus ``EVENT_DELAY_MS``, 0 before any (one more than ``batches``)."""
    watermarks, seen = [0], 0
    for batch in batches:
        seen = max([seen, *(_ms(r["second"]) for r in batch)])
        watermarks.append(max(watermarks[-1], seen - EVENT_DELAY_MS))
    return watermarks


WATERMARK_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("kind", StringType()),
        StructField("rows", LongType()),
        StructField("watermark_ms", LongType()),
    ]
)


class ProcessingTimeWatermark(StatefulProcessor):
    """ProcessingTime over an input with a watermark: each handler echoes the watermark
    it sees (and handleInputRows how many rows it got), a timer at the batch's time."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs())
        watermark = timerValues.getCurrentWatermarkInMs()
        yield Row(user=key[0], kind="in", rows=len(list(rows)), watermark_ms=watermark)

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Any]:
        watermark = timerValues.getCurrentWatermarkInMs()
        yield Row(user=key[0], kind="timer", rows=0, watermark_ms=watermark)

    def close(self) -> None:
        pass


def test_processing_time_handlers_see_the_watermark_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """In ProcessingTime mode Spark's TimerValues carry the query's watermark (0 before
    it moves, and without one); ours gave -1."""
    case = ParityCase(
        TIMED_INPUT,
        ["user"],
        ProcessingTimeWatermark,
        WATERMARK_OUTPUT,
        time_mode="ProcessingTime",
        watermark=("ts", f"{EVENT_DELAY_MS // 1000} seconds"),
    )
    theirs, ours = run_parity(spark_local, case, _event_rows(EVENT_BATCHES), tmp_path)
    watermarks = _watermarks(EVENT_BATCHES)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(EVENT_BATCHES):
        for user in {r["user"] for r in batch}:  # late rows too: only EventTime drops them
            rows = sum(r["user"] == user for r in batch)
            expected[(batch_id, (user, "in", rows, watermarks[batch_id]))] += 1
            expected[(batch_id, (user, "timer", 0, watermarks[batch_id]))] += 1
    assert theirs == expected
    assert ours == expected


LISTED_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("kind", StringType()),
        StructField("at_ms", LongType()),
        StructField("timers", ArrayType(LongType())),
    ]
)
LISTED_OFFSETS_MS = (1_000, 5_000, 6_000, 7_000)


class ListedTimers(StatefulProcessor):
    """EventTime: timers at each row's event time + ``LISTED_OFFSETS_MS``; each handler
    echoes ``listTimers()`` as it gives them (their order included)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        for row in rows:
            for offset in LISTED_OFFSETS_MS:
                self.handle.registerTimer(int(row.ts.timestamp() * 1000) + offset)
        yield Row(user=key[0], kind="in", at_ms=-1, timers=list(self.handle.listTimers()))

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Any]:
        at_ms = expiredTimerInfo.getExpiryTimeInMs()
        yield Row(user=key[0], kind="timer", at_ms=at_ms, timers=list(self.handle.listTimers()))

    def close(self) -> None:
        pass


def test_list_timers_gives_spark_s_order(spark_local: SparkSession, tmp_path: Path) -> None:
    """Spark lists a key's timers in the byte order of its RocksDB store, where a
    timestamp is an UnsafeRow long, little-endian: not by time. Ours listed them
    ascending."""
    case = ParityCase(
        TIMED_INPUT,
        ["user"],
        ListedTimers,
        LISTED_OUTPUT,
        time_mode="EventTime",
        watermark=("ts", f"{EVENT_DELAY_MS // 1000} seconds"),
    )
    listed_batches = [
        [{"user": "a", "second": 10}, {"user": "b", "second": 20}],
        [{"user": "c", "second": 30}],
        [{"user": "d", "second": 40}],
        [{"user": "e", "second": 50}],
    ]
    theirs, ours = run_parity(spark_local, case, _event_rows(listed_batches), tmp_path)

    def in_spark_s_order(timers: set[int]) -> tuple[int, ...]:
        return tuple(sorted(timers, key=lambda t: t.to_bytes(8, "little", signed=True)))

    watermarks = _watermarks(listed_batches)
    timers: dict[str, set[int]] = {}
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(listed_batches):
        for r in batch:
            user = r["user"]
            timers.setdefault(user, set()).update(_ms(r["second"]) + o for o in LISTED_OFFSETS_MS)
            expected[(batch_id, (user, "in", -1, in_spark_s_order(timers[user])))] += 1
        for user, user_timers in timers.items():
            for expiry in sorted(t for t in user_timers if t <= watermarks[batch_id]):
                listed = in_spark_s_order(user_timers)  # the firing one included
                expected[(batch_id, (user, "timer", expiry, listed))] += 1
                user_timers.discard(expiry)
    assert any(list(timers) != sorted(timers) for (_, (*_, timers)) in expected)
    assert theirs == expected
    assert ours == expected


class EventTimeTtl(ListedTimers):
    """``ListedTimers`` with a TTL'd value state: Spark refuses TTL in EventTime mode."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        super().init(handle)
        self.latest = handle.getValueState("latest", "at_ms long", HOUR_MS)


def test_ttl_in_event_time_mode_is_refused_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """Spark allows TTL in ProcessingTime mode only; ours took it in EventTime too."""
    case = ParityCase(
        TIMED_INPUT,
        ["user"],
        EventTimeTtl,
        LISTED_OUTPUT,
        time_mode="EventTime",
        watermark=("ts", f"{EVENT_DELAY_MS // 1000} seconds"),
    )
    input_dir = tmp_path / "input"
    write_batches(input_dir, _event_rows([[{"user": "a", "second": 10}]]))
    refused = "INCORRECT_TIME_MODE_TO_ASSIGN_TTL.*state=latest in timeMode=EventTime"
    with parity_settings(spark_local, tmp_path):
        with pytest.raises(StreamingQueryException, match=refused):
            run_spark(spark_local, case, input_dir, tmp_path / "spark-checkpoint")
        with pytest.raises(StatefulProcessorError, match=refused):
            run_ours(spark_local, case, input_dir, tmp_path / "our-checkpoint", job_id="ttl")


ZERO_TTL_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("before", LongType()),
        StructField("after", LongType()),
    ]
)


class ZeroTtlCount(StatefulProcessor):
    """A count in a value state declared with ``ttlDurationMs=0``: Spark keeps it as a
    state without TTL, in any time mode."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "n long", 0)

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        current = self.count.get()
        before = current[0] if current else 0
        self.count.update((before + len(list(rows)),))
        yield Row(user=key[0], before=before, after=self.count.get()[0])

    def close(self) -> None:
        pass


@pytest.mark.parametrize("time_mode", ["None", "ProcessingTime"])
def test_a_ttl_of_zero_is_no_ttl_like_spark(
    spark_local: SparkSession, tmp_path: Path, time_mode: str
) -> None:
    """Spark's Python handle sends ``ttlDurationMs`` as a protobuf field whose default,
    0, reads as no TTL: the state keeps its values. Ours refused 0 (positive TTLs only,
    and none in time mode None)."""
    case = ParityCase(INPUT, ["user"], ZeroTtlCount, ZERO_TTL_OUTPUT, time_mode=time_mode)
    theirs, ours = run_parity(spark_local, case, BATCHES, tmp_path)
    counts: Counter[str] = Counter()
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(BATCHES):
        for user in {r["user"] for r in batch}:
            before = counts[user]
            counts[user] += sum(r["user"] == user for r in batch)
            expected[(batch_id, (user, before, counts[user]))] += 1
    assert theirs == expected
    assert ours == expected


# -- no-data batches: streaming.tick-interval -------------------------------------------

TICK_SECONDS = "0.5"


def test_ticks_fire_event_time_timers_like_sparks_no_data_batch(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """After the last input batch moved the watermark, Spark runs one no-data batch that
    fires the timers it passed; with ticks our query runs a batch on every trigger and
    fires the same timers in the same batch (here the batch ids agree: the input files
    come one per batch, then every batch is a tick)."""
    case = ParityCase(
        TIMED_INPUT,
        ["user"],
        EventTimers,
        EVENT_OUTPUT,
        time_mode="EventTime",
        watermark=("ts", f"{EVENT_DELAY_MS // 1000} seconds"),
    )
    input_dir = tmp_path / "input"
    write_batches(input_dir, _event_rows(EVENT_BATCHES))
    batch_count = len(EVENT_BATCHES) + 2
    with parity_settings(
        spark_local, tmp_path, no_data_batches=True, **{"streaming.tick-interval": TICK_SECONDS}
    ):
        theirs = run_spark(spark_local, case, input_dir, tmp_path / "spark-checkpoint")
        ours = run_ours(
            spark_local, case, input_dir, tmp_path / "ckpt", "ticks", until_batches=batch_count
        )
    expected = expected_event_timers(EVENT_BATCHES, batch_count)
    assert max(batch_id for batch_id, _ in expected) == len(EVENT_BATCHES)  # a no-data batch
    assert theirs == expected
    assert ours == expected


REMINDER_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("expiry_ms", LongType()),
        StructField("note_exists", LongType()),
    ]
)
REMINDER_DELAY_MS = 1500
NOTE_TTL_MS = 1000


class Reminder(StatefulProcessor):
    """ProcessingTime: per key, a note with a 1 s TTL and a timer 1.5 s after the input's
    batch; the fired timer reports whether the note is still there."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.note = handle.getValueState("note", "amount long", NOTE_TTL_MS)

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        for row in rows:
            self.note.update((row.amount,))
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + REMINDER_DELAY_MS)
        return iter(())

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Any]:
        yield Row(
            user=key[0],
            expiry_ms=expiredTimerInfo.getExpiryTimeInMs(),
            note_exists=int(self.note.exists()),
        )

    def close(self) -> None:
        pass


def _batch_timestamps(checkpoint: Path, count: int) -> list[int]:
    """Batch timestamps of batches 0 .. count - 1, from Spark's offsets log."""
    logs = [(checkpoint / "offsets" / str(n)).read_text().splitlines() for n in range(count)]
    return [int(json.loads(lines[1])["batchTimestampMs"]) for lines in logs]


def test_ticks_fire_processing_time_timers_and_ttl_without_input(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """Two input batches, then only ticks: each key's timer fires in the first batch
    whose timestamp reaches it; its note is there only if the key's newest input is
    younger than the note's TTL (by batch timestamps)."""
    case = ParityCase(INPUT, ["user"], Reminder, REMINDER_OUTPUT, time_mode="ProcessingTime")
    batches = [BATCHES[0], BATCHES[1]]
    input_dir, checkpoint = tmp_path / "input", tmp_path / "ckpt"
    write_batches(input_dir, batches)
    batch_count = 7  # ticks >= 0.5 s apart: batch 6 is >= 2.5 s after batch 1
    with parity_settings(spark_local, tmp_path, **{"streaming.tick-interval": TICK_SECONDS}):
        ours = run_ours(
            spark_local, case, input_dir, checkpoint, "ticks", until_batches=batch_count
        )
    times = _batch_timestamps(checkpoint, batch_count)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(batches):
        for user in {r["user"] for r in batch}:
            expiry = times[batch_id] + REMINDER_DELAY_MS
            fired = next(n for n, at in enumerate(times) if at >= expiry)
            inputs = batches[: fired + 1]
            noted = max(n for n, b in enumerate(inputs) if any(r["user"] == user for r in b))
            note_exists = times[noted] + NOTE_TTL_MS > times[fired]
            expected[(fired, (user, expiry, int(note_exists)))] += 1
    assert max(batch_id for batch_id, _ in expected) >= len(batches)  # without input
    assert ours == expected


SIGNED_INPUT = StructType(
    [
        StructField("x", DoubleType()),
        StructField("amount", LongType()),
        StructField("ts", TimestampType()),
    ]
)
SIGNED_OUTPUT = StructType(
    [
        StructField("x", DoubleType()),
        StructField("n", LongType()),
        StructField("sum", LongType()),
        StructField("latest", TimestampType()),
    ]
)


class NestedCounts(StatefulProcessor):
    """Per key a value state (n, struct<sum>) whose nested struct is read by field name,
    as Spark's handle allows; emits the newest event time as a timestamp column."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.state = handle.getValueState("state", "n long, totals struct<sum: long>")

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Row]:
        rows = list(rows)
        current = self.state.get()
        n = (current[0] if current else 0) + len(rows)
        total = (current[1].sum if current else 0) + sum(row.amount for row in rows)
        self.state.update((n, (total,)))
        yield Row(x=key[0], n=n, sum=total, latest=max(row.ts for row in rows))

    def close(self) -> None:
        pass


def expected_latest(rows: list[dict[str, Any]]) -> datetime:
    """The newest ``ts`` of ``rows`` as ``collect()`` shows a timestamp: naive, local."""
    latest = max(datetime.fromisoformat(row["ts"]) for row in rows)
    return datetime.fromtimestamp(latest.timestamp())


def test_signed_zero_keys_timestamps_and_nested_state_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """-0.0 and 0.0 are one key, a timestamp output column is written, and a nested
    struct in state reads back as a Row: as in Spark. Spark groups -0.0 with 0.0 within
    a batch but keeps the state of a later batch's -0.0 apart (its store keys the bytes
    of the key, not the normalized value): its batch 1 differs there, ours does not."""
    batches = [
        [
            {"x": 0.0, "amount": 1, "ts": _at(1)},
            {"x": -0.0, "amount": 2, "ts": _at(2)},
            {"x": 1.5, "amount": 4, "ts": _at(3)},
        ],
        [{"x": -0.0, "amount": 8, "ts": _at(5)}, {"x": 1.5, "amount": 16, "ts": _at(4)}],
    ]
    case = ParityCase(SIGNED_INPUT, ["X"], NestedCounts, SIGNED_OUTPUT)  # "X": as groupBy
    theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    seen: dict[float, tuple[int, int]] = {}
    for batch_id, batch in enumerate(batches):
        for key in sorted({abs(row["x"]) for row in batch}):  # abs: -0.0 is 0.0
            rows = [row for row in batch if abs(row["x"]) == key]
            n, total = seen.get(key, (0, 0))
            seen[key] = (n + len(rows), total + sum(row["amount"] for row in rows))
            expected[(batch_id, (key, *seen[key], expected_latest(rows)))] += 1
    assert ours == expected
    assert [math.copysign(1, x) for (_, (x, *_)) in ours] == [1.0] * len(ours)
    assert {k: n for k, n in theirs.items() if k[0] == 0} == {
        k: n for k, n in expected.items() if k[0] == 0
    }
    assert (1, (-0.0, 1, 8, expected_latest(batches[1]))) in theirs  # Spark's own split


POINT = StructType([StructField("x", DoubleType()), StructField("tag", StringType())])
POINT_INPUT = StructType([StructField("p", POINT), StructField("amount", LongType())])
POINT_OUTPUT = StructType(
    [
        StructField("x", DoubleType()),
        StructField("tag", StringType()),
        StructField("n", LongType()),
        StructField("total", LongType()),
    ]
)


class PointCounts(StatefulProcessor):
    """Per key (a struct column ``p``): the count and total of its rows so far, with the
    key's fields as it gets them."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.state = handle.getValueState("state", "n long, total long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Row]:
        rows = list(rows)
        n, total = self.state.get() or (0, 0)
        n, total = n + len(rows), total + sum(row.amount for row in rows)
        self.state.update((n, total))
        yield Row(x=key[0]["x"], tag=key[0]["tag"], n=n, total=total)

    def close(self) -> None:
        pass


def test_a_signed_zero_inside_a_struct_key_is_one_key_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """A struct key whose double field is -0.0 is the key with 0.0 there, and the
    processor gets 0.0: as Spark groups it in a batch. Ours made only top-level float
    keys one key, so {x: -0.0} was a key of its own. As for a top-level -0.0 key, Spark
    keeps the state of a later batch's -0.0 apart (its store keys the bytes of the
    batch's first row): its batch 1 differs there, ours does not."""
    batches = [
        [
            {"p": {"x": 0.0, "tag": "a"}, "amount": 1},
            {"p": {"x": -0.0, "tag": "a"}, "amount": 2},
            {"p": {"x": -0.0, "tag": "b"}, "amount": 4},
        ],
        [{"p": {"x": -0.0, "tag": "a"}, "amount": 8}, {"p": {"x": 0.0, "tag": "b"}, "amount": 16}],
    ]
    case = ParityCase(POINT_INPUT, ["p"], PointCounts, POINT_OUTPUT)
    theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    seen: dict[tuple[float, str], tuple[int, int]] = {}
    for batch_id, batch in enumerate(batches):
        keys = {(abs(row["p"]["x"]), row["p"]["tag"]) for row in batch}  # abs: -0.0 is 0.0
        for key in sorted(keys):
            amounts = [r["amount"] for r in batch if (abs(r["p"]["x"]), r["p"]["tag"]) == key]
            n, total = seen.get(key, (0, 0))
            seen[key] = (n + len(amounts), total + sum(amounts))
            expected[(batch_id, (*key, *seen[key]))] += 1
    assert ours == expected
    assert {math.copysign(1, x) for (_, (x, *_)) in ours} == {1.0}
    assert {k: n for k, n in theirs.items() if k[0] == 0} == {
        k: n for k, n in expected.items() if k[0] == 0
    }
    assert (1, (-0.0, "a", 1, 8)) in theirs  # Spark's own split, as of top-level keys


WALL_INPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("t", TimestampType()),
        StructField("ev", TimestampType()),
    ]
)
WALL_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("t", TimestampType()),
        StructField("key_type", StringType()),
        StructField("n", LongType()),
        StructField("since", LongType()),
        StructField("latest", TimestampType()),
    ]
)
WALL_ZONE = "America/New_York"
WALL_ZONE_WEST = "America/Los_Angeles"


class WallClock(StatefulProcessor):
    """pandas mode, per (user, t): the count of rows, and what a processor written for
    Spark computes from timestamps, which it gets as naive wall times of the session time
    zone: the key's timestamp and its type, the newest ``ev`` minus a naive timestamp,
    and the newest ``ev`` (a naive output timestamp: a wall time of that zone)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.count = handle.getValueState("count", "n long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs())
        frame = pd.concat(list(rows))
        current = self.count.get()
        n = (current[0] if current else 0) + len(frame)
        self.count.update((n,))
        latest = frame["ev"].max()
        since = int((latest - pd.Timestamp("2024-01-01")).total_seconds())
        yield pd.DataFrame(
            {
                "user": [key[0]],
                "t": [key[1]],
                "key_type": [type(key[1]).__name__],
                "n": [n],
                "since": [since],
                "latest": [latest],
            }
        )

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: Any
    ) -> Iterator[Any]:
        """Echo the key as Spark hands it here (unpickled from the JVM)."""
        kind = f"{type(key).__name__}/{type(key[1]).__name__}"
        yield pd.DataFrame(
            {"user": [key[0]], "t": [key[1]], "key_type": [kind], "n": [-1], "since": [0]}
        ).assign(latest=[key[1]])

    def close(self) -> None:
        pass


def collected_wall_time(wall: str, zone: str = WALL_ZONE) -> datetime:
    """A wall time of ``zone`` (a zone's name, or a fixed offset such as ``+08:00``) as
    ``collect()`` shows the instant: naive, local."""
    if zone[0] in "+-":
        instant = datetime.fromisoformat(wall + zone)
    else:
        instant = datetime.fromisoformat(wall).replace(tzinfo=ZoneInfo(zone))
    return datetime.fromtimestamp(instant.timestamp())


@pytest.mark.parametrize("zone", [WALL_ZONE, "+08:00"], ids=["zone", "offset"])
def test_pandas_mode_timestamps_are_wall_times_of_the_session_time_zone_like_spark(
    spark_local: SparkSession, tmp_path: Path, zone: str
) -> None:
    """In a session time zone other than UTC, a pandas processor gets timestamps (key and
    columns) as naive wall times of that zone, and its naive output timestamps are read
    as such: as Spark's transformWithStateInPandas does. Summer and winter times. A
    timer's key is a Row whose timestamp is a naive datetime of that wall time, as Spark
    unpickles it; it was a tuple holding the UTC wall time. A zone given as a fixed
    offset (``+08:00``, which Spark takes) too: there a timer's key failed in ours
    (ZoneInfo has no such zone)."""
    walls = ["2024-07-01T12:00:00", "2024-12-01T08:30:00", "2024-07-01T23:59:59"]
    batches = [
        [
            {"user": "a", "t": walls[0], "ev": walls[0]},
            {"user": "a", "t": walls[0], "ev": walls[2]},
            {"user": "b", "t": walls[1], "ev": walls[1]},
        ],
        [{"user": "a", "t": walls[0], "ev": walls[1]}],
    ]
    case = ParityCase(
        WALL_INPUT,
        ["user", "t"],
        WallClock,
        WALL_OUTPUT,
        use_pandas=True,
        time_mode="ProcessingTime",
    )
    spark_local.conf.set("spark.sql.session.timeZone", zone)
    try:
        theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    finally:
        spark_local.conf.unset("spark.sql.session.timeZone")
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    counts: Counter[tuple[str, str]] = Counter()
    for batch_id, batch in enumerate(batches):
        for key in sorted({(row["user"], row["t"]) for row in batch}):
            events = [row["ev"] for row in batch if (row["user"], row["t"]) == key]
            counts[key] += len(events)
            latest = max(events, key=datetime.fromisoformat)
            since = datetime.fromisoformat(latest) - datetime(2024, 1, 1)
            row = (key[0], collected_wall_time(key[1], zone), "Timestamp", counts[key])
            expected[
                (batch_id, (*row, int(since.total_seconds()), collected_wall_time(latest, zone)))
            ] += 1
            # The timer each batch registers at its own time fires at its end, with the
            # key as a Row whose timestamp is a naive datetime of the session's wall time.
            wall = collected_wall_time(key[1], zone)
            expected[(batch_id, (key[0], wall, "Row/datetime", -1, 0, wall))] += 1
    assert ours == expected
    assert theirs == expected


OLD_INPUT = StructType([StructField("user", StringType()), StructField("t", TimestampType())])
OLD_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("key_wall", StringType()),
        StructField("walls", StringType()),
        StructField("latest", TimestampType()),
    ]
)


class OldWallTimes(StatefulProcessor):
    """pandas mode, per (user, t): the wall times it sees of the key's timestamp and of
    its ``t`` column as text, and the newest ``t`` back as an output timestamp."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        frame = pd.concat(list(rows))
        walls = ",".join(sorted(str(stamp) for stamp in frame["t"]))
        yield pd.DataFrame({"user": [key[0]], "key_wall": [str(key[1])], "walls": [walls]}).assign(
            latest=[frame["t"].max()]
        )

    def close(self) -> None:
        pass


def test_pandas_mode_wall_times_before_1901_are_those_of_the_time_zone_database_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """Before December 1901 a pandas processor sees the session time zone's wall times
    of the time zone database, as Spark hands them: 1899 in Los Angeles is PST (04:00 for
    12:00 UTC), 1850 its local mean time (-7:52:58). Ours took the offsets of pytz, which
    knows no change before 1901 and rounds local mean time to minutes (04:07:00 for
    both). Its naive output timestamps are read back with the same offsets; Spark reads
    them with pytz's (its ``latest`` column is minutes off there, so it is not compared)."""
    instants = ["1899-12-31T12:00:00Z", "1850-01-01T12:00:00Z", "2024-07-01T12:00:00Z"]
    batches = [
        [{"user": "a", "t": instants[0]}, {"user": "b", "t": instants[1]}],
        [{"user": "a", "t": instants[0]}, {"user": "c", "t": instants[2]}],
    ]
    case = ParityCase(OLD_INPUT, ["user", "t"], OldWallTimes, OLD_OUTPUT, use_pandas=True)
    spark_local.conf.set("spark.sql.session.timeZone", WALL_ZONE_WEST)
    try:
        theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    finally:
        spark_local.conf.unset("spark.sql.session.timeZone")
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(batches):
        for row in batch:
            instant = datetime.fromisoformat(row["t"])
            wall = str(instant.astimezone(ZoneInfo(WALL_ZONE_WEST)).replace(tzinfo=None))
            collected = datetime.fromtimestamp(instant.timestamp())  # naive, local
            expected[(batch_id, (row["user"], wall, wall, collected))] += 1
    assert ours == expected
    assert Counter({(b, row[:3]): n for (b, row), n in theirs.items()}) == Counter(
        {(b, row[:3]): n for (b, row), n in expected.items()}
    )


NARROW_COLUMNS = {
    "b": ByteType(),
    "s": ShortType(),
    "i": IntegerType(),
    "f": FloatType(),
    "l": LongType(),
    "d": DoubleType(),
    "ntz": TimestampNTZType(),
}
NARROW_INPUT = StructType(
    [StructField("user", StringType())]
    + [StructField(name, kind) for name, kind in NARROW_COLUMNS.items()]
)
NARROW_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("dtypes", StringType()),
        StructField("doubled", ArrayType(LongType())),
    ]
)


class NarrowDtypes(StatefulProcessor):
    """pandas mode: the dtypes of the DataFrame it gets, and its byte column doubled
    as pandas computes it in that dtype."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        frame = pd.concat(list(rows))
        dtypes = ",".join(f"{name}={dtype}" for name, dtype in frame.dtypes.items())
        doubled = sorted(int(value) for value in frame["b"] * 2)
        yield pd.DataFrame({"user": [key[0]], "dtypes": [dtypes], "doubled": [doubled]})

    def close(self) -> None:
        pass


def test_pandas_mode_columns_have_the_dtypes_spark_s_frames_have(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """Spark builds each DataFrame of a pandas processor from its rows' values, so byte,
    short and int columns are int64, float columns float64 and timestamp_ntz columns
    datetime64[ns]: what pandas infers from Python values. Ours were int8, int16, int32,
    float32 and datetime64[us], as Arrow converts them, and arithmetic in them differed:
    a byte 100 doubled was -56."""
    batches = [
        [
            {"user": "a", "b": 100, "s": 300, "i": 70_000, "f": 0.1, "l": 1, "d": 0.5},
            {"user": "a", "b": -7, "s": -1, "i": 0, "f": 2.5, "l": 2, "d": 1.0},
            {"user": "b", "b": 127, "s": 32_767, "i": 2**31 - 1, "f": -1.0, "l": 3, "d": 2.0},
        ],
        [{"user": "a", "b": 1, "s": 2, "i": 3, "f": 4.0, "l": 5, "d": 6.0}],
    ]
    for batch in batches:
        for row in batch:
            row["ntz"] = "2024-01-01T00:00:00.000001"
    case = ParityCase(NARROW_INPUT, ["user"], NarrowDtypes, NARROW_OUTPUT, use_pandas=True)
    theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(batches):
        for user in sorted({row["user"] for row in batch}):
            rows = [row for row in batch if row["user"] == user]
            values = [
                (
                    row["user"],
                    *[row[name] for name in NARROW_COLUMNS][:-1],
                    pd.Timestamp(row["ntz"]),
                )
                for row in rows
            ]
            inferred = pd.DataFrame(values, columns=list(NARROW_INPUT.names))  # plain pandas
            dtypes = ",".join(f"{name}={dtype}" for name, dtype in inferred.dtypes.items())
            doubled = tuple(sorted(2 * row["b"] for row in rows))
            expected[(batch_id, (user, dtypes, doubled))] += 1
    assert ours == expected
    assert theirs == expected


NESTED_TIME_INPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("ats", ArrayType(TimestampType())),
        StructField("point", StructType([StructField("at", TimestampType())])),
        StructField("points", ArrayType(StructType([StructField("x", LongType())]))),
    ]
)
NESTED_TIME_OUTPUT = StructType(
    [StructField("user", StringType()), StructField("seen", ArrayType(StringType()))]
)


class NestedTimes(StatefulProcessor):
    """pandas mode: per row, what it gets inside its nested columns, as text: each
    timestamp of ``ats`` and ``point`` (type and value), and the dtype of ``points``."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        seen = []
        for frame in rows:
            values = zip(frame["ats"], frame["point"], frame["points"], strict=True)
            for ats, point, points in values:
                stamps = [*ats, point["at"]]
                seen.append(" ".join(f"{type(t).__name__}:{t}" for t in stamps))
                seen.append(f"{type(points).__name__}:{points.dtype}:{len(points)}")
        yield pd.DataFrame({"user": [key[0]], "seen": [sorted(seen)]})

    def close(self) -> None:
        pass


def test_pandas_mode_nested_timestamps_and_empty_arrays_are_spark_s(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """Timestamps inside arrays and structs reach a pandas processor as naive
    ``Timestamp`` wall times of the session time zone, and an empty array of structs as
    a float64 ndarray (``numpy.array([])``), as in Spark: ours gave arrays of UTC
    ``datetime64``, zone-aware datetimes in structs, and object arrays."""
    zone = "America/New_York"
    instants = ["2024-07-01T12:00:00Z", "2024-12-01T08:30:00Z"]
    batches = [
        [
            {"user": "a", "ats": instants, "point": {"at": instants[1]}, "points": []},
            {"user": "b", "ats": [], "point": {"at": instants[0]}, "points": [{"x": 1}]},
        ]
    ]
    case = ParityCase(NESTED_TIME_INPUT, ["user"], NestedTimes, NESTED_TIME_OUTPUT, use_pandas=True)
    spark_local.conf.set("spark.sql.session.timeZone", zone)
    try:
        theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    finally:
        spark_local.conf.unset("spark.sql.session.timeZone")

    def wall(instant: str) -> str:
        local = datetime.fromisoformat(instant).astimezone(ZoneInfo(zone))
        return f"Timestamp:{local.replace(tzinfo=None)}"

    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for row in batches[0]:
        stamps = " ".join(wall(t) for t in [*row["ats"], row["point"]["at"]])
        points = f"ndarray:{'object' if row['points'] else 'float64'}:{len(row['points'])}"
        expected[(0, (row["user"], tuple(sorted([stamps, points]))))] += 1
    assert theirs == expected
    assert ours == expected


TIMER_KEY_INPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("t", TimestampType()),
        StructField(
            "place", StructType([StructField("x", DoubleType()), StructField("name", StringType())])
        ),
    ]
)
TIMER_KEY_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("kind", StringType()),
        StructField("t", StringType()),
        StructField("place", StringType()),
    ]
)


class TimerKeys(StatefulProcessor):
    """Row mode, keyed by (user, t, place): per key a timer at the batch's time; the key's
    timestamp and struct as text, as ``handleInputRows`` and ``handleExpiredTimer`` get
    them (the struct read by field name where it is a Row)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle

    @staticmethod
    def _shown(place: Any) -> str:
        if isinstance(place, Row):
            return f"Row x={place.x} name={place.name}"
        return f"{type(place).__name__} {place!r}"

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Row]:
        list(rows)
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs())
        yield Row(user=key[0], kind="input", t=str(key[1]), place=self._shown(key[2]))

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Row]:
        yield Row(user=key.user, kind="timer", t=str(key.t), place=self._shown(key.place))

    def close(self) -> None:
        pass


def test_row_mode_timer_keys_hold_timestamps_and_structs_as_spark_unpickles_them(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """In Row mode ``handleInputRows`` gets a key's timestamp zone-aware in the session
    time zone, and ``handleExpiredTimer`` the same instant as Spark unpickles it: a naive
    datetime of the Python worker's local time, not the session's wall time, which ours
    gave (pandas mode differs: there the key the processor saw is a naive wall time)."""
    batches = [
        [
            {"user": "a", "t": "2024-07-01T12:00:00Z", "place": {"x": 0.5, "name": "p"}},
            {"user": "b", "t": "1899-12-31T12:00:00Z", "place": {"x": 1.5, "name": "q"}},
        ]
    ]
    case = ParityCase(
        TIMER_KEY_INPUT,
        ["user", "t", "place"],
        TimerKeys,
        TIMER_KEY_OUTPUT,
        time_mode="ProcessingTime",
    )
    spark_local.conf.set("spark.sql.session.timeZone", WALL_ZONE_WEST)
    try:
        theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    finally:
        spark_local.conf.unset("spark.sql.session.timeZone")
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for row in batches[0]:
        instant = datetime.fromisoformat(row["t"])
        aware = str(instant.astimezone(ZoneInfo(WALL_ZONE_WEST)))
        local = str(datetime.fromtimestamp(instant.timestamp()))  # naive, local
        place = f"Row x={row['place']['x']} name={row['place']['name']}"
        as_dict = f"dict {row['place']!r}"
        expected[(0, (row["user"], "input", aware, as_dict))] += 1
        expected[(0, (row["user"], "timer", local, place))] += 1
    assert theirs == expected
    assert ours == expected


# -- argument types of the handle's numbers ----------------------------------------------

ARGUMENT_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("call", StringType()),
        StructField("outcome", StringType()),
        StructField("listed", ArrayType(LongType())),
    ]
)
TIMER_ARGUMENTS: list[tuple[str, Any]] = [
    ("int", 1_000),
    ("numpy int", np.int64(2_000)),
    ("bool", True),
    ("None", None),
    ("float", 3_000.5),
    ("whole float", 4_000.0),
    ("numpy float", np.float64(5_000.0)),
    ("str", "6000"),
    ("beyond 64 bits", 2**63),
]
TTL_ARGUMENTS: list[tuple[str, Any]] = [
    ("numpy int", np.int64(HOUR_MS)),
    ("bool", True),
    ("whole float", float(HOUR_MS)),
    ("str", str(HOUR_MS)),
]


def _outcome(call: Any) -> str:
    """What a handle call did: "ok", or the builtin error class it raised."""
    try:
        call()
    except TypeError:
        return "TypeError"
    except ValueError:
        return "ValueError"
    return "ok"


class HandleArguments(StatefulProcessor):
    """Gives the handle's number arguments (timer timestamps, ``ttlDurationMs``) of every
    type and reports, per call, whether it raised TypeError or ValueError and which timers
    it left; a TTL'd state that was declared then keeps a value."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.ttl_outcomes = []
        self.ttl_states = []
        for number, (label, ttl) in enumerate(TTL_ARGUMENTS):
            declare = partial(handle.getValueState, f"ttl{number}", "n long", ttl)
            outcome = _outcome(lambda declare=declare: self.ttl_states.append(declare()))
            self.ttl_outcomes.append((label, outcome))

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        list(rows)
        handle = self.handle
        for label, outcome in self.ttl_outcomes:
            yield Row(user=key[0], call=f"ttl {label}", outcome=outcome, listed=[])
        for state in self.ttl_states:
            state.update((1,))
        kept = sum(state.get() == (1,) for state in self.ttl_states)
        yield Row(user=key[0], call="ttl states kept", outcome=str(kept), listed=[])
        for label, expiry in TIMER_ARGUMENTS:
            outcome = _outcome(partial(handle.registerTimer, expiry))
            listed = sorted(handle.listTimers())
            yield Row(user=key[0], call=f"register {label}", outcome=outcome, listed=listed)
            for timer in listed:
                handle.deleteTimer(timer)
        for label, expiry in TIMER_ARGUMENTS:
            handle.registerTimer(1_000)
            outcome = _outcome(partial(handle.deleteTimer, expiry))
            listed = sorted(handle.listTimers())
            yield Row(user=key[0], call=f"delete {label}", outcome=outcome, listed=listed)
            for timer in listed:
                handle.deleteTimer(timer)

    def close(self) -> None:
        pass


def _as_spark_s_int64(value: Any) -> tuple[str, int | None]:
    """(outcome, milliseconds) of a number given to Spark's handle, which sets it in an
    int64 protobuf field: None is unset (0), whole types (int, bool, numpy integers) are
    kept, any other type is a TypeError, more than 64 bits a ValueError."""
    if value is None:
        return "ok", 0
    if not isinstance(value, (int, np.integer)):
        return "TypeError", None
    if not -(2**63) <= int(value) < 2**63:
        return "ValueError", None
    return "ok", int(value)


def test_timer_and_ttl_numbers_take_the_types_spark_takes(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """Timer timestamps and TTLs are ints, as in Spark: a float (even ``2.0``) or a
    string is a TypeError and None a timer at 0; ours truncated floats and parsed strings
    into timers, and refused a numpy int TTL as not positive."""
    case = ParityCase(INPUT, ["user"], HandleArguments, ARGUMENT_OUTPUT, time_mode="ProcessingTime")
    theirs, ours = run_parity(spark_local, case, [BATCHES[0][:2]], tmp_path)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for user in ("alice", "bob"):
        kept = 0
        for label, ttl in TTL_ARGUMENTS:
            outcome, _ = _as_spark_s_int64(ttl)
            kept += outcome == "ok"
            expected[(0, (user, f"ttl {label}", outcome, ()))] += 1
        expected[(0, (user, "ttl states kept", str(kept), ()))] += 1
        for label, expiry in TIMER_ARGUMENTS:
            outcome, at = _as_spark_s_int64(expiry)
            registered = () if at is None else (at,)
            expected[(0, (user, f"register {label}", outcome, registered))] += 1
            left = (1_000,) if at != 1_000 else ()
            expected[(0, (user, f"delete {label}", outcome, left))] += 1
    assert theirs == expected
    assert ours == expected


# -- pandas mode: a key's rows in chunks of maxRecordsPerBatch ----------------------------

CHUNK_ROWS = 2
CHUNK_INPUT = StructType([StructField("user", StringType()), StructField("amount", LongType())])
CHUNK_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("kind", StringType()),
        StructField("sizes", ArrayType(LongType())),
        StructField("amounts", ArrayType(LongType())),
    ]
)


class PandasChunks(StatefulProcessor):
    """Reports the DataFrames it gets: per ``handleInputRows``, the size of each input
    DataFrame and their amounts in order, and the size and first amount of each initial
    state DataFrame ``handleInitialState`` got (kept in a list state)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.initial = handle.getListState("initial", "size long, first long")

    def handleInitialState(self, key: Any, initialState: Any, timerValues: TimerValues) -> None:
        self.initial.appendValue((len(initialState), int(initialState["amount"].iloc[0])))

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        frames = list(rows)
        initial = list(self.initial.get())
        yield pd.DataFrame(
            {
                "user": [key[0], key[0]],
                "kind": ["input", "initial"],
                "sizes": [[len(frame) for frame in frames], [size for size, _ in initial]],
                "amounts": [
                    [int(amount) for frame in frames for amount in frame["amount"]],
                    [first for _, first in initial],
                ],
            }
        )

    def close(self) -> None:
        pass


def _chunk_sizes(rows: int) -> tuple[int, ...]:
    """The sizes of ``rows`` rows cut into chunks of ``CHUNK_ROWS``."""
    return tuple(min(CHUNK_ROWS, rows - start) for start in range(0, rows, CHUNK_ROWS))


def test_pandas_mode_chunks_a_key_s_rows_by_max_records_per_batch_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """A pandas processor gets a key's rows (input and initial state alike) as DataFrames
    of at most ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows, in order, as in
    Spark; ours gave one DataFrame per key (per Arrow batch it spanned)."""
    batches = [
        [{"user": "alice", "amount": n} for n in range(5)] + [{"user": "bob", "amount": 10}],
        [{"user": "alice", "amount": 20 + n} for n in range(3)] + [{"user": "carol", "amount": 30}],
    ]
    initial = [{"user": "alice", "amount": 100 + n} for n in range(3)]
    initial += [{"user": "carol", "amount": 200 + n} for n in range(3)]
    case = ParityCase(
        CHUNK_INPUT,
        ["user"],
        PandasChunks,
        CHUNK_OUTPUT,
        use_pandas=True,
        initial_state=initial,
        initial_schema=CHUNK_INPUT,
    )
    spark_local.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(CHUNK_ROWS))
    try:
        theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    finally:
        spark_local.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(batches):
        for user in dict.fromkeys(row["user"] for row in batch):
            amounts = tuple(row["amount"] for row in batch if row["user"] == user)
            seeds = [row["amount"] for row in initial if row["user"] == user]
            firsts = tuple(seeds[::CHUNK_ROWS])
            expected[(batch_id, (user, "input", _chunk_sizes(len(amounts)), amounts))] += 1
            expected[(batch_id, (user, "initial", _chunk_sizes(len(seeds)), firsts))] += 1
    assert theirs == expected
    assert ours == expected


WIDE_INPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("amount", LongType()),
        StructField("text", StringType()),
    ]
)
TEXT_BYTES = 100_000
MAX_BYTES = 250_000


def test_pandas_mode_chunks_a_key_s_rows_by_max_bytes_per_batch_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """With ``spark.sql.execution.arrow.maxBytesPerBatch`` a pandas processor gets a
    key's rows in DataFrames of the fewest rows that reach that many bytes, as in Spark
    (rows of 100 KB, a limit of 250 KB: 3 rows); ours ignored the limit."""
    batches = [
        [
            {"user": user, "amount": n, "text": "x" * TEXT_BYTES}
            for n, user in enumerate(["alice"] * 7 + ["bob"] * 2 + ["carol"] * 4)
        ]
    ]
    case = ParityCase(WIDE_INPUT, ["user"], PandasChunks, CHUNK_OUTPUT, use_pandas=True)
    spark_local.conf.set("spark.sql.execution.arrow.maxBytesPerBatch", str(MAX_BYTES))
    try:
        theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    finally:
        spark_local.conf.unset("spark.sql.execution.arrow.maxBytesPerBatch")
    per_frame = math.ceil(MAX_BYTES / TEXT_BYTES)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for user in dict.fromkeys(row["user"] for row in batches[0]):
        amounts = tuple(row["amount"] for row in batches[0] if row["user"] == user)
        sizes = tuple(min(per_frame, len(amounts) - i) for i in range(0, len(amounts), per_frame))
        expected[(0, (user, "input", sizes, amounts))] += 1
        expected[(0, (user, "initial", (), ()))] += 1
    assert theirs == expected
    assert ours == expected


# -- ListState.get reads when iterated ---------------------------------------------------

LAZY_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("after_append", ArrayType(LongType())),
        StructField("after_put", ArrayType(LongType())),
        StructField("after_clear", ArrayType(LongType())),
    ]
)


class LateListReads(StatefulProcessor):
    """Takes ``ListState.get()`` iterators before changing the list and reads them after:
    before appending the batch's amounts, before replacing the list by its sum, and
    before clearing a second list."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.amounts = handle.getListState("amounts", "v long")
        self.scratch = handle.getListState("scratch", "v long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        new = [(row.amount,) for row in rows]
        pending = self.amounts.get()
        self.amounts.appendList(new)
        after_append = [v for (v,) in pending]
        pending = self.amounts.get()
        self.amounts.put([(sum(after_append),)])
        after_put = [v for (v,) in pending]
        self.scratch.put(new)
        pending = self.scratch.get()
        self.scratch.clear()
        after_clear = [v for (v,) in pending]
        yield Row(
            user=key[0], after_append=after_append, after_put=after_put, after_clear=after_clear
        )

    def close(self) -> None:
        pass


def test_list_state_get_reads_the_list_when_iterated_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """``ListState.get()`` reads the list when its iterator is first advanced, as Spark's
    does: an iterator taken before an append, put or clear gives the list after it. Ours
    read the list when ``get()`` was called."""
    case = ParityCase(INPUT, ["user"], LateListReads, LAZY_OUTPUT)
    theirs, ours = run_parity(spark_local, case, BATCHES[:2], tmp_path)
    lists: dict[str, list[int]] = {}
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(BATCHES[:2]):
        for user in {r["user"] for r in batch}:
            appended = lists.get(user, []) + [r["amount"] for r in batch if r["user"] == user]
            lists[user] = [sum(appended)]
            expected[(batch_id, (user, tuple(appended), tuple(lists[user]), ()))] += 1
    assert theirs == expected
    assert ours == expected


# -- None as a state's value --------------------------------------------------------------

NONE_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("outcomes", ArrayType(StringType())),
        StructField("count", LongType()),
        StructField("listed", LongType()),
        StructField("mapped", LongType()),
    ]
)


class NoneValues(StatefulProcessor):
    """Gives None as a value (and as a user key) to each state, then counts the key's
    rows in a value, a list and a map state: what the None calls raised and what the
    states hold after them."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "n long")
        self.items = handle.getListState("items", "item string")
        self.seen = handle.getMapState("seen", "item string", "n long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        items = [row.item for row in rows]
        calls = [
            partial(self.count.update, None),
            partial(self.items.appendValue, None),
            partial(self.seen.updateValue, None, (1,)),
            partial(self.seen.updateValue, ("x",), None),
        ]
        outcomes = [_outcome(call) for call in calls]
        self.count.update(((self.count.get() or (0,))[0] + len(items),))
        self.items.appendList([(item,) for item in items])
        for item in items:
            self.seen.updateValue((item,), (1,))
        yield Row(
            user=key[0],
            outcomes=outcomes,
            count=self.count.get()[0],
            listed=len(list(self.items.get())),
            mapped=len(list(self.seen.keys())),
        )

    def close(self) -> None:
        pass


def test_none_as_a_state_value_is_a_type_error_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """``ValueState.update(None)``, ``ListState.appendValue(None)`` and a None user key
    or value in ``MapState.updateValue`` raise TypeError and change nothing, as in Spark;
    ours cleared the value on ``update(None)`` and raised other errors for the rest."""
    case = ParityCase(INPUT, ["user"], NoneValues, NONE_OUTPUT)
    theirs, ours = run_parity(spark_local, case, BATCHES[:2], tmp_path)
    seen: dict[str, list[str]] = {}
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(BATCHES[:2]):
        for user in {r["user"] for r in batch}:
            seen.setdefault(user, []).extend(r["item"] for r in batch if r["user"] == user)
            items = seen[user]
            row = (user, ("TypeError",) * 4, len(items), len(items), len(set(items)))
            expected[(batch_id, row)] += 1
    assert theirs == expected
    assert ours == expected


# -- handleExpiredTimer's arguments by name -----------------------------------------------

NAMED_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("kind", StringType()),
        StructField("n", LongType()),
    ]
)


class NamedTimerArguments(StatefulProcessor):
    """ProcessingTime: a timer at the batch's time per key with input; the timer handler
    declares its parameters in another order than Spark's base class (``expiredTimerInfo``
    before ``timerValues``) and reports whether the timer is due at the batch's time."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs())
        yield Row(user=key[0], kind="in", n=len(list(rows)))

    def handleExpiredTimer(  # type: ignore[override]
        self, key: Any, expiredTimerInfo: ExpiredTimerInfo, timerValues: TimerValues
    ) -> Iterator[Any]:
        now = timerValues.getCurrentProcessingTimeInMs()
        yield Row(user=key[0], kind="timer", n=int(expiredTimerInfo.getExpiryTimeInMs() == now))

    def close(self) -> None:
        pass


def test_handle_expired_timer_gets_its_arguments_by_name_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """Spark calls ``handleExpiredTimer(key=..., timerValues=..., expiredTimerInfo=...)``:
    a handler declaring them in another order gets each by its name. Ours passed them by
    position, so such a handler got the TimerValues as its expiredTimerInfo and failed."""
    case = ParityCase(
        INPUT, ["user"], NamedTimerArguments, NAMED_OUTPUT, time_mode="ProcessingTime"
    )
    theirs, ours = run_parity(spark_local, case, BATCHES[:2], tmp_path)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(BATCHES[:2]):
        for user in {r["user"] for r in batch}:
            expected[(batch_id, (user, "in", sum(r["user"] == user for r in batch)))] += 1
            expected[(batch_id, (user, "timer", 1))] += 1
    assert theirs == expected
    assert ours == expected


# -- state used where no key is current ---------------------------------------------------


class StateInClose(StatefulProcessor):
    """Counts each key's rows; ``close()``, once keys were handled, reads the count (no
    key is current there: Spark removes it before ``close()``)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "n long")
        self.handled = False

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        self.handled = True
        self.count.update(((self.count.get() or (0,))[0] + len(list(rows)),))
        yield Row(user=key[0], before=0, after=self.count.get()[0])

    def close(self) -> None:
        if self.handled:
            self.count.exists()


def test_state_used_in_close_is_an_error_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """Spark removes the current key before ``close()``, so a state used there fails the
    query; ours served the state of the last key handled."""
    case = ParityCase(INPUT, ["user"], StateInClose, ZERO_TTL_OUTPUT)
    input_dir = tmp_path / "input"
    write_batches(input_dir, BATCHES[:1])
    with parity_settings(spark_local, tmp_path):
        with pytest.raises(StreamingQueryException, match="Implicit key not found.*count"):
            run_spark(spark_local, case, input_dir, tmp_path / "spark-checkpoint")
        refused = (
            "StatefulProcessorError: .*operation=exists with invalid handle "
            "state=TIMER_PROCESSED: use state 'count' in handleInputRows"
        )
        with pytest.raises(StreamingQueryException, match=refused):
            run_ours(spark_local, case, input_dir, tmp_path / "our-checkpoint", job_id="close")


# -- deleteIfExists -----------------------------------------------------------------------

DELETED_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("outcomes", ArrayType(StringType())),
        StructField("count", LongType()),
        StructField("redeclared", LongType()),
    ]
)


def _runtime_error(call: Any) -> str:
    """What a state call did: "RuntimeError" (Spark's PySparkRuntimeError is one), or
    "ok" and what it returned, if anything."""
    try:
        result = call()
    except RuntimeError:
        return "RuntimeError"
    return "ok" if result is None else f"ok {result!r}"


class DeletedStates(StatefulProcessor):
    """Declares a value, a list and a map state and deletes them with ``deleteIfExists``
    in ``init``; then uses each deleted state (every call's outcome is reported), counts
    the key's rows in a state that was not deleted, and in one declared after a
    ``deleteIfExists`` of its name."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "n long")
        self.value = handle.getValueState("value", "n long")
        self.items = handle.getListState("items", "item string")
        self.seen = handle.getMapState("seen", "item string", "n long")
        for name in ("value", "items", "seen", "again"):
            handle.deleteIfExists(name)
        self.again = handle.getValueState("again", "n long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        n = len(list(rows))
        calls = [
            self.value.exists,
            self.value.get,
            partial(self.value.update, (1,)),
            self.value.clear,
            self.items.exists,
            lambda: list(self.items.get()),
            partial(self.items.appendValue, ("x",)),
            partial(self.items.put, [("x",)]),
            self.seen.exists,
            partial(self.seen.updateValue, ("x",), (1,)),
            lambda: list(self.seen.keys()),
            self.seen.clear,
        ]
        outcomes = [_runtime_error(call) for call in calls]
        self.count.update(((self.count.get() or (0,))[0] + n,))
        self.again.update(((self.again.get() or (0,))[0] + n,))
        count, again = self.count.get()[0], self.again.get()[0]
        yield Row(user=key[0], outcomes=outcomes, count=count, redeclared=again)

    def close(self) -> None:
        pass


def test_a_state_deleted_in_init_is_unusable_like_spark(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """After ``deleteIfExists(name)`` in ``init``, Spark's handle refuses every call of the
    state variables of that name declared before it with a RuntimeError
    (PySparkRuntimeError: "Value state ... is not initialized"); a state declared after
    it is usable (empty at each batch's start, as each batch's ``init`` deletes it
    again). Ours kept serving the deleted states. One difference is kept: Spark's list
    and map iterators end at any error of its state server, so iterating a deleted state
    gives nothing there; ours raises the same error as every other call."""
    case = ParityCase(INPUT, ["user"], DeletedStates, DELETED_OUTPUT)
    theirs, ours = run_parity(spark_local, case, BATCHES[:2], tmp_path)
    refused = ["RuntimeError"] * 12
    swallowed = list(refused)
    swallowed[5] = swallowed[10] = "ok []"  # list(items.get()), list(seen.keys())
    counts: Counter[str] = Counter()
    expected: dict[str, Counter[tuple[int, tuple[Any, ...]]]] = {
        "spark": Counter(),
        "ours": Counter(),
    }
    for batch_id, batch in enumerate(BATCHES[:2]):
        for user in {r["user"] for r in batch}:
            rows = sum(r["user"] == user for r in batch)
            counts[user] += rows
            for who, outcomes in (("spark", swallowed), ("ours", refused)):
                expected[who][(batch_id, (user, tuple(outcomes), counts[user], rows))] += 1
    assert theirs == expected["spark"]
    assert ours == expected["ours"]


# -- MapState iteration order -------------------------------------------------------------

ORDER_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("state", StringType()),
        StructField("keys", StringType()),
        StructField("values", ArrayType(LongType())),
        StructField("items", ArrayType(LongType())),
    ]
)
ORDER_KEYS: dict[str, list[tuple[Any, ...]]] = {
    "k long": [(-1,), (0,), (1,), (255,), (256,), (-256,), (2**40,), (None,)],
    "k int": [(7,), (-7,), (300,)],
    "k double": [(-1.5,), (0.0,), (1.5,), (2.0,), (1e10,)],
    "k boolean": [(True,), (False,)],
    "k string": [("",), ("b",), ("aa",), ("a" * 300,), ("é",), ("zzzzzzzzz",), (None,)],
    "a string, b long": [("a", 2), ("a", 1), ("b", 1), ("aa", 0), ("", 5), (None, 1), ("a", None)],
    "a long, b string": [(1, "zz"), (1, "a"), (2, ""), (256, "b")],
    "k date": [(date(1970, 1, 2),), (date(1969, 12, 31),), (date(2024, 1, 1),)],
}


class MapOrder(StatefulProcessor):
    """Puts ``ORDER_KEYS``' user keys into one map state per key schema (the value is
    the key's position in ``ORDER_KEYS``) and reports the order in which ``keys()``,
    ``values()`` and ``iterator()`` give them."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.maps = {
            schema: handle.getMapState(f"m{n}", schema, "position long")
            for n, schema in enumerate(ORDER_KEYS)
        }

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        list(rows)
        for schema, state in self.maps.items():
            for position, user_key in enumerate(ORDER_KEYS[schema]):
                state.updateValue(user_key, (position,))
            keys = repr([tuple(user_key) for user_key in state.keys()])
            values = [value[0] for value in state.values()]
            items = [value[0] for _, value in state.iterator()]
            yield Row(user=key[0], state=schema, keys=keys, values=values, items=items)

    def close(self) -> None:
        pass


def _unsafe_row(values: tuple[Any, ...], types: list[str]) -> bytes:
    """Spark's UnsafeRow of ``values`` (fields of ``types``): a null bit set, one 8-byte
    little-endian word per field, then each string's UTF-8 bytes padded to 8 bytes."""
    bits = bytearray(8 * ((len(values) + 63) // 64))
    words = bytearray(8 * len(values))
    tail = bytearray()
    for position, (value, kind) in enumerate(zip(values, types, strict=True)):
        word = slice(8 * position, 8 * position + 8)
        if value is None:
            bits[position // 8] |= 1 << position % 8
        elif kind == "string":
            data = value.encode()
            offset = len(bits) + len(words) + len(tail)
            words[word] = (offset << 32 | len(data)).to_bytes(8, "little")
            tail += data + bytes(-len(data) % 8)
        elif kind == "date":
            words[word] = (value - date(1970, 1, 1)).days.to_bytes(8, "little", signed=True)
        elif kind == "double":
            words[word] = struct.pack("<d", value)
        else:  # long, int, boolean: their value in the word's low bytes
            words[word] = int(value).to_bytes(8, "little", signed=True)
    return bytes(bits + words + tail)


def test_map_state_iterates_in_spark_s_order(spark_local: SparkSession, tmp_path: Path) -> None:
    """Spark's map state gives its entries in the byte order of its RocksDB keys, where a
    user key is an UnsafeRow nested in the key row: by the row's size (a little-endian
    int), then its bytes (little-endian numbers, strings after the fixed words), not by
    value (256 before 1, -1 last). Ours gave them in its own key encoding's order."""
    case = ParityCase(INPUT, ["user"], MapOrder, ORDER_OUTPUT)
    theirs, ours = run_parity(spark_local, case, BATCHES[:1], tmp_path)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for user in {r["user"] for r in BATCHES[0]}:
        for schema, user_keys in ORDER_KEYS.items():
            types = [field.split()[1] for field in schema.split(", ")]
            types = ["long" if kind in ("int", "boolean") else kind for kind in types]

            def spark_s(user_key: tuple[Any, ...], types: list[str] = types) -> bytes:
                row = _unsafe_row(user_key, types)
                return len(row).to_bytes(4, "little") + row

            ordered = sorted(user_keys, key=spark_s)
            positions = tuple(user_keys.index(user_key) for user_key in ordered)
            expected[(0, (user, schema, repr(ordered), positions, positions))] += 1
    assert theirs == expected
    assert ours == expected


# -- pandas mode: ints into a decimal output column ---------------------------------------

INT_TO_DECIMAL = "spark.sql.execution.pythonUDF.pandas.intToDecimalCoercionEnabled"
DECIMAL_OUTPUT = StructType(
    [StructField("user", StringType()), StructField("total", DecimalType(10, 2))]
)


class DecimalTotals(StatefulProcessor):
    """pandas mode: per key, its amounts' sum as a plain int in a decimal(10,2) column."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        total = int(sum(frame["amount"].sum() for frame in rows))
        yield pd.DataFrame({"user": [key[0]], "total": [total]})

    def close(self) -> None:
        pass


def test_pandas_ints_fill_a_decimal_column_with_spark_s_coercion_setting(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """With ``spark.sql.execution.pythonUDF.pandas.intToDecimalCoercionEnabled`` Spark
    takes a pandas column of ints for a decimal output column (each int as a Decimal);
    ours refused it as not fitting the column whatever the setting."""
    case = ParityCase(INPUT, ["user"], DecimalTotals, DECIMAL_OUTPUT, use_pandas=True)
    spark_local.conf.set(INT_TO_DECIMAL, "true")
    try:
        theirs, ours = run_parity(spark_local, case, BATCHES[:2], tmp_path)
    finally:
        spark_local.conf.unset(INT_TO_DECIMAL)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(BATCHES[:2]):
        for user in {r["user"] for r in batch}:
            total = sum(r["amount"] for r in batch if r["user"] == user)
            expected[(batch_id, (user, Decimal(total).quantize(Decimal("0.01"))))] += 1
    assert theirs == expected
    assert ours == expected


# -- pandas mode: unsafe casts with convertToArrowArraySafely off -------------------------

SAFE_CONVERSION = "spark.sql.execution.pandas.convertToArrowArraySafely"
UNSAFE_OUTPUT = StructType(
    [
        StructField("user", StringType()),
        StructField("share", LongType()),
        StructField("scaled", IntegerType()),
    ]
)


class UnsafeShares(StatefulProcessor):
    """pandas mode: per key its amounts' sum divided by 3 (a float) into a long column,
    and the sum plus it times 2**32 (too big for an int) into an int column."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        total = int(sum(frame["amount"].sum() for frame in rows))
        scaled = total * 2**32 + total
        yield pd.DataFrame({"user": [key[0]], "share": [total / 3], "scaled": [scaled]})

    def close(self) -> None:
        pass


def test_pandas_output_is_cast_unsafely_with_spark_s_safety_setting_off(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """With ``spark.sql.execution.pandas.convertToArrowArraySafely`` off Spark casts a
    pandas processor's output as Arrow casts unsafely (a fraction loses it, an int too
    big keeps its low bits); ours refused such values whatever the setting."""
    case = ParityCase(INPUT, ["user"], UnsafeShares, UNSAFE_OUTPUT, use_pandas=True)
    spark_local.conf.set(SAFE_CONVERSION, "false")
    try:
        theirs, ours = run_parity(spark_local, case, BATCHES[:2], tmp_path)
    finally:
        spark_local.conf.unset(SAFE_CONVERSION)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(BATCHES[:2]):
        for user in {r["user"] for r in batch}:
            total = sum(r["amount"] for r in batch if r["user"] == user)
            low_bits = (total * 2**32 + total + 2**31) % 2**32 - 2**31
            expected[(batch_id, (user, int(total / 3), low_bits))] += 1
    assert theirs == expected
    assert ours == expected


# -- pandas mode: integer widths with preferIntExtensionDtype ------------------------------

INT_EXTENSION = "spark.sql.execution.pythonUDF.pandas.preferIntExtensionDtype"
INT_WIDTH_INPUT = StructType(
    [
        StructField("k", IntegerType()),
        StructField("b", ByteType()),
        StructField("s", ShortType()),
        StructField("l", LongType()),
    ]
)
INT_WIDTH_OUTPUT = StructType(
    [StructField("key", StringType()), StructField("seen", ArrayType(StringType()))]
)
INT_WIDTHS = {"k": "int32", "b": "int8", "s": "int16", "l": "int64"}


class IntWidths(StatefulProcessor):
    """pandas mode: per key, its key's type and per column of its frame the dtype and the
    types of its values, as text."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        frame = pd.concat(list(rows))
        seen = [
            f"{name}:{frame[name].dtype}:" + ",".join(type(v).__name__ for v in frame[name])
            for name in frame.columns
        ]
        yield pd.DataFrame({"key": [f"{type(key[0]).__name__}:{key[0]}"], "seen": [seen]})

    def close(self) -> None:
        pass


def test_pandas_mode_ints_keep_their_width_with_spark_s_extension_dtype_setting(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """With ``spark.sql.execution.pythonUDF.pandas.preferIntExtensionDtype`` a pandas
    processor's integer columns keep their width (``int8`` for byte: ``int`` values as
    pandas iterates them), one with nulls holds NumPy scalars and ``pandas.NA``, and an
    integer key is a NumPy scalar, as in Spark; ours widened them to int64 (nulls to
    float64 NaN) whatever the setting."""
    batches = [
        [
            {"k": 1, "b": 5, "s": 300, "l": 2**40},
            {"k": 2, "b": -3, "s": None, "l": 7},
            {"k": 2, "b": 4, "s": 9, "l": None},
        ]
    ]
    case = ParityCase(INT_WIDTH_INPUT, ["k"], IntWidths, INT_WIDTH_OUTPUT, use_pandas=True)
    spark_local.conf.set(INT_EXTENSION, "true")
    try:
        theirs, ours = run_parity(spark_local, case, batches, tmp_path)
    finally:
        spark_local.conf.unset(INT_EXTENSION)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for key in (1, 2):
        mine = [row for row in batches[0] if row["k"] == key]
        seen = []
        for name, width in INT_WIDTHS.items():
            values = [row[name] for row in mine]
            if None in values:
                kinds = ["NAType" if v is None else width for v in values]
                seen.append(f"{name}:object:" + ",".join(kinds))
            else:
                seen.append(f"{name}:{width}:" + ",".join("int" for _ in values))
        expected[(0, (f"int32:{key}", tuple(seen)))] += 1
    assert theirs == expected
    assert ours == expected


# -- pandas mode: output columns by position with assignColumnsByName off -----------------

BY_NAME = "spark.sql.legacy.execution.pandas.groupedMap.assignColumnsByName"
SWAPPED_OUTPUT = StructType([StructField("total", LongType()), StructField("rows", LongType())])


class SwappedColumns(StatefulProcessor):
    """pandas mode: per key a frame labelled ``rows``, ``total`` (the schema's other order)
    holding its row count and its amounts' sum."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        frames = list(rows)
        count, total = sum(len(f) for f in frames), int(sum(f["amount"].sum() for f in frames))
        yield pd.DataFrame({"rows": [count], "total": [total]})

    def close(self) -> None:
        pass


@pytest.mark.parametrize("by_name", [True, False])
def test_pandas_output_columns_by_name_or_position_with_spark_s_setting(
    spark_local: SparkSession, tmp_path: Path, by_name: bool
) -> None:
    """With ``spark.sql.legacy.execution.pandas.groupedMap.assignColumnsByName`` off
    Spark takes a pandas processor's output columns by position (on: by name); ours took
    them by name whatever the setting."""
    case = ParityCase(INPUT, ["user"], SwappedColumns, SWAPPED_OUTPUT, use_pandas=True)
    spark_local.conf.set(BY_NAME, str(by_name).lower())
    try:
        theirs, ours = run_parity(spark_local, case, BATCHES[:2], tmp_path)
    finally:
        spark_local.conf.unset(BY_NAME)
    expected: Counter[tuple[int, tuple[Any, ...]]] = Counter()
    for batch_id, batch in enumerate(BATCHES[:2]):
        for user in {r["user"] for r in batch}:
            amounts = [r["amount"] for r in batch if r["user"] == user]
            by_label = {"rows": len(amounts), "total": sum(amounts)}
            values = (by_label["total"], by_label["rows"]) if by_name else tuple(by_label.values())
            expected[(batch_id, values)] += 1
    assert theirs == expected
    assert ours == expected
