"""transform_with_state's surface: argument checks (one clear error each), a batch
DataFrame as one batch with initial state, and writeStream to a file sink."""

from __future__ import annotations

import re
import struct
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from py4j.protocol import Py4JJavaError
from pyspark import TaskContext, cloudpickle
from pyspark.errors import PySparkValueError
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)

from statebackend.errors import ConfigurationError, IncompatibleStateError, ProcessorFailedError
from statebackend.spark.api import KeyedContext, KeyedFunction
from statebackend.spark.arrow_path import KeyedBatches
from statebackend.spark.example import CATEGORIES, UserTotals
from statebackend.spark.processor_runner import SUBTASK_COLUMN
from statebackend.spark.query_stop import stop_interruption
from statebackend.spark.streaming import transform_with_state
from tests.spark.jobs import streaming_session
from tests.spark.streaming_parity import write_batches

cloudpickle.register_pickle_by_value(sys.modules[__name__])

OUTPUT = "user string, total long"


class Totals(StatefulProcessor):
    """Running total of `amount` per user; initial state rows add `start`."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.total = handle.getValueState("total", "total long")

    def _add(self, amount: int) -> int:
        current = self.total.get()
        total = (current[0] if current else 0) + amount
        self.total.update((total,))
        return total

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        yield Row(user=key[0], total=self._add(sum(row.amount for row in rows)))

    def handleInitialState(self, key: Any, initialState: Row, timerValues: TimerValues) -> None:
        self._add(initialState.start)

    def close(self) -> None:
        pass


def batch_files(spark: SparkSession, directory: Path) -> DataFrame:
    """A stream of the (user, amount) batch files in ``directory``, one file a batch."""
    return (
        spark.readStream.schema("user string, amount long")
        .option("maxFilesPerTrigger", 1)
        .json(str(directory))
    )


@pytest.fixture
def spark(spark_local: SparkSession, tmp_path: Path) -> Iterator[SparkSession]:
    with streaming_session(spark_local, tmp_path) as session:
        yield session


@pytest.fixture
def events(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame(
        [("a", 1, 10), ("b", 2, 20), ("a", 3, 30), ("c", 4, 40)],
        "user string, amount long, ts long",
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"key_by": "nobody"}, "unknown key column 'nobody'"),
        ({"key_by": []}, "key_by"),
        ({"output_mode": "Complete"}, "output_mode 'Complete' is invalid"),
        ({"time_mode": "Wallclock"}, "time_mode 'Wallclock' is invalid"),
        ({"output_schema": 42}, "output_schema 42 is invalid"),
        ({"output_schema": "user strin g,,"}, "not a valid DDL schema"),
        ({"output_schema": "long"}, "output_schema 'long' is invalid"),
        ({"processor": object()}, "StatefulProcessor subclass or of a KeyedFunction"),
        ({"job_id": "a/b"}, "job_id 'a/b' is invalid"),
        ({"job_id": ""}, "job_id '' is invalid: use a non-empty name of letters"),
        ({"job_id": ".."}, "job_id '..' is invalid: use a non-empty name of letters"),
        ({"job_id": "a b"}, "job_id 'a b' is invalid: use a non-empty name of letters"),
        ({"time_mode": "EventTime"}, "withWatermark"),
        ({"initial_state": "nope"}, "initial_state 'nope' is invalid"),
        ({"parallelism": 0}, "parallelism 0 is invalid"),
        ({"use_pandas": "false"}, "use_pandas 'false' is invalid: give True or False"),
        ({"use_pandas": None}, "use_pandas None is invalid: give True or False"),
    ],
)
def test_bad_arguments_are_one_clear_error(
    events: DataFrame, overrides: dict[str, Any], message: str
) -> None:
    arguments: dict[str, Any] = {
        "df": events,
        "key_by": "user",
        "processor": Totals(),
        "output_schema": OUTPUT,
        "job_id": "api",
    }
    arguments.update(overrides)
    with pytest.raises(ConfigurationError, match=message):
        transform_with_state(**arguments)


@pytest.mark.parametrize(
    ("grouping", "message"),
    [
        (["user", "start"], r"grouped by \['user', 'start'\] and the input by \['user'\]"),
        (["upper(user)"], r"grouped by 'upper\(user\)', not a column of its DataFrame"),
    ],
)
def test_initial_state_grouped_unlike_the_keys_is_one_clear_error(
    spark: SparkSession, events: DataFrame, grouping: list[str], message: str
) -> None:
    initial = spark.createDataFrame([("a", 100)], "user string, start long")
    grouped = initial.groupBy(*[F.expr(name) for name in grouping])
    with pytest.raises(ConfigurationError, match=message):
        transform_with_state(events, "user", Totals(), OUTPUT, "api", initial_state=grouped)


class TypoInSchema(Totals):
    """``Totals`` declaring its state with a typo (``lng``) in the ``which`` schema: of
    a value state, or the user key or value schema of a map state."""

    def __init__(self, which: str) -> None:
        self.which = which

    def init(self, handle: StatefulProcessorHandle) -> None:
        if self.which == "schema":
            self.total = handle.getValueState("totals", "count lng, total long")
        elif self.which == "user key schema":
            handle.getMapState("totals", "count lng, total long", "total long")
        else:
            handle.getMapState("totals", "user string", "count lng, total long")


@pytest.mark.parametrize("which", ["schema", "user key schema", "value schema"])
def test_a_typo_in_a_state_schema_is_one_line_naming_the_state(
    events: DataFrame, which: str
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        transform_with_state(events, "user", TypoInSchema(which), OUTPUT, "typo")
    message = str(raised.value)
    assert re.fullmatch(
        rf"state 'totals': {which} 'count lng, total long' is not a valid DDL schema: "
        r"\[UNSUPPORTED_DATATYPE\] Unsupported data type \"LNG\"\. [^\n]*; "
        r"write 'name type, \.\.\.'",
        message,
    ), message


def test_no_checkpoint_dir_is_a_clear_error(spark_local: SparkSession) -> None:
    df = spark_local.createDataFrame([("a", 1)], "user string, amount long")
    with pytest.raises(ConfigurationError, match="spark.statebackend.checkpoint.dir"):
        transform_with_state(df, "user", Totals(), OUTPUT, "api")


def test_a_setting_changed_after_transform_with_state_is_refused_at_start(
    spark: SparkSession, events: DataFrame, tmp_path: Path
) -> None:
    """transform_with_state reads the spark.statebackend.* settings; one set afterwards
    (the tick interval an idle stream's timers need) would be ignored: start() and toDF()
    refuse to run without it, naming the key, before any batch."""
    stateful = transform_with_state(events, "user", Totals(), OUTPUT, "late-conf")
    (tmp_path / "in").mkdir()
    streaming = transform_with_state(
        batch_files(spark, tmp_path / "in"), "user", Totals(), OUTPUT, "late-conf-stream"
    )
    spark.conf.set("spark.statebackend.streaming.tick-interval", "1")
    try:
        with pytest.raises(ConfigurationError, match=r"streaming\.tick-interval changed after"):
            stateful.toDF()
        writer = streaming.writeStream.format("parquet").option("path", str(tmp_path / "out"))
        with pytest.raises(ConfigurationError, match=r"streaming\.tick-interval changed after"):
            writer.option("checkpointLocation", str(tmp_path / "ckpt")).start()
    finally:
        spark.conf.unset("spark.statebackend.streaming.tick-interval")
    assert not (tmp_path / "ckpt").exists()
    assert sorted(tuple(row) for row in stateful.toDF().collect()) == [
        ("a", 4), ("b", 2), ("c", 4)
    ]  # fmt: skip


def test_two_queries_of_one_job_started_at_once_one_is_refused(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Two queries with the same job_id and their own checkpointLocations, started at
    the same moment from two threads of one session: one starts, the other is refused
    (the job belongs to the first's checkpointLocation), in each of a few tries; the one
    that started writes every total exactly once. Unrefused, the two commit over each
    other's batches and leave a manifest naming a changelog record the other deleted."""
    batches = [
        [{"user": "a", "amount": 1}, {"user": "b", "amount": 2}],
        [{"user": "a", "amount": 3}],
        [{"user": "b", "amount": 4}],
    ]
    write_batches(tmp_path / "input", batches)

    def writer(job_id: str, i: int) -> Any:
        source = batch_files(spark, tmp_path / "input")
        return (
            transform_with_state(source, "user", Totals(), OUTPUT, job_id)
            .writeStream.format("parquet")
            .options(
                path=str(tmp_path / f"out-{job_id}-{i}"),
                checkpointLocation=str(tmp_path / f"ckpt-{job_id}-{i}"),
            )
        )

    def start_at_once(writers: list[Any]) -> dict[int, Any]:
        """Each writer's query, or the ConfigurationError its start raised."""
        barrier = threading.Barrier(len(writers))
        started: dict[int, Any] = {}

        def start(i: int) -> None:
            barrier.wait()
            try:
                started[i] = writers[i].start()
            except ConfigurationError as exc:
                started[i] = exc

        threads = [threading.Thread(target=start, args=(i,)) for i in range(len(writers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return started

    winners = []
    for attempt in range(4):
        started = start_at_once([writer(f"one-{attempt}", i) for i in range(2)])
        queries = {i: q for i, q in started.items() if not isinstance(q, ConfigurationError)}
        for query in queries.values():
            query.stop()
        assert len(queries) == 1, f"try {attempt}: {started}"
        ((winner, _),) = queries.items()
        assert "belongs to checkpointLocation" in str(started[1 - winner])
        winners.append(winner)

    query = writer("one-0", winners[0]).start()
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    out = tmp_path / f"out-one-0-{winners[0]}"
    written = sorted(tuple(row) for row in spark.read.parquet(str(out)).collect())
    assert written == expected_totals(batches)


class CountsByX(StatefulProcessor):
    """Rows per double key `x` so far, once per call: (x, rows of this call, count)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "count long")

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        seen = len(list(rows))
        count = (self.count.get() or (0,))[0] + seen
        self.count.update((count,))
        yield Row(x=key[0], rows=seen, count=count)

    def close(self) -> None:
        pass


def test_nan_keys_are_one_key_as_spark_groups_them(spark: SparkSession) -> None:
    """NaN keys of any bit pattern are one key, in one call per batch, over batches, as
    Spark's groupBy groups them (-0.0 and 0.0 too). Before, every NaN row was a key of
    its own within a batch, and each bit pattern kept a state of its own."""
    other_nan = struct.unpack(">d", (0x7FF8000000000001).to_bytes(8, "big"))[0]
    negative_nan = struct.unpack(">d", (0xFFF8000000000000).to_bytes(8, "big"))[0]
    batches = [
        [float("nan"), 1.0, other_nan, -0.0, negative_nan],
        [other_nan, 0.0, float("nan")],
    ]
    expected, counts = [], Counter[str]()
    for batch in batches:  # plain Python: every NaN one key, -0.0 the key 0.0
        names = [("nan" if x != x else repr(abs(x))) for x in batch]
        calls = []
        for name in sorted(set(names)):
            counts[name] += names.count(name)
            calls.append((name, names.count(name), counts[name]))
        expected.append(sorted(calls))
    for batch in batches:
        events = spark.createDataFrame([(x,) for x in batch], "x double")
        stateful = transform_with_state(
            events, "x", CountsByX(), "x double, rows long, count long", "nan-keys"
        )
        found = sorted(
            ("nan" if row.x != row.x else repr(row.x), row.rows, row["count"])
            for row in stateful.toDF().collect()
        )
        assert found == expected.pop(0)


def test_batch_dataframe_is_one_batch_with_initial_state(
    spark: SparkSession, events: DataFrame
) -> None:
    initial = spark.createDataFrame([("a", 100), ("c", 5), ("z", 1)], "user string, start long")
    stateful = transform_with_state(
        events, ["user"], Totals(), OUTPUT, "batch", initial_state=initial.groupBy("user")
    )
    with pytest.raises(
        ConfigurationError,
        match=r"^transform_with_state of a batch DataFrame has no \.write: run the batch with "
        r"toDF\(\) and write its result \(stateful\.toDF\(\)\.write\.\.\.\)$",
    ):
        stateful.write  # noqa: B018
    # .write ran no batch: toDF's is batch 0, with the initial state.
    first = sorted(tuple(row) for row in stateful.toDF().collect())
    starts = {"a": 100, "c": 5, "z": 1}
    totals: dict[str, int] = defaultdict(int)
    for user, amount, _ in [tuple(r) for r in events.collect()]:
        totals[user] += amount
    assert first == sorted((u, starts.get(u, 0) + t) for u, t in totals.items())
    second = sorted(tuple(row) for row in stateful.toDF().collect())  # batch 1: no initial
    assert second == sorted((u, starts.get(u, 0) + 2 * t) for u, t in totals.items())
    with pytest.raises(ConfigurationError, match="streaming DataFrame"):
        stateful.writeStream  # noqa: B018


def test_control_rows_are_one_partition_built_once_per_jvm_session(
    spark: SparkSession,
) -> None:
    """foreachBatch wraps the stream's JVM session in a new Python session every batch:
    the control rows are not rebuilt for it (~100 py4j calls), and take one task."""
    schema = spark.createDataFrame([], "user string, amount long").schema
    keyed = KeyedBatches()
    control = keyed.control_rows(spark, schema, 3)
    wrapper = SparkSession(spark.sparkContext, spark._jsparkSession)
    assert keyed.control_rows(wrapper, schema, 3) is control
    assert control.rdd.getNumPartitions() == 1
    assert sorted(row[SUBTASK_COLUMN] for row in control.collect()) == [0, 1, 2]
    assert keyed.control_rows(spark.newSession(), schema, 3) is not control


def test_write_stream_to_parquet(spark: SparkSession, tmp_path: Path) -> None:
    batches = [
        [{"user": "a", "amount": 1}, {"user": "b", "amount": 2}],
        [{"user": "a", "amount": 5}],
    ]
    write_batches(tmp_path / "input", batches)
    source = batch_files(spark, tmp_path / "input")
    out = tmp_path / "out"
    stateful = transform_with_state(source, "user", Totals(), OUTPUT, "sink")
    with pytest.raises(ConfigurationError, match=r"has no \.write: use writeStream$"):
        stateful.write  # noqa: B018
    writer = stateful.writeStream
    with pytest.raises(ConfigurationError, match="no checkpointLocation"):
        writer.format("parquet").option("path", str(out)).start()
    query = (
        writer.format("parquet")
        .options(path=str(out), checkpointLocation=str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .queryName("stateful_sink")
        .start()
    )
    query.awaitTermination()
    written = sorted(tuple(row) for row in spark.read.parquet(str(out)).collect())
    assert written == [("a", 1), ("a", 6), ("b", 2)]


def test_trigger_takes_one_kind_as_sparks_writer_does(spark: SparkSession, tmp_path: Path) -> None:
    """trigger() takes exactly one kind, a keyword given as None not counting, as Spark's
    own DataStreamWriter.trigger: none or two is one clear error; once=True beside
    continuous=None runs once; availableNow=True beside processingTime=None ends the
    query, so it cannot tick."""
    batches = [
        [{"user": "a", "amount": 1}, {"user": "b", "amount": 2}],
        [{"user": "a", "amount": 5}],
    ]
    write_batches(tmp_path / "input", batches)
    source = batch_files(spark, tmp_path / "input")

    def writer(job_id: str) -> Any:
        stateful = transform_with_state(source, "user", Totals(), OUTPUT, job_id)
        return stateful.writeStream.format("parquet").options(
            path=str(tmp_path / job_id), checkpointLocation=str(tmp_path / f"ckpt-{job_id}")
        )

    for kinds in ({}, {"once": True, "availableNow": True}, {"processingTime": None}):
        with pytest.raises(PySparkValueError, match="ONLY_ALLOW_SINGLE_TRIGGER"):
            source.writeStream.trigger(**kinds)
        with pytest.raises(ConfigurationError, match=r"is invalid: give exactly one of"):
            writer("none").trigger(**kinds)

    source.writeStream.trigger(continuous=None, once=True)  # Spark's: a trigger once
    query = writer("once").trigger(continuous=None, once=True).start()
    query.awaitTermination()
    written = sorted(tuple(row) for row in spark.read.parquet(str(tmp_path / "once")).collect())
    assert written == expected_totals([[row for batch in batches for row in batch]])

    tick_interval = "spark.statebackend.streaming.tick-interval"
    spark.conf.set(tick_interval, "1")
    try:
        ticking = writer("ticking").trigger(processingTime=None, availableNow=True)
        with pytest.raises(ConfigurationError, match=r"ends the query, so .*tick-interval"):
            ticking.start()
    finally:
        spark.conf.unset(tick_interval)


def expected_totals(batches: list[list[dict[str, Any]]]) -> list[tuple[str, int]]:
    """Per batch, each user of the batch with the running total of its non-negative
    amounts after it (Update mode's output of ``Fragile("fixed")`` and
    ``Stalling(None)``), in plain Python, sorted."""
    totals: dict[str, int] = defaultdict(int)
    expected = []
    for batch in batches:
        for user in sorted({r["user"] for r in batch}):
            totals[user] += sum(
                r["amount"] for r in batch if r["user"] == user and r["amount"] >= 0
            )
            expected.append((user, totals[user]))
    return sorted(expected)


class Fragile(Totals):
    """Totals that, on a negative amount, raises (mode "raise"), returns a row without
    the output schema's ``total`` (mode "misfit"), or skips the amount (mode "fixed")."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        amounts = [row.amount for row in rows]
        if min(amounts) < 0 and self.mode == "raise":
            raise ValueError("negative amount")
        if min(amounts) < 0 and self.mode == "misfit":
            yield Row(user=key[0])
            return
        yield Row(user=key[0], total=self._add(sum(a for a in amounts if a >= 0)))


def test_failing_processor_is_one_clear_error_and_a_fixed_one_continues_exactly(
    spark: SparkSession, tmp_path: Path
) -> None:
    batches = [
        [{"user": "a", "amount": 1}, {"user": "b", "amount": 2}],
        [{"user": "a", "amount": -5}, {"user": "c", "amount": 3}],
        [{"user": "a", "amount": 4}],
    ]
    write_batches(tmp_path / "input", batches)
    out = tmp_path / "out"

    def run(mode: str) -> None:
        source = batch_files(spark, tmp_path / "input")
        query = (
            transform_with_state(source, "user", Fragile(mode), OUTPUT, "fragile")
            .writeStream.format("parquet")
            .options(path=str(out), checkpointLocation=str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    with pytest.raises(
        Exception,
        match="processor Fragile.handleInputRows raised ValueError: negative amount in batch 1",
    ):
        run("raise")
    with pytest.raises(Exception, match="output row .* has no column 'total'"):
        run("misfit")
    run("fixed")
    written = sorted(tuple(row) for row in spark.read.parquet(str(out)).collect())
    assert written == expected_totals(batches)


def test_a_job_is_either_a_queries_state_or_run_by_to_df_not_both(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A stream on a job that toDF() ran batches of is refused at start (its batch 0
    would be taken for a re-run of toDF's batch 0, and skipped), and toDF() on a
    stream's job is refused (the stream would skip its next batch): one error each,
    naming the job, and the state is left as it was."""
    backfill = spark.createDataFrame([("a", 100)], "user string, amount long")
    ran = transform_with_state(backfill, "user", Totals(), OUTPUT, "backfilled").toDF()
    assert [tuple(row) for row in ran.collect()] == [("a", 100)]
    write_batches(tmp_path / "input", [[{"user": "a", "amount": 1}]])

    def stream(job_id: str) -> Any:
        return (
            transform_with_state(
                batch_files(spark, tmp_path / "input"), "user", Totals(), OUTPUT, job_id
            )
            .writeStream.format("parquet")
            .options(
                path=str(tmp_path / job_id), checkpointLocation=str(tmp_path / f"{job_id}-ckpt")
            )
            .trigger(availableNow=True)
        )

    with pytest.raises(
        ConfigurationError, match="'backfilled' .* has committed batches 0..0 but is bound to no"
    ):
        stream("backfilled").start()
    stream("streamed").start().awaitTermination()
    assert [tuple(r) for r in spark.read.parquet(str(tmp_path / "streamed")).collect()] == [
        ("a", 1)
    ]
    with pytest.raises(ConfigurationError, match="'streamed' is the state of a streaming query"):
        transform_with_state(backfill, "user", Totals(), OUTPUT, "streamed").toDF()


class RaisesIn(Totals):
    """``Totals`` that registers a timer due at once per key and raises ValueError in
    ``method``; ``init`` and ``close`` raise on the driver if ``on_driver``, else on
    executors only (where ``TaskContext.get()`` is set)."""

    def __init__(self, method: str, on_driver: bool = False) -> None:
        self.method, self.on_driver = method, on_driver

    def _fail(self, method: str) -> None:
        if method == self.method and (self.on_driver or TaskContext.get() is not None):
            raise ValueError(f"fails in {method}")

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        super().init(handle)
        self._fail("init")

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs())
        self._fail("handleInputRows")
        yield from super().handleInputRows(key, rows, timerValues)

    def handleInitialState(self, key: Any, initialState: Row, timerValues: TimerValues) -> None:
        self._fail("handleInitialState")
        super().handleInitialState(key, initialState, timerValues)

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Row]:
        self._fail("handleExpiredTimer")
        return iter(())

    def close(self) -> None:
        self._fail("close")


@pytest.mark.parametrize("method", ["init", "close"])
def test_a_processor_raising_on_the_driver_is_one_error_naming_its_method_before_any_batch(
    events: DataFrame, method: str
) -> None:
    with pytest.raises(
        ProcessorFailedError,
        match=rf"^processor RaisesIn\.{method} raised ValueError: fails in {method} on the "
        r"driver, [^\n]*: fix the processor$",
    ):
        transform_with_state(
            events, "user", RaisesIn(method, on_driver=True), OUTPUT, "broken", time_mode="None"
        )


@pytest.mark.parametrize(
    "method", ["init", "handleInitialState", "handleInputRows", "handleExpiredTimer", "close"]
)
def test_a_processor_raising_in_a_batch_is_one_error_naming_its_method(
    spark: SparkSession, events: DataFrame, method: str
) -> None:
    initial = spark.createDataFrame([("a", 100)], "user string, start long")
    stateful = transform_with_state(
        events,
        "user",
        RaisesIn(method),
        OUTPUT,
        f"raises-{method}",
        time_mode="ProcessingTime",
        initial_state=initial,
    )
    with pytest.raises(Exception) as raised:
        stateful.toDF()
    line = next(line for line in str(raised.value).splitlines() if "ProcessorFailedError" in line)
    assert re.search(
        rf"ProcessorFailedError: processor RaisesIn\.{method} raised ValueError: fails in "
        rf"{method} in batch 0 \(keyed subtask \d\); the batch is not committed: ",
        line,
    ), line


class TotalsAs(Totals):
    """``Totals`` with its state declared another way: ``kind`` "value" or "list" with
    ``schema``, after ``deleteIfExists("total")`` if ``delete_first``."""

    def __init__(self, kind: str, schema: str, delete_first: bool = False) -> None:
        self.kind, self.schema, self.delete_first = kind, schema, delete_first

    def init(self, handle: StatefulProcessorHandle) -> None:
        if self.delete_first:
            handle.deleteIfExists("total")
        declare = handle.getValueState if self.kind == "value" else handle.getListState
        self.total = declare("total", self.schema)


def test_a_restart_with_a_changed_state_schema_is_refused_before_any_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A state declared with another schema or kind than its stored state, also after
    ``deleteIfExists``: one error naming the state and both schemas, raised by
    ``transform_with_state``; the state is intact, and the unchanged processor
    continues."""
    batches = [[{"user": "a", "amount": 1}], [{"user": "a", "amount": 2}]]
    write_batches(tmp_path / "input", batches)
    source = batch_files(spark, tmp_path / "input")
    out = tmp_path / "out"

    def run(processor: StatefulProcessor) -> None:
        query = (
            transform_with_state(source, "user", processor, OUTPUT, "schemas")
            .writeStream.format("parquet")
            .options(path=str(out), checkpointLocation=str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    run(Totals())
    write_batches(tmp_path / "input", [[{"user": "a", "amount": 4}]], first=len(batches))
    for processor, message in (
        (
            TotalsAs("value", "total string"),
            r"'total' was written as RowTupleSerializer\(total long\), which .*\(total string\)",
        ),
        (TotalsAs("value", "total long, n long not null"), r"state 'total' was written as"),
        (TotalsAs("list", "total long"), r"stored as value state and cannot be read as list"),
        # deleteIfExists clears the values, not the stored schema (as the executors do)
        (TotalsAs("value", "total string", delete_first=True), r"'total' was written as"),
    ):
        with pytest.raises(IncompatibleStateError, match=message):
            transform_with_state(source, "user", processor, OUTPUT, "schemas")
    run(Totals())
    written = sorted(tuple(row) for row in spark.read.parquet(str(out)).collect())
    assert written == [("a", 1), ("a", 3), ("a", 7)]


class AmountsSeen(Totals):
    """``Totals`` and how many distinct amounts each user paid (a map state keyed by the
    amount), declared with ``total_schema`` and the user-key schema ``amount_schema``."""

    def __init__(self, total_schema: str, amount_schema: str) -> None:
        self.total_schema, self.amount_schema = total_schema, amount_schema

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.total = handle.getValueState("total", self.total_schema)
        self.seen = handle.getMapState("seen", self.amount_schema, "times long")

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        amounts = [row.amount for row in rows]
        for amount in amounts:
            times = self.seen.getValue((amount,)) if self.seen.containsKey((amount,)) else None
            self.seen.updateValue((amount,), ((times[0] if times else 0) + 1,))
        total = self._add(sum(amounts))
        yield Row(user=key[0], total=total, amounts=len(list(self.seen.keys())))


def test_a_restart_with_renamed_or_not_null_state_fields_keeps_the_state(
    spark: SparkSession, tmp_path: Path
) -> None:
    """As Spark's check of a state's schema on restart (its rows are positional): a value
    field or a map's user-key field renamed, or a field made not nullable, reads the
    stored state as it is."""
    batches = [[{"user": "a", "amount": 1}], [{"user": "a", "amount": 2}]]
    later = [[{"user": "a", "amount": 2}], [{"user": "a", "amount": 4}]]
    write_batches(tmp_path / "input", batches)
    source = batch_files(spark, tmp_path / "input")
    out = tmp_path / "out"

    def run(processor: StatefulProcessor) -> None:
        stateful = transform_with_state(
            source, "user", processor, "user string, total long, amounts long", "renamed"
        )
        query = (
            stateful.writeStream.format("parquet")
            .options(path=str(out), checkpointLocation=str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    run(AmountsSeen("total long", "amount long"))
    write_batches(tmp_path / "input", later, first=len(batches))
    run(AmountsSeen("sum long not null", "paid long"))
    expected, total, seen = [], 0, set()
    for batch in batches + later:
        for row in batch:
            total += row["amount"]
            seen.add(row["amount"])
            expected.append((row["user"], total, len(seen)))
    written = sorted(tuple(row) for row in spark.read.parquet(str(out)).collect())
    assert written == sorted(expected)


class Evolving(StatefulProcessor):
    """Per user: value state ``stats`` (total, last amount) and list state ``seen`` of the
    amounts; ``evolved``: ``stats`` as (total long, count long) and ``seen`` as (amount int,
    note string), fields added, removed and widened. Outputs the total, the count kept
    since the change, and how many amounts and notes ``seen`` holds."""

    def __init__(self, evolved: bool) -> None:
        self.evolved = evolved

    def init(self, handle: StatefulProcessorHandle) -> None:
        if self.evolved:
            self.stats = handle.getValueState("stats", "total long, count long")
            self.seen = handle.getListState("seen", "amount int, note string")
        else:
            self.stats = handle.getValueState("stats", "total int, last string")
            self.seen = handle.getListState("seen", "amount int")

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        amounts = [row.amount for row in rows]
        before = self.stats.get()
        total = (before[0] if before else 0) + sum(amounts)
        count = None
        if self.evolved:
            count = (before[1] or 0 if before else 0) + len(amounts)
            self.stats.update((total, count))
            self.seen.put([*self.seen.get(), *((amount % 1000, "new") for amount in amounts)])
        else:
            self.stats.update((total, str(amounts[-1])))
            self.seen.put([*self.seen.get(), *((amount,) for amount in amounts)])
        seen = list(self.seen.get())
        notes = sum(1 for element in seen if self.evolved and element[1] is not None)
        yield Row(user=key[0], total=total, count=count, seen=len(seen), notes=notes)

    def close(self) -> None:
        pass


def test_a_restart_with_fields_added_removed_or_widened_migrates_the_state(
    spark: SparkSession, tmp_path: Path
) -> None:
    """As Spark with Avro state encoding: a state's nullable field added reads None, a
    field removed is dropped, an int widened to long keeps its value; a later restart at
    another parallelism rebuilds the migrated state from storage."""
    batches = [
        [{"user": "a", "amount": 1}, {"user": "b", "amount": 5}],
        [{"user": "a", "amount": 2}],
    ]
    later = [
        [{"user": "a", "amount": 2**33}],
        [{"user": "b", "amount": 1}, {"user": "a", "amount": 3}],
    ]
    last = [[{"user": "a", "amount": 4}, {"user": "b", "amount": 2}]]
    out = tmp_path / "out"
    output = "user string, total long, count long, seen long, notes long"

    def run(processor: StatefulProcessor, parallelism: int) -> None:
        source = batch_files(spark, tmp_path / "input")
        query = (
            transform_with_state(
                source, "user", processor, output, "evolved", parallelism=parallelism
            )
            .writeStream.format("parquet")
            .options(path=str(out), checkpointLocation=str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    write_batches(tmp_path / "input", batches)
    run(Evolving(evolved=False), 2)
    write_batches(tmp_path / "input", later, first=len(batches))
    run(Evolving(evolved=True), 2)
    write_batches(tmp_path / "input", last, first=len(batches) + len(later))
    run(Evolving(evolved=True), 3)
    expected = []
    totals, counts, seen, notes = Counter[str](), Counter[str](), Counter[str](), Counter[str]()
    for number, batch in enumerate(batches + later + last):
        evolved = number >= len(batches)
        for row in batch:
            user = row["user"]
            totals[user] += row["amount"]
            seen[user] += 1
            if evolved:
                counts[user] += 1
                notes[user] += 1
            count = counts[user] if evolved else None
            expected.append((user, totals[user], count, seen[user], notes[user]))
    written = sorted(tuple(row) for row in spark.read.parquet(str(out)).collect())
    assert written == sorted(expected)


def test_a_restart_with_the_key_column_renamed_keeps_the_state(
    spark: SparkSession, tmp_path: Path
) -> None:
    """As in Spark, a key column renamed (same type) keys the stored state as before; a key
    of another type is still refused (test_a_restart_keeps_time_mode_output_mode_and_key)."""
    batches = [[{"user": "a", "amount": 1}, {"user": "b", "amount": 5}]]
    batches.append([{"user": "a", "amount": 2}])
    later = [[{"user": "a", "amount": 4}, {"user": "b", "amount": 1}]]
    write_batches(tmp_path / "input", batches)
    out = tmp_path / "out"

    def run(key: str) -> None:
        source = batch_files(spark, tmp_path / "input").withColumnRenamed("user", key)
        query = (
            transform_with_state(source, key, Totals(), OUTPUT, "renamed-key")
            .writeStream.format("parquet")
            .options(path=str(out), checkpointLocation=str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    run("user")
    write_batches(tmp_path / "input", later, first=len(batches))
    run("customer")
    expected, totals = [], Counter[str]()
    for batch in batches + later:
        for row in batch:
            totals[row["user"]] += row["amount"]
            expected.append((row["user"], totals[row["user"]]))
    written = sorted(tuple(row) for row in spark.read.parquet(str(out)).collect())
    assert written == sorted(expected)


def test_non_replayable_source_is_one_clear_error(spark: SparkSession) -> None:
    socket = spark.readStream.format("socket").option("host", "127.0.0.1").option("port", 9).load()
    with pytest.raises(ConfigurationError, match="source 'socket' cannot replay a batch"):
        transform_with_state(socket, "value", Totals(), OUTPUT, "socket")


class Stalling(Totals):
    """Totals over the non-negative amounts; with a ``marker`` path, a key with a negative
    amount creates the file and stalls its keyed task for two minutes."""

    def __init__(self, marker: str | None) -> None:
        self.marker = marker

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        amounts = [row.amount for row in rows]
        if self.marker is not None and min(amounts) < 0:
            Path(self.marker).touch()
            time.sleep(120)
        yield Row(user=key[0], total=self._add(sum(a for a in amounts if a >= 0)))


def _wait_for(condition: Any, what: str, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_stop_during_a_batch_cancels_its_job_and_the_batch_runs_again_on_restart(
    spark: SparkSession, tmp_path: Path
) -> None:
    """stop() while batch 1's keyed job runs: the query ends as stopped (no exception),
    the job is cancelled with it (none of ours keeps running), and the restarted query
    runs batch 1 again: every output row once."""
    batches = [
        [{"user": "a", "amount": 1}, {"user": "b", "amount": 2}],
        [{"user": "a", "amount": -1}, {"user": "c", "amount": 3}],
        [{"user": "a", "amount": 4}],
    ]
    write_batches(tmp_path / "input", batches)
    out, marker = tmp_path / "out", tmp_path / "stalled"

    def start(processor: Stalling) -> Any:
        source = batch_files(spark, tmp_path / "input")
        return (
            transform_with_state(source, "user", processor, OUTPUT, "stopped")
            .writeStream.format("parquet")
            .options(path=str(out), checkpointLocation=str(tmp_path / "ckpt"))
            .start()
        )

    query = start(Stalling(str(marker)))
    _wait_for(marker.exists, "batch 1's keyed task")
    query.stop()
    assert query.exception() is None
    tracker = spark.sparkContext.statusTracker()
    _wait_for(lambda: not tracker.getActiveJobsIds(), "the stopped batch's job to end", 30)

    restarted = start(Stalling(None))
    _wait_for(lambda: restarted.lastProgress and restarted.lastProgress["batchId"] >= 2, "batch 2")
    restarted.stop()
    written = sorted(tuple(row) for row in spark.read.parquet(str(out)).collect())
    assert written == expected_totals(batches)


def test_a_batch_interrupted_by_stop_reads_as_a_stop_to_spark(spark: SparkSession) -> None:
    """Spark takes a foreachBatch error for the query's stop only if its regex
    ``StreamExecution.PROXY_ERROR`` finds an interruption in the Python traceback; ours
    is short and matches (a Java stack trace there overflows the regex's stack)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    try:
        jvm.java.lang.Thread.currentThread().interrupt()
        jvm.java.lang.Thread.sleep(60_000)
    except Py4JJavaError as exc:
        interrupted = exc
    stopped = stop_interruption(RuntimeError("publishing failed"), 4, None)
    assert stopped is None
    try:
        try:
            raise RuntimeError("publishing failed") from interrupted
        except RuntimeError as exc:
            stopped = stop_interruption(exc, 4, None)
            assert stopped is not None
            raise stopped from None
    except Exception:
        sent = (
            "An exception was raised by the Python Proxy. Return Message: " + traceback.format_exc()
        )
    assert "batch 4 was interrupted by the query's stop()" in sent
    assert len(sent) < 1000
    proxy_error = jvm.org.apache.spark.sql.execution.streaming.runtime.StreamExecution.PROXY_ERROR()
    assert proxy_error.findFirstIn(sent).isDefined()


class KeysSeen(KeyedFunction):
    """A KeyedFunction that outputs the key it was given, as its repr."""

    def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Iterator[Any]:
        yield {"key": repr(key), "rows": len(values)}


def test_a_keyed_function_gets_its_key_as_stateful_job_gives_it(spark: SparkSession) -> None:
    """The package's example KeyedFunction (``UserTotals``, written for StatefulJob) runs
    unchanged: with ``key_by`` one column name its ``process`` gets the column's value, as
    in StatefulJob (it got the tuple ``("u1",)`` and failed the ``user string`` column);
    with a list of names it gets the tuple."""
    events = [(f"u{n % 7}", n, CATEGORIES[n % len(CATEGORIES)]) for n in range(60)]
    df = spark.createDataFrame(events, "user string, amount long, category string")
    stateful = transform_with_state(
        df, "user", UserTotals(), "user string, count long, total long", "example-function"
    )
    expected: dict[str, tuple[int, int]] = {}
    for user, amount, _ in events:
        count, total = expected.get(user, (0, 0))
        expected[user] = (count + 1, total + amount)
    found = {row.user: (row["count"], row.total) for row in stateful.toDF().collect()}
    assert found == expected
    by_list = transform_with_state(df, ["user"], KeysSeen(), "key string, rows long", "keys-list")
    assert {row.key: row.rows for row in by_list.toDF().collect()} == {
        repr((user,)): count for user, (count, _) in expected.items()
    }
