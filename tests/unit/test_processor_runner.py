"""run_keyed_subtask: a StatefulProcessor over one subtask's Arrow batches, without a
JVM, over the heap and RocksDB backends, compared with plain-Python computations."""

from __future__ import annotations

import datetime
import gc
import math
import pickle
import random
from collections import Counter, defaultdict
from collections.abc import Iterator
from decimal import Decimal
from itertools import groupby
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql import Row
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from pyspark.sql.types import (
    ArrayType,
    DateType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.errors import OutputSchemaError, SerializationError
from statebackend.keygroups import KeyGroupRange, assign_to_key_group
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.api import KeyedContext, KeyedFunction
from statebackend.spark.arrow_path import sorted_by_key
from statebackend.spark.pandas_times import pandas_frame
from statebackend.spark.processor_handle import BatchClock, BatchTimes, SchemaCatalog
from statebackend.spark.processor_runner import (
    CONTROL,
    INITIAL,
    INITIAL_PREFIX,
    INPUT,
    KEY_GROUP_COLUMN,
    KIND_COLUMN,
    SEQUENCE_COLUMN,
    SUBTASK_COLUMN,
    YOUNG_COLLECTION_OBJECTS,
    KeyedFunctionProcessor,
    OutputBuilder,
    ProcessorSpec,
    _key_values,
    _read_ahead_of,
    _row_maker,
    _run_starts,
    _shown_key,
    checkpointed_part,
    run_keyed_subtask,
)
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.functions import (
    FunctionInitializationContext,
    FunctionSnapshotContext,
    ListCheckpointedAdapter,
)
from statebackend.state.ttl import StateTtlConfig
from tests.unit.stateful_processors import (
    KEY_SCHEMA,
    MAX_PARALLELISM,
    make_backend,
)

OUTPUT = StructType([StructField("user", StringType()), StructField("total", LongType())])
TOTAL = StructType([StructField("total", LongType())])


class RowTotals(StatefulProcessor):
    """Running total of `amount` per user (Row mode); emits (user, total) per batch."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.total = handle.getValueState("total", TOTAL)

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        current = self.total.get()
        total = (current[0] if current else 0) + sum(row.amount for row in rows)
        self.total.update((total,))
        yield Row(user=key[0], total=total)

    def handleInitialState(self, key: Any, initialState: Any, timerValues: TimerValues) -> None:
        current = self.total.get()
        self.total.update(((current[0] if current else 0) + initialState.start,))


class PandasTotals(StatefulProcessor):
    """The same in pandas mode."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.total = handle.getValueState("total", TOTAL)

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        current = self.total.get()
        total = (current[0] if current else 0) + sum(int(df["amount"].sum()) for df in rows)
        self.total.update((total,))
        yield pd.DataFrame({"user": [key[0]], "total": [total]})


class TimerEcho(StatefulProcessor):
    """Registers a timer at (batch time + amount) per row; a fired timer emits its key and
    expiry, so the firing order is visible."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        for row in rows:
            self.handle.registerTimer(timerValues.getCurrentProcessingTimeInMs() + row.amount)
        return iter(())

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Row]:
        yield Row(user=key[0], total=expiredTimerInfo.getExpiryTimeInMs())


class Totals(KeyedFunction):
    """Our KeyedFunction doing the same running total."""

    def open(self, ctx: KeyedContext) -> None:
        self.total = ctx.get_state(ValueStateDescriptor("total"))

    def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Iterator[Any]:
        total = (self.total.value() or 0) + sum(row.amount for row in values)
        self.total.update(total)
        yield (key[0], total)


def _spec(processor: StatefulProcessor, **overrides: Any) -> ProcessorSpec:
    options: dict[str, Any] = {
        "processor": processor,
        "use_pandas": False,
        "time_mode": "None",
        "key_columns": ("user",),
        "input_columns": ("user", "amount"),
        "initial_columns": (),
        "output_schema_json": OUTPUT.json(),
        "catalog": SchemaCatalog(),
    }
    options.update(overrides)
    return ProcessorSpec(**options)


def _batches(
    rows: list[tuple[str, int]],
    initial: list[tuple[str, int]] = (),  # type: ignore[assignment]
    batch_rows: int = 7,
) -> list[pa.RecordBatch]:
    """Rows as the Spark side hands them to a subtask: control row first, then sorted by
    (key group, key, kind, arrival)."""
    serializer = RowTupleSerializer(KEY_SCHEMA.json())
    records = [(-1, None, CONTROL, 0, None, None)]
    for seq, (user, amount) in enumerate(rows):
        group = assign_to_key_group(serializer.serialize((user,)), MAX_PARALLELISM)
        records.append((group, user, INPUT, seq, amount, None))
    for seq, (user, start) in enumerate(initial):
        group = assign_to_key_group(serializer.serialize((user,)), MAX_PARALLELISM)
        records.append((group, user, INITIAL, seq, None, start))
    records.sort(key=lambda r: (r[0], r[1] or "", r[2], r[3]))
    table = pa.table(
        {
            "user": [r[1] for r in records],
            "amount": pa.array([r[4] for r in records], pa.int64()),
            INITIAL_PREFIX + "user": [r[1] if r[2] == INITIAL else None for r in records],
            INITIAL_PREFIX + "start": pa.array([r[5] for r in records], pa.int64()),
            KIND_COLUMN: pa.array([r[2] for r in records], pa.int8()),
            SEQUENCE_COLUMN: pa.array([r[3] for r in records], pa.int64()),
            KEY_GROUP_COLUMN: pa.array([r[0] for r in records], pa.int32()),
            SUBTASK_COLUMN: pa.array([0] * len(records), pa.int32()),
        }
    )
    return table.to_batches(max_chunksize=batch_rows)


def _rows(batches: Iterator[pa.RecordBatch]) -> list[tuple[Any, ...]]:
    table = pa.Table.from_batches(list(batches), schema=to_arrow_schema(OUTPUT))
    return list(zip(*table.to_pydict().values(), strict=True))


@pytest.fixture(params=["heap", "rocksdb"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KeyedStateBackend]:
    backend = make_backend(str(request.param), tmp_path / "db", BatchClock(0))
    yield backend
    backend.dispose()


def _random_batches(seed: int) -> list[list[tuple[str, int]]]:
    rng = random.Random(seed)
    users = [f"u{i}" for i in range(12)]
    return [
        [(rng.choice(users), rng.randrange(100)) for _ in range(rng.randrange(0, 40))]
        for _ in range(4)
    ]


@pytest.mark.parametrize(
    ("processor", "use_pandas"),
    [(RowTotals(), False), (PandasTotals(), True), (KeyedFunctionProcessor(Totals()), False)],
)
def test_running_totals_match_plain_python(
    backend: KeyedStateBackend, processor: StatefulProcessor, use_pandas: bool
) -> None:
    spec = _spec(processor, use_pandas=use_pandas)
    totals: Counter[str] = Counter()
    for batch_rows in _random_batches(3):
        output = _rows(run_keyed_subtask(spec, backend, BatchTimes(0), _batches(batch_rows)))
        expected = {}
        for user, amount in batch_rows:
            totals[user] += amount
            expected[user] = totals[user]
        assert sorted(output) == sorted(expected.items())


class RowRecorder(StatefulProcessor):
    """Keeps every (key, Row) it is given and echoes the rows as they came."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.seen: list[tuple[Any, Row]] = []

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        for row in rows:
            self.seen.append((key, row))
            yield Row(user=row.user, total=row["amount"])


def test_rows_are_spark_rows_of_the_input_columns(backend: KeyedStateBackend) -> None:
    """Rows spanning several Arrow batches reach the processor as ``Row``s like
    ``Row(user=..., amount=...)``, grouped by key, each key's in arrival order."""
    processor = RowRecorder()
    rows = [(f"u{i % 5}", i) for i in range(40)]
    output = _rows(run_keyed_subtask(_spec(processor), backend, BatchTimes(0), _batches(rows)))
    by_key: dict[str, list[int]] = defaultdict(list)
    for user, amount in rows:
        by_key[user].append(amount)
    assert sorted(output) == sorted(rows)
    for key, row in processor.seen:
        assert isinstance(row, Row) and row == Row(user=key[0], amount=row[1])
        assert row.asDict() == {"user": key[0], "amount": row[1]}
        assert list(row.__fields__) == ["user", "amount"]
        assert pickle.loads(pickle.dumps(row)).asDict() == row.asDict()
    seen_keys = [key for key, _ in processor.seen]
    assert [k for k, _ in groupby(seen_keys)] == list(dict.fromkeys(seen_keys))
    for user, amounts in by_key.items():
        assert [row.amount for key, row in processor.seen if key == (user,)] == amounts


def test_initial_state_runs_once_per_row_before_input(backend: KeyedStateBackend) -> None:
    spec = _spec(RowTotals(), initial_columns=("user", "start"))
    rows = [("a", 1), ("b", 2), ("a", 3)]
    initial = [("a", 100), ("a", 1000), ("c", 7)]
    output = _rows(run_keyed_subtask(spec, backend, BatchTimes(0), _batches(rows, initial)))
    assert sorted(output) == [("a", 1104), ("b", 2)]  # c has no input rows: no output
    later = _rows(run_keyed_subtask(spec, backend, BatchTimes(0), _batches([("c", 1)])))
    assert later == [("c", 8)]


def test_timers_fire_after_input_in_expiry_order(backend: KeyedStateBackend) -> None:
    timers = backend.timer_service
    spec = _spec(TimerEcho(), time_mode="ProcessingTime")
    rows = [("a", 30), ("b", 10), ("a", 5), ("c", 500)]
    first = _rows(run_keyed_subtask(spec, backend, BatchTimes(1000), _batches(rows), timers))
    assert first == []  # nothing due at 1000
    second = _rows(run_keyed_subtask(spec, backend, BatchTimes(1040), _batches([]), timers))
    assert second == [("a", 1005), ("b", 1010), ("a", 1030)]
    third = _rows(run_keyed_subtask(spec, backend, BatchTimes(2000), _batches([]), timers))
    assert third == [("c", 1500)]


class TimerLister(TimerEcho):
    """Timers at batch time + amount (as ``TimerEcho``); a fired timer re-registers itself
    (a no-op, as in Spark), emits how many timers its key lists, then deletes the timer at
    + 1000."""

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Row]:
        expiry = expiredTimerInfo.getExpiryTimeInMs()
        self.handle.registerTimer(expiry)
        yield Row(user=key[0], total=len(list(self.handle.listTimers())))
        self.handle.deleteTimer(expiry + 1000)


def test_a_firing_timer_is_listed_until_its_handler_returns(backend: KeyedStateBackend) -> None:
    timers = backend.timer_service
    spec = _spec(TimerLister(), time_mode="ProcessingTime")
    rows = [("a", 10), ("a", 20), ("a", 1020), ("b", 10)]
    output = _rows(run_keyed_subtask(spec, backend, BatchTimes(1000), _batches(rows), timers))
    assert output == []
    output = _rows(run_keyed_subtask(spec, backend, BatchTimes(5000), _batches([]), timers))
    # a: 1010 fires with {1010, 1020, 2020} listed and deletes 2010 (none); 1020 fires
    # with {1020, 2020} and deletes 2020, which still fires, as in Spark (due when the
    # timers began to fire), listing only itself; b: 1010 alone. Nothing fires twice.
    assert sorted(output) == [("a", 1), ("a", 2), ("a", 3), ("b", 1)]
    backend.set_current_key(("a",))
    assert list(timers.processing_time_timers()) == []


class TimerRearm(TimerEcho):
    """A fired timer registers another one second later, already due when the batch's
    time is more than a second past it."""

    def handleExpiredTimer(
        self, key: Any, timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[Row]:
        expiry = expiredTimerInfo.getExpiryTimeInMs()
        self.handle.registerTimer(expiry + 1000)
        yield Row(user=key[0], total=expiry)


def test_a_timer_registered_while_timers_fire_waits_for_the_next_batch(
    backend: KeyedStateBackend,
) -> None:
    """As Spark's transformWithState: a batch fires the timers due when its timer phase
    begins; a handler's new timer fires in a later batch even when it is already due."""
    timers = backend.timer_service
    spec = _spec(TimerRearm(), time_mode="ProcessingTime")
    run = run_keyed_subtask(spec, backend, BatchTimes(1000), _batches([("a", 10)]), timers)
    assert _rows(run) == []
    for batch_time, expiry in ((9000, 1010), (9000, 2010), (9500, 3010)):
        run = run_keyed_subtask(spec, backend, BatchTimes(batch_time), _batches([]), timers)
        assert _rows(run) == [("a", expiry)]
    backend.set_current_key(("a",))
    assert list(timers.processing_time_timers()) == [4010]


def test_late_events_are_dropped_in_event_time(backend: KeyedStateBackend) -> None:
    spec = _spec(RowTotals(), time_mode="EventTime", event_time_column="amount")
    rows = [("a", 5), ("a", 50), ("b", 10), ("b", 11)]
    times = BatchTimes(0, late_events_watermark_ms=10, eviction_watermark_ms=10)
    output = _rows(run_keyed_subtask(spec, backend, times, _batches(rows)))
    expected: dict[str, int] = defaultdict(int)
    for user, amount in rows:
        if amount > 10:
            expected[user] += amount
    assert sorted(output) == sorted(expected.items())


class WrongOutput(StatefulProcessor):
    def __init__(self, row: Any) -> None:
        self.row = row

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(self, key: Any, rows: Any, timerValues: TimerValues) -> Iterator[Any]:
        yield self.row


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (Row(user="a", count=1), "no column 'total'"),
        (
            Row(user="a", total="3 events"),
            r"^output column 'total' does not fit its type bigint: it got '3 events' \(a str\); "
            r"return bigint values there$",
        ),
        (("a",), "does not fit the output schema"),
    ],
)
def test_output_that_does_not_fit_names_the_column(
    backend: KeyedStateBackend, row: Any, message: str
) -> None:
    spec = _spec(WrongOutput(row))
    with pytest.raises(OutputSchemaError, match=message):
        list(run_keyed_subtask(spec, backend, BatchTimes(0), _batches([("a", 1)])))


def test_pandas_output_without_a_column_names_it(backend: KeyedStateBackend) -> None:
    spec = _spec(WrongOutput(pd.DataFrame({"user": ["a"]})), use_pandas=True)
    with pytest.raises(OutputSchemaError, match="no column 'total'"):
        list(run_keyed_subtask(spec, backend, BatchTimes(0), _batches([("a", 1)])))


def test_pandas_output_by_position_takes_its_columns_in_order(backend: KeyedStateBackend) -> None:
    """Columns without string labels fill the output schema by position; too few is an
    OutputSchemaError saying how many there are."""
    spec = _spec(WrongOutput(pd.DataFrame([["a", 5, "extra"]])), use_pandas=True)
    assert _rows(run_keyed_subtask(spec, backend, BatchTimes(0), _batches([("a", 1)]))) == [
        ("a", 5)
    ]
    spec = _spec(WrongOutput(pd.DataFrame([["a"]])), use_pandas=True)
    with pytest.raises(OutputSchemaError, match="has 1 columns, the output schema"):
        list(run_keyed_subtask(spec, backend, BatchTimes(0), _batches([("a", 1)])))


def test_a_one_ms_ttl_lives_through_its_batch_and_not_the_next(
    backend: KeyedStateBackend,
) -> None:
    """TTL expiry in whole milliseconds of the batch timestamp, as Spark computes it (a
    float clock in seconds lost the last millisecond for about a third of timestamps,
    expiring a 1 ms TTL within its own batch)."""
    clock = backend.clock
    assert isinstance(clock, BatchClock)
    state = backend.get_state(ValueStateDescriptor("note", ttl=StateTtlConfig(0.001)))
    backend.set_current_key(("a",))
    for timestamp_ms in range(1_795_366_454_000, 1_795_366_454_100):
        clock.timestamp_ms = timestamp_ms
        state.update(timestamp_ms)
        assert state.value() == timestamp_ms
        clock.timestamp_ms = timestamp_ms + 1
        assert state.value() is None


class CheckpointedTotals(RowTotals):
    """A processor that also keeps operator state."""

    def initialize_state(self, ctx: FunctionInitializationContext) -> None:
        self.seen = ctx.operator_state_store.get_list_state("seen")

    def snapshot_state(self, ctx: FunctionSnapshotContext) -> None:
        pass


class ListCheckpointedTotals(Totals):
    """A KeyedFunction whose operator state is one list."""

    def snapshot_state(self, checkpoint_id: int) -> list[Any]:
        return []

    def restore_state(self, state: list[Any]) -> None:
        pass


def test_the_checkpointed_part_of_a_processor_is_what_keeps_operator_state() -> None:
    """The processor itself, or the KeyedFunction a KeyedFunctionProcessor runs
    (a ListCheckpointed one wrapped); None when neither keeps operator state."""
    processor = CheckpointedTotals()
    assert checkpointed_part(processor) is processor
    function = ListCheckpointedTotals()
    adapter = checkpointed_part(KeyedFunctionProcessor(function))
    assert isinstance(adapter, ListCheckpointedAdapter) and adapter.function is function
    assert checkpointed_part(RowTotals()) is None
    assert checkpointed_part(KeyedFunctionProcessor(Totals())) is None


@pytest.mark.parametrize(
    "names",
    [
        ["user", "amount"],
        ["only"],
        ["count", "index", "asDict", "__x", "a", "a", "my col", "Größe"],
    ],
)
def test_input_rows_behave_as_plain_spark_rows(names: list[str]) -> None:
    """The Rows the runner makes (a subclass of Row with its fields as descriptors) act
    like ``Row(*names)(*values)`` in every way a processor can see, whatever the column
    names: tuple and Row attributes (``count``, ``asDict``) stay methods, ``__x`` and
    unknown names raise as on a plain Row, a duplicate name gives its first column, and a
    pickled copy is a plain Row."""
    columns = [[f"{name}-{position}-{i}" for i in range(3)] for position, name in enumerate(names)]
    fast = _row_maker(names)(columns)
    plain = [Row(*names)(*values) for values in zip(*columns, strict=True)]
    assert fast == plain
    for made, expected in zip(fast, plain, strict=True):
        assert isinstance(made, Row) and type(made).__name__ == "Row"
        assert repr(made) == repr(expected) and str(made) == str(expected)
        assert hash(made) == hash(expected) and made[1:] == expected[1:]
        assert tuple(made.__fields__) == tuple(expected.__fields__)
        assert made.asDict() == expected.asDict()
        copied = pickle.loads(pickle.dumps(made))
        assert copied == expected and type(copied) is Row
        assert copied.__fields__ == expected.__fields__
        assert all(name in made for name in names) and "missing" not in made
        for name in [*names, "missing"]:
            outcomes = []
            for row in (made, expected):
                try:
                    value = getattr(row, name)
                except AttributeError as exc:
                    outcomes.append(("raises", type(exc)))
                else:
                    outcomes.append(("method", name) if callable(value) else ("value", value))
            assert outcomes[0] == outcomes[1], name
        for name in names:
            assert made[name] == expected[name]


class ManyRows(StatefulProcessor):
    """Emits ``amount`` rows per input row, so one key's output spans record batches."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        pass

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Any]:
        for row in rows:
            for i in range(row.amount):
                yield Row(user=key[0], total=i) if i % 2 else (key[0], i)


def test_nested_rows_in_the_output_fill_their_structs_by_field_name() -> None:
    """As Spark: a Row inside an output row (in a struct, array or map column) gives its
    fields by name, whatever their order in the Row; a plain tuple, by position."""
    ab = StructType([StructField("a", LongType()), StructField("b", LongType())])
    schema = StructType(
        [
            StructField("user", StringType()),
            StructField("p", ab),
            StructField("ps", ArrayType(ab)),
            StructField("m", MapType(StringType(), ab)),
        ]
    )
    rows = [
        Row(user="u", p=Row(b=100, a=1), ps=[Row(b=1, a=2), (3, 4)], m={"k": Row(b=5, a=6)}),
        Row(m=None, ps=None, p=(7, 8), user="v"),
    ]
    builder = OutputBuilder(schema)
    builder.add_rows(rows)
    assert builder.flush().to_pylist() == [
        {
            "user": "u",
            "p": {"a": 1, "b": 100},
            "ps": [{"a": 2, "b": 1}, {"a": 3, "b": 4}],
            "m": [("k", {"a": 6, "b": 5})],
        },
        {"user": "v", "p": {"a": 7, "b": 8}, "ps": None, "m": None},
    ]


def test_pandas_output_is_cast_safely_as_spark_casts_it() -> None:
    """As Spark's transformWithStateInPandas (``arrow_cast``): text of a number in a long
    column is cast; a value a safe cast would change (1.7 in a long) is an
    OutputSchemaError naming the column."""
    schema = StructType([StructField("user", StringType()), StructField("n", LongType())])
    builder = OutputBuilder(schema)
    builder.add_frames([pd.DataFrame({"user": ["a", "b"], "n": ["2", "-7"]})])
    builder.finish_frames()
    assert [batch.to_pylist() for batch in builder.take_ready()] == [
        [{"user": "a", "n": 2}, {"user": "b", "n": -7}]
    ]
    builder.add_frames([pd.DataFrame({"user": ["a", "b"], "n": [2, 1.7]})])
    with pytest.raises(
        OutputSchemaError,
        match=r"^output column 'n' does not fit its type bigint: it got 1\.7 \(a float\); "
        r"return bigint values there$",
    ):
        builder.finish_frames()


def test_pandas_output_columns_go_by_position_with_spark_s_by_name_setting_off() -> None:
    """With ``spark.sql.legacy.execution.pandas.groupedMap.assignColumnsByName`` off Spark
    takes a pandas processor's output columns by position, whatever their labels (on: by
    name); ours took them by name whatever the setting."""
    schema = StructType([StructField("a", LongType()), StructField("b", LongType())])
    frame = pd.DataFrame({"b": [1, 3], "a": [2, 4]})
    for by_name in (True, False):
        builder = OutputBuilder(schema, by_name=by_name)
        builder.add_frames([frame])
        builder.finish_frames()
        rows = [row for batch in builder.take_ready() for row in batch.to_pylist()]
        columns = ["a", "b"] if by_name else list(frame.columns)
        expected = [dict(zip(["a", "b"], values, strict=True)) for values in frame[columns].values]
        assert rows == expected


def test_pandas_output_columns_go_by_name_where_any_label_is_a_string() -> None:
    """Spark takes an output frame's columns by name where any of its labels is a string
    (positions only where none is); ours took them by position unless all were strings:
    columns labelled ``b``, ``a`` and ``0`` (one added unnamed) came swapped, and a frame
    without a schema column was taken as it was."""
    schema = StructType([StructField("a", LongType()), StructField("b", LongType())])
    frame = pd.DataFrame({"b": [1], "a": [2], 0: [3]})
    builder = OutputBuilder(schema)
    builder.add_frames([frame])
    builder.finish_frames()
    rows = [row for batch in builder.take_ready() for row in batch.to_pylist()]
    assert rows == [{"a": int(frame["a"][0]), "b": int(frame["b"][0])}]
    with pytest.raises(OutputSchemaError, match=r"^output DataFrame has no column 'a' "):
        builder.add_frames([pd.DataFrame({"b": [1], 0: [2]})])


def test_pandas_output_is_cast_unsafely_with_spark_s_setting_off() -> None:
    """With ``spark.sql.execution.pandas.convertToArrowArraySafely`` off (``safe``) Spark
    casts as Arrow casts unsafely: a fraction into a long loses its fraction, an int too
    big for an int column keeps its low 32 bits (text of a number is cast as ever); ours
    refused them whatever the setting."""
    names = {"n": LongType(), "i": IntegerType(), "t": LongType()}
    schema = StructType([StructField(name, kind) for name, kind in names.items()])
    fractions, bigs, texts = [1.7, -2.7, float("nan")], [2**40 + 5, 2**31, -3], ["4", "5", "6"]
    builder = OutputBuilder(schema, safe=False)
    builder.add_frames([pd.DataFrame({"n": fractions, "i": bigs, "t": texts})])
    builder.finish_frames()
    rows = [row for batch in builder.take_ready() for row in batch.to_pylist()]
    low_bits = [(value + 2**31) % 2**32 - 2**31 for value in bigs]
    expected = [
        {"n": None if math.isnan(n) else int(n), "i": i, "t": int(t)}
        for n, i, t in zip(fractions, low_bits, texts, strict=True)
    ]
    assert rows == expected


def test_output_of_many_rows_per_key_is_complete_and_in_order(
    backend: KeyedStateBackend,
) -> None:
    rows = [("a", 12_345), ("b", 3), ("a", 7)]
    output = _rows(run_keyed_subtask(_spec(ManyRows()), backend, BatchTimes(0), _batches(rows)))
    by_key: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for user, amount in rows:
        by_key[user].extend((user, i) for i in range(amount))
    assert sorted(output) == sorted(row for key_rows in by_key.values() for row in key_rows)
    for user, expected in by_key.items():
        assert [row for row in output if row[0] == user] == expected


class ThresholdRecorder(RowTotals):
    """Records the garbage collector's thresholds while it handles rows; fails on "boom"."""

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        self.during = gc.get_threshold()
        if key == ("boom",):
            raise ValueError("boom")
        yield from super().handleInputRows(key, rows, timerValues)


def test_a_batch_tunes_the_garbage_collector_and_restores_it(backend: KeyedStateBackend) -> None:
    processor = ThresholdRecorder()
    previous = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        assert _rows(
            run_keyed_subtask(_spec(processor), backend, BatchTimes(0), _batches([("a", 1)]))
        )
        assert processor.during[0] == YOUNG_COLLECTION_OBJECTS
        assert gc.get_threshold() == (700, 10, 10)
        with pytest.raises(ValueError, match="boom"):
            list(
                run_keyed_subtask(_spec(processor), backend, BatchTimes(0), _batches([("boom", 1)]))
            )
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*previous)


def test_key_runs_found_by_arrow_match_python_equality() -> None:
    """``_run_starts`` (Arrow comparisons; Python's for types Arrow cannot compare) gives
    the rows where the tuple of the columns' values changes, as Python compares the key
    values ``_keys`` makes of them (every NaN one NaN: NaN keys are one key, as Spark
    groups them)."""
    rng = random.Random(7)

    def pick(choices: list[Any]) -> list[Any]:
        values = [rng.choice(choices) for _ in range(300)]
        return sorted(values, key=repr)[:150] + values[150:]  # runs, then noise

    columns = {
        "id": pa.array(pick([None, 1, 2, 3]), pa.int64()),
        "name": pa.array(pick([None, "", "a", "b"]), pa.string()),
        "score": pa.array(pick([None, 0.0, -0.0, 1.5, float("nan")]), pa.float64()),
        "tags": pa.array(pick([None, [], [1], [1, 2]]), pa.list_(pa.int64())),
        KIND_COLUMN: pa.array(pick([CONTROL, INITIAL, INPUT]), pa.int8()),
    }
    batch = pa.RecordBatch.from_pydict(columns)
    for names in [("id",), ("name", KIND_COLUMN), ("score",), ("tags", "id"), tuple(columns)]:
        rows = list(zip(*(_key_values(batch.column(n), n) for n in names), strict=True))
        expected = [0] + [i for i in range(1, len(rows)) if rows[i] != rows[i - 1]]
        assert _run_starts(batch, names) == expected, names
    assert _run_starts(batch.slice(0, 1), ("id",)) == [0]


def _keyed_by(
    key_schema: StructType, tmp_path: Path
) -> tuple[RowTupleSerializer, RocksDBKeyedStateBackend]:
    """A RocksDB backend owning every key group, keyed by rows of ``key_schema``."""
    serializer = RowTupleSerializer(key_schema.json())
    backend = RocksDBKeyedStateBackend(
        tmp_path / "db",
        max_parallelism=MAX_PARALLELISM,
        key_group_range=KeyGroupRange(0, MAX_PARALLELISM - 1),
        key_serializer=serializer,
        clock=BatchClock(0),
    )
    return serializer, backend


def test_equal_keys_encoded_differently_keep_their_own_state(tmp_path: Path) -> None:
    """0.0 and -0.0 are equal but encode (and hash to key groups) differently: each run's
    key gets the record read ahead for that very key, as ``set_current_key`` of it would."""
    key_schema = StructType([StructField("user", DoubleType())])
    output = StructType([StructField("user", DoubleType()), StructField("total", LongType())])
    serializer, backend = _keyed_by(key_schema, tmp_path)
    events = [(0.0, 1), (-0.0, 10), (0.0, 100), (-0.0, 1000), (4.0, 5)]
    group = {
        repr(u): assign_to_key_group(serializer.serialize((u,)), MAX_PARALLELISM) for u, _ in events
    }
    assert group["-0.0"] < group["4.0"] < group["0.0"]  # 0.0 and -0.0 runs apart
    ordered = sorted(events, key=lambda event: group[repr(event[0])])
    table = pa.table(
        {
            "user": pa.array([None] + [u for u, _ in ordered], pa.float64()),
            "amount": pa.array([None] + [a for _, a in ordered], pa.int64()),
            KIND_COLUMN: pa.array([CONTROL] + [INPUT] * len(ordered), pa.int8()),
        }
    )
    expected: dict[str, int] = defaultdict(int)
    for user, amount in events:
        expected[repr(user)] += amount
    try:
        spec = _spec(RowTotals(), output_schema_json=output.json())
        # The keys in a record batch without and with the control row, and a key's rows
        # across two record batches: the totals add up.
        splits = [
            [*table.slice(0, 1).to_batches(), *table.slice(1).to_batches()],
            table.to_batches(),
            table.to_batches(2),
        ]
        for runs, batches in enumerate(splits, start=1):
            out = list(run_keyed_subtask(spec, backend, BatchTimes(0), batches))
            got = {repr(u): t for b in out for u, t in zip(*b.to_pydict().values(), strict=True)}
            assert got == {user: total * runs for user, total in expected.items()}
        state = backend.get_state(ValueStateDescriptor("total", RowTupleSerializer(TOTAL.json())))
        for user in (0.0, -0.0, 4.0):
            backend.set_current_key((user,))
            assert state.value() == (expected[repr(user)] * len(splits),)
    finally:
        backend.dispose()


def test_array_keys_keep_their_totals_across_batches(tmp_path: Path) -> None:
    """A key column of array type (unhashable in Python, unsortable by Arrow): the rows
    reach the processor grouped by key, and each key's total is the plain-Python one."""
    key_schema = StructType([StructField("user", ArrayType(LongType()))])
    output = StructType(
        [StructField("user", ArrayType(LongType())), StructField("total", LongType())]
    )
    serializer, backend = _keyed_by(key_schema, tmp_path)
    rng = random.Random(11)
    users: list[list[int] | None] = [[], [1], [1, 2], [2, 1], [3, None], None]
    totals: Counter[str] = Counter()
    spec = _spec(RowTotals(), output_schema_json=output.json())
    try:
        for _ in range(3):
            events = [(rng.choice(users), rng.randrange(100)) for _ in range(40)]
            table = pa.table(
                {
                    "user": pa.array([None] + [u for u, _ in events], pa.list_(pa.int64())),
                    "amount": pa.array([None] + [a for _, a in events], pa.int64()),
                    KIND_COLUMN: pa.array([CONTROL] + [INPUT] * len(events), pa.int8()),
                    SEQUENCE_COLUMN: pa.array(range(len(events) + 1), pa.int64()),
                    KEY_GROUP_COLUMN: pa.array(
                        [-1]
                        + [
                            assign_to_key_group(serializer.serialize((u,)), MAX_PARALLELISM)
                            for u, _ in events
                        ],
                        pa.int32(),
                    ),
                }
            )
            batches = sorted_by_key(table.to_batches(7), ("user",), key_schema.json())
            out = list(run_keyed_subtask(spec, backend, BatchTimes(0), batches))
            expected = {}
            for user, amount in events:
                totals[repr(user)] += amount
                expected[repr(user)] = totals[repr(user)]
            got = [(repr(u), t) for b in out for u, t in zip(*b.to_pydict().values(), strict=True)]
            assert sorted(got) == sorted(expected.items())  # one output row per key
    finally:
        backend.dispose()


KEY_CASES = {
    "string": ([("user", StringType())], [("a",), ("",), ("é",), (None,)]),
    "long": ([("id", LongType())], [(0,), (-1,), (2**62,), (None,)]),
    "double": ([("x", DoubleType())], [(0.0,), (-0.0,), (float("nan"),), (1e300,), (None,)]),
    "date": ([("day", DateType())], [(datetime.date(1970, 1, 1),), (datetime.date(2026, 11, 23),)]),
    "composite": (
        [("user", StringType()), ("n", IntegerType())],
        [("a", 1), ("a", None), ("b", 1)],
    ),
    "timestamp": ([("at", TimestampType())], [(datetime.datetime(2026, 1, 1, 12, 0, 1),)]),
}


@pytest.mark.parametrize("case", sorted(KEY_CASES))
def test_keys_read_ahead_from_arrow_get_the_records_of_the_general_path(
    tmp_path: Path, case: str
) -> None:
    """The runner's read-ahead serializes and hashes keys from their Arrow rows at once;
    the records it gets equal those the backend computes key by key."""
    fields, keys = KEY_CASES[case]
    schema = StructType([StructField(name, data_type) for name, data_type in fields])
    names = tuple(name for name, _ in fields)
    rows = pa.RecordBatch.from_pylist(
        [dict(zip(names, key, strict=True)) for key in keys],
        schema=to_arrow_schema(schema, timezone="UTC"),
    )
    keys = list(zip(*(rows.column(name).to_pylist() for name in names), strict=True))
    backend = RocksDBKeyedStateBackend(
        tmp_path / "db",
        max_parallelism=MAX_PARALLELISM,
        key_group_range=KeyGroupRange(0, MAX_PARALLELISM - 1),
        key_serializer=RowTupleSerializer(schema.json()),
    )
    try:
        with backend.batch():
            from_arrow = _read_ahead_of(backend, names)(keys, rows)
        with backend.batch():
            general = backend.read_ahead(keys)
        assert from_arrow == general and len(general) == len(keys)
    finally:
        backend.dispose()


def test_a_string_key_that_is_not_utf8_is_one_error_naming_its_column() -> None:
    """Spark holds a string made of any bytes (CAST(binary AS STRING)); such a key was a
    UnicodeDecodeError blamed on the processor's init."""
    column = pa.array([b"ok", b"caf\xe9"], pa.binary()).view(pa.string())
    with pytest.raises(SerializationError, match=r"key column 'k' holds a string that is not"):
        _key_values(column, "k")
    assert _key_values(column.slice(0, 1), "k") == ["ok"]


def test_pandas_mode_input_holds_nested_values_as_spark_hands_them() -> None:
    """A pandas processor gets maps as dicts and integers inside arrays, maps and
    structs as ints with None for null, as Spark converts them; they were lists of
    pairs and floats with NaN (``m['x']`` failed). Top-level int columns with nulls stay
    float64, as in Spark."""
    table = pa.table(
        {
            "m": pa.array([[("x", 0), ("y", None)], None], pa.map_(pa.string(), pa.int64())),
            "a": pa.array([[1, None, 0], [2]], pa.list_(pa.int64())),
            "s": pa.array([{"i": 2}, None], pa.struct([("i", pa.int64())])),
            "n": pa.array([1, None], pa.int64()),
        }
    )
    frame = pandas_frame(table, "UTC")
    assert frame["m"].tolist() == [{"x": 0, "y": None}, None]
    assert [list(a) for a in frame["a"]] == [[1, None, 0], [2]]
    assert all(type(v) is int for a in frame["a"] for v in a if v is not None)
    assert frame["s"].tolist()[0] == {"i": 2} and type(frame["s"].tolist()[0]["i"]) is int
    assert str(frame["n"].dtype) == "float64"


def test_pandas_mode_timestamps_and_empty_arrays_inside_nested_values_are_spark_s() -> None:
    """Inside arrays, structs and maps, a timestamp reaches a pandas processor as Spark
    hands it: a naive ``pandas.Timestamp``, the wall time of the session time zone
    (timestamp_ntz: its own wall time), and an array of structs, maps or timestamps as a
    ``numpy.array`` of them (``float64`` where empty, what ``numpy.array([])`` is).
    Arrays of timestamps were ``datetime64`` of UTC wall times, structs and maps held
    zone-aware datetimes, and empty arrays of structs were of dtype object."""
    zone = "America/New_York"
    instant = datetime.datetime(2024, 7, 1, 12, 0, tzinfo=datetime.UTC)
    wall = pd.Timestamp(instant.astimezone(ZoneInfo(zone)).replace(tzinfo=None))
    local = datetime.datetime(2024, 11, 3, 1, 30)
    point = pa.struct([("x", pa.int64()), ("at", pa.timestamp("us", tz="UTC"))])
    table = pa.table(
        {
            "ats": pa.array([[instant, None], []], pa.list_(pa.timestamp("us", tz="UTC"))),
            "ntz": pa.array([[local], []], pa.list_(pa.timestamp("us"))),
            "points": pa.array([[{"x": 1, "at": instant}], []], pa.list_(point)),
            "point": pa.array([{"x": None, "at": instant}, None], point),
            "m": pa.array([[("k", instant)], []], pa.map_(pa.string(), pa.timestamp("us", "UTC"))),
        }
    )
    frame = pandas_frame(table, zone)
    first, second = frame.iloc[0], frame.iloc[1]
    assert first["ats"][0] == wall and first["ats"][1] is pd.NaT  # as Spark: NaT for null
    assert type(first["ats"][0]) is pd.Timestamp and first["ats"][0].tzinfo is None
    assert list(first["ntz"]) == [pd.Timestamp(local)] and type(first["ntz"][0]) is pd.Timestamp
    assert list(first["points"]) == [{"x": 1, "at": wall}]
    assert type(first["points"][0]["at"]) is pd.Timestamp
    assert first["point"] == {"x": None, "at": wall} and second["point"] is None
    assert first["m"] == {"k": wall} and type(first["m"]["k"]) is pd.Timestamp
    assert second["m"] == {}
    for name in ("ats", "ntz", "points"):
        empty = second[name]
        assert isinstance(empty, np.ndarray) and empty.dtype == np.array([]).dtype == "float64"
        assert len(empty) == 0


class CallRecorder(StatefulProcessor):
    """Keeps every call it gets: (method, key, its rows as tuples)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.calls: list[tuple[str, Any, list[tuple[Any, ...]]]] = []

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        self.calls.append(("input", key, [tuple(row) for row in rows]))
        return iter(())

    def handleInitialState(self, key: Any, initialState: Any, timerValues: TimerValues) -> None:
        self.calls.append(("initial", key, [tuple(initialState)]))


@pytest.mark.parametrize("batch_rows", [1, 2, 3, 5, 8, 13, 1000])
def test_each_key_gets_its_initial_rows_then_one_call_with_all_its_input_rows(
    backend: KeyedStateBackend, batch_rows: int
) -> None:
    """Keys in runs of one or more rows, within and across record batches, with and
    without initial-state rows: per key in (key group, key) order one
    ``handleInitialState`` per initial row, then one ``handleInputRows`` with every
    input row in arrival order, as a plain-Python grouping of the rows gives them."""
    rng = random.Random(batch_rows)
    users = [f"u{i}" for i in range(30)]
    rows = [(rng.choice(users), amount) for amount in range(120)]
    initial = [(rng.choice(users[:8]), 1000 + start) for start in range(6)]
    processor = CallRecorder()
    spec = _spec(processor, initial_columns=("user", "start"))
    batches = _batches(rows, initial, batch_rows=batch_rows)
    assert list(run_keyed_subtask(spec, backend, BatchTimes(0), batches))[0].num_rows == 0
    serializer = RowTupleSerializer(KEY_SCHEMA.json())
    expected = []
    for user in sorted(
        {user for user, _ in rows + initial},
        key=lambda u: (assign_to_key_group(serializer.serialize((u,)), MAX_PARALLELISM), u),
    ):
        expected += [("initial", (user,), [(u, s)]) for u, s in initial if u == user]
        amounts = [(u, a) for u, a in rows if u == user]
        if amounts:
            expected.append(("input", (user,), amounts))
    assert processor.calls == expected


class FrameRecorder(StatefulProcessor):
    """Pandas mode: keeps a copy of every DataFrame each key gets, in order."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.frames: list[tuple[Any, pd.DataFrame]] = []

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        for frame in rows:
            self.frames.append((key, frame.copy()))
            frame.iloc[0, 0] = None  # a processor may change what it got
        return iter(())


_INPUT_TYPES = {
    "user": pa.string(),
    "amount": pa.int64(),
    "small": pa.int32(),
    "flag": pa.bool_(),
    "ratio": pa.float32(),
    "text": pa.string(),
    "day": pa.date32(),
    "at": pa.timestamp("us", tz="UTC"),
    "local": pa.timestamp("us"),
    "price": pa.decimal128(10, 2),
    "blob": pa.binary(),
}


def _input_values(rng: random.Random, row: int, nulls: bool) -> dict[str, Any]:
    """One input row of every type of ``_INPUT_TYPES`` but the key; ``nulls``: its
    integer and boolean columns may be null too (other columns always may)."""
    maybe = (lambda value: None if rng.random() < 0.2 else value) if nulls else (lambda v: v)
    return {
        "amount": maybe(rng.randrange(-(2**40), 2**40)),
        "small": maybe(rng.randrange(-100, 100)),
        "flag": maybe(rng.random() < 0.5),
        "ratio": None if rng.random() < 0.2 else rng.random(),
        "text": None if rng.random() < 0.2 else f"t{row}",
        "day": datetime.date(2020, 1, 1) + datetime.timedelta(days=row),
        "at": None
        if rng.random() < 0.2
        else datetime.datetime(2024, 3, 10, 6, 30, tzinfo=datetime.timezone.utc)
        + datetime.timedelta(minutes=37 * row),
        "local": datetime.datetime(2024, 11, 3, 1, 15) + datetime.timedelta(minutes=row),
        "price": None if rng.random() < 0.2 else Decimal(row) / 4,
        "blob": bytes([row % 256]) * (row % 3),
    }


@pytest.mark.parametrize(
    ("nulls", "nested", "arrow_rows", "frame_rows"),
    [
        (False, False, 1000, 10_000),  # every key's frame a slice of its batch's frame
        (False, False, 9, 10_000),  # keys across record batches
        (False, False, 1000, 2),  # keys in frames of at most 2 rows
        (True, False, 1000, 10_000),  # int/bool nulls: each key's dtypes its own
        (False, True, 1000, 10_000),  # a nested column: made per key
    ],
)
def test_pandas_mode_frames_are_each_keys_own_rows_converted_alone(
    backend: KeyedStateBackend, nulls: bool, nested: bool, arrow_rows: int, frame_rows: int
) -> None:
    """Every key's DataFrames (values, dtypes, index, chunking) are what converting
    that key's rows alone gives (``pandas_frame``, as Spark makes each key's frame),
    whether they are made as slices of one frame of the record batch or per key; a
    processor changing its frame changes no other key's."""
    rng = random.Random(f"{nulls}{nested}{arrow_rows}{frame_rows}")
    types = dict(_INPUT_TYPES, **({"tags": pa.list_(pa.int64())} if nested else {}))
    users = [f"u{i}" for i in range(15)]
    rows = []
    for row in range(150):
        user = rng.choice(users)
        values = _input_values(rng, row, nulls and user in users[:5])  # some keys null-free
        if nested:
            values["tags"] = [row, None] if row % 2 else []
        rows.append({"user": user, **values})
    serializer = RowTupleSerializer(KEY_SCHEMA.json())
    group = {u: assign_to_key_group(serializer.serialize((u,)), MAX_PARALLELISM) for u in users}
    ordered = sorted(enumerate(rows), key=lambda item: (group[item[1]["user"]], item[1]["user"]))
    records = [{name: None for name in types}] + [values for _, values in ordered]
    kinds = [CONTROL] + [INPUT] * len(rows)
    table = pa.table(
        {
            **{name: pa.array([r[name] for r in records], kind) for name, kind in types.items()},
            KIND_COLUMN: pa.array(kinds, pa.int8()),
            SEQUENCE_COLUMN: pa.array(range(len(records)), pa.int64()),
            KEY_GROUP_COLUMN: pa.array([-1] + [group[v["user"]] for v in rows], pa.int32()),
            SUBTASK_COLUMN: pa.array([0] * len(records), pa.int32()),
        }
    )
    processor = FrameRecorder()
    zone = "America/New_York"
    spec = _spec(
        processor,
        use_pandas=True,
        input_columns=tuple(types),
        time_zone=zone,
        max_records_per_batch=frame_rows,
    )
    list(run_keyed_subtask(spec, backend, BatchTimes(0), table.to_batches(arrow_rows)))

    expected = []
    for user in sorted(set(r["user"] for r in rows), key=lambda u: (group[u], u)):
        mine = [r for r in rows if r["user"] == user]
        for start in range(0, len(mine), frame_rows):
            chunk = mine[start : start + frame_rows]
            alone = pa.table(
                {name: pa.array([r[name] for r in chunk], t) for name, t in types.items()}
            )
            expected.append(((user,), pandas_frame(alone, zone)))
    assert [key for key, _ in processor.frames] == [key for key, _ in expected]
    for (_, got), (_, want) in zip(processor.frames, expected, strict=True):
        pd.testing.assert_frame_equal(got, want)
    dtypes = {str(frame["amount"].dtype) for _, frame in processor.frames}
    assert dtypes == ({"int64", "float64"} if nulls else {"int64"})


@pytest.mark.parametrize(
    ("text_bytes", "max_bytes", "max_records"),
    [(10_000, 25_000, 100), (10_000, 30_000, 100), (10_000, 25_000, 2), (100, 2**31 - 2, 5)],
)
def test_pandas_mode_frames_end_at_max_bytes_per_batch(
    backend: KeyedStateBackend, text_bytes: int, max_bytes: int, max_records: int
) -> None:
    """With ``spark.sql.execution.arrow.maxBytesPerBatch`` a key's rows come in
    DataFrames of the fewest rows that reach that many bytes (rows of ``text_bytes``
    bytes of text), as Spark cuts them, within ``maxRecordsPerBatch``; they came in
    DataFrames of ``maxRecordsPerBatch`` rows whatever their size."""
    rng = random.Random(text_bytes)
    users = [f"u{i}" for i in range(4)]
    rows = [(rng.choice(users), n) for n in range(40)]
    types = {"user": pa.string(), "text": pa.string()}
    serializer = RowTupleSerializer(KEY_SCHEMA.json())
    group = {u: assign_to_key_group(serializer.serialize((u,)), MAX_PARALLELISM) for u in users}
    ordered = sorted(rows, key=lambda row: (group[row[0]], row[0]))
    table = pa.table(
        {
            "user": pa.array([None] + [user for user, _ in ordered], pa.string()),
            "text": pa.array([None] + [f"{n:x>{text_bytes}}" for _, n in ordered], pa.string()),
            KIND_COLUMN: pa.array([CONTROL] + [INPUT] * len(rows), pa.int8()),
            SEQUENCE_COLUMN: pa.array(range(len(rows) + 1), pa.int64()),
            KEY_GROUP_COLUMN: pa.array([-1] + [group[u] for u, _ in ordered], pa.int32()),
            SUBTASK_COLUMN: pa.array([0] * (len(rows) + 1), pa.int32()),
        }
    )
    processor = FrameRecorder()
    spec = _spec(
        processor,
        use_pandas=True,
        input_columns=tuple(types),
        max_records_per_batch=max_records,
        max_bytes_per_batch=max_bytes,
    )
    list(run_keyed_subtask(spec, backend, BatchTimes(0), table.to_batches(16)))
    per_frame = min(max_records, math.ceil(max_bytes / text_bytes))
    expected = []
    for user in sorted(set(users) & {u for u, _ in rows}, key=lambda u: (group[u], u)):
        mine = [n for u, n in rows if u == user]
        expected += [(user, mine[i : i + per_frame]) for i in range(0, len(mine), per_frame)]
    got = [
        (key[0], [int(text.lstrip("x")) for text in frame["text"]])
        for key, frame in processor.frames
    ]
    assert got == expected


INT_KEY_SCHEMA = StructType([StructField("k", IntegerType())])
SPARK_INT_WIDTHS = {"k": "int32", "b": "int8", "s": "int16", "l": "int64"}
"""Spark's integer types (integer, byte, short, long) as pandas names their widths."""


@pytest.mark.parametrize("batch_rows", [2, 100])
def test_pandas_mode_ints_keep_their_width_with_spark_s_extension_dtype_setting(
    batch_rows: int,
) -> None:
    """With ``spark.sql.execution.pythonUDF.pandas.preferIntExtensionDtype`` Spark's
    frames keep each integer column's width (``int8`` for byte) and a column with
    nulls holds NumPy scalars of it and ``pandas.NA``; an integer key is a NumPy scalar
    too. Ours widened them to int64, nulls to float64 NaN, whatever the setting."""
    serializer = RowTupleSerializer(INT_KEY_SCHEMA.json())
    rows = [(1, 5, 300, 2**40), (2, -3, None, 7), (2, 4, 9, None), (1, 6, 301, 1)]
    group = {k: assign_to_key_group(serializer.serialize((k,)), MAX_PARALLELISM) for k in (1, 2)}
    ordered = sorted(rows, key=lambda row: (group[row[0]], row[0]))
    records = [(None,) * 4, *ordered]
    widths = {"k": pa.int32(), "b": pa.int8(), "s": pa.int16(), "l": pa.int64()}
    table = pa.table(
        {
            **{
                name: pa.array([record[i] for record in records], kind)
                for i, (name, kind) in enumerate(widths.items())
            },
            KIND_COLUMN: pa.array([CONTROL] + [INPUT] * len(rows), pa.int8()),
            SEQUENCE_COLUMN: pa.array(range(len(records)), pa.int64()),
            KEY_GROUP_COLUMN: pa.array([-1] + [group[row[0]] for row in ordered], pa.int32()),
            SUBTASK_COLUMN: pa.array([0] * len(records), pa.int32()),
        }
    )
    backend = HeapKeyedStateBackend(
        max_parallelism=MAX_PARALLELISM,
        key_group_range=KeyGroupRange(0, MAX_PARALLELISM - 1),
        key_serializer=serializer,
        clock=BatchClock(0),
    )
    processor = FrameRecorder()
    spec = _spec(
        processor,
        use_pandas=True,
        key_columns=("k",),
        input_columns=tuple(widths),
        int_extension=True,
    )
    list(run_keyed_subtask(spec, backend, BatchTimes(0), table.to_batches(batch_rows)))
    for key, frame in processor.frames:
        assert len(key) == 1 and type(key[0]) is np.int32
        mine = [row for row in ordered if row[0] == key[0]]
        for i, name in enumerate(widths):
            values = [row[i] for row in mine]
            if None in values:
                assert frame[name].dtype == object
                assert [type(v).__name__ for v in frame[name]] == [
                    "NAType" if v is None else SPARK_INT_WIDTHS[name] for v in values
                ]
                assert [None if v is pd.NA else int(v) for v in frame[name]] == values
            else:
                assert str(frame[name].dtype) == SPARK_INT_WIDTHS[name]
                assert frame[name].tolist() == values
    assert sorted(int(key[0]) for key, _ in processor.frames) == [1, 2]


def test_pandas_mode_struct_keys_hold_wall_times_as_spark_gives_them() -> None:
    """A pandas processor's struct key value is a dict whose timestamps are naive
    ``pandas.Timestamp`` wall times of the session time zone, as Spark takes the key
    from its frame (and as the frame's own column holds it); it held the zone-aware
    datetimes Arrow gives."""
    zone = "America/New_York"
    place = StructType([StructField("at", TimestampType()), StructField("x", IntegerType())])
    key_schema = StructType([StructField("user", StringType()), StructField("place", place)])
    spec = _spec(CallRecorder(), use_pandas=True, time_zone=zone)
    shown = _shown_key(spec, RowTupleSerializer(key_schema.json()))
    instant = datetime.datetime(2024, 7, 1, 12, 0, tzinfo=datetime.UTC)
    user, value = shown(("a", {"at": instant, "x": 1}))
    wall = instant.astimezone(ZoneInfo(zone)).replace(tzinfo=None)
    assert user == "a" and value == {"at": pd.Timestamp(wall), "x": 1}
    assert type(value["at"]) is pd.Timestamp and value["at"].tzinfo is None
    assert shown(("b", None)) == ("b", None)
    assert shown(("c", {"at": None, "x": None})) == ("c", {"at": None, "x": None})


def test_pandas_output_of_many_frames_is_what_each_frame_converted_alone_gives() -> None:
    """Frames taken together (same dtypes converted at once, across a frame of an
    extension dtype, one whose values convert only by a cast, one of another dtype) give
    the rows, in order, that converting each frame by itself gives, as Spark converts
    each DataFrame a processor yields."""
    schema = StructType(
        [
            StructField("user", StringType()),
            StructField("n", LongType()),
            StructField("x", DoubleType()),
            StructField("at", TimestampType()),
        ]
    )
    at = pd.Timestamp("2024-03-10 01:30")
    frames = [
        pd.DataFrame({"user": ["a", "b"], "n": [1, 2], "x": [0.5, float("nan")], "at": [at] * 2}),
        pd.DataFrame({"user": [None], "n": [3], "x": [1.0], "at": [pd.NaT]}),
        pd.DataFrame({"user": ["c"], "n": pd.array([None], "Int64"), "x": [2.0], "at": [at]}),
        pd.DataFrame({"user": ["d"], "n": [4], "x": [3.0], "at": [at]}),
        pd.DataFrame({"user": ["e"], "n": ["5"], "x": [4.0], "at": [at]}),  # text: cast
        pd.DataFrame({"user": ["f"], "n": [6.0], "x": [5], "at": [at]}),  # floats, ints
        pd.DataFrame({"n": [7], "at": [at], "x": [6.0], "user": ["g"]}),  # other order
        # Objects: an int, then text that converts only by a cast (not both at once).
        pd.DataFrame({"user": ["h"], "n": pd.Series([8], dtype=object), "x": [7.0], "at": [at]}),
        pd.DataFrame({"user": ["i"], "n": pd.Series(["9"], dtype=object), "x": [8.0], "at": [at]}),
    ]
    zone = "America/New_York"
    together = OutputBuilder(schema, zone)
    together.add_frames(frames)
    together.finish_frames()
    alone = []
    for frame in frames:
        builder = OutputBuilder(schema, zone)
        builder.add_frames([frame])
        builder.finish_frames()
        alone += [row for batch in builder.take_ready() for row in batch.to_pylist()]
    rows = [row for batch in together.take_ready() for row in batch.to_pylist()]
    assert rows == alone
    utc = (at.tz_localize(zone).tz_convert("UTC")).to_pydatetime()
    assert [(r["user"], r["n"], r["at"]) for r in rows][:5] == [
        ("a", 1, utc),
        ("b", 2, utc),
        (None, 3, None),
        ("c", None, utc),
        ("d", 4, utc),
    ]
    assert [r["n"] for r in rows[5:]] == [5, 6, 7, 8, 9] and rows[1]["x"] is None


def test_pandas_output_objects_are_taken_as_the_objects_they_are() -> None:
    """An object column of datetimes stays objects: Arrow (and Spark) takes a naive
    ``datetime`` object as a UTC instant, where a ``datetime64`` column holds wall times
    of the session time zone; and a value that does not fit is shown as the processor
    returned it. Frames taken together made their object columns Series again, which
    pandas infers as ``datetime64``: the objects became wall times of the session zone,
    and the error showed a ``Timestamp``."""
    schema = StructType([StructField("user", StringType()), StructField("at", TimestampType())])
    zone = "America/New_York"
    noon = datetime.datetime(2024, 7, 1, 12, 0)
    builder = OutputBuilder(schema, zone)
    builder.add_frames(
        [
            pd.DataFrame({"user": ["a"], "at": pd.Series([noon], dtype=object)}),
            pd.DataFrame({"user": ["b", "b"], "at": pd.Series([noon, None], dtype=object)}),
            pd.DataFrame({"user": ["c"], "at": [pd.Timestamp(noon)]}),  # datetime64: wall
        ]
    )
    builder.finish_frames()
    rows = [row for batch in builder.take_ready() for row in batch.to_pylist()]
    as_utc = noon.replace(tzinfo=datetime.UTC)
    as_wall = noon.replace(tzinfo=ZoneInfo(zone)).astimezone(datetime.UTC)
    assert [(row["user"], row["at"]) for row in rows] == [
        ("a", as_utc),
        ("b", as_utc),
        ("b", None),
        ("c", as_wall),
    ]
    text = StructType([StructField("user", StringType()), StructField("at", StringType())])
    builder = OutputBuilder(text, zone)
    builder.add_frames([pd.DataFrame({"user": ["a"], "at": pd.Series([noon], dtype=object)})])
    with pytest.raises(OutputSchemaError, match=r" \(a datetime\); return string values there$"):
        builder.finish_frames()


class MisfitThenRaise(StatefulProcessor):
    """Pandas mode: the first key's output does not fit the output schema (a total that
    is no number); every later key raises."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.keys: list[str] = []

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        list(rows)
        self.keys.append(key[0])
        if len(self.keys) > 1:
            raise RuntimeError("a later key failed")
        yield pd.DataFrame({"user": [key[0]], "total": ["many"]})


def test_a_pandas_output_misfit_is_the_error_though_the_processor_raises_later(
    backend: KeyedStateBackend,
) -> None:
    """A misfit output frame fails the batch with the error naming its column and value,
    as when each frame was converted as it came (and as in Spark, which converts each
    frame as the processor yields it), even where the processor raises for a later key
    before the frames it yielded are converted; it was the later key's error."""
    spec = _spec(MisfitThenRaise(), use_pandas=True)
    rows = [("u1", 1), ("u2", 2), ("u3", 3)]
    with pytest.raises(OutputSchemaError, match=r"^output column 'total' .* it got 'many'"):
        list(run_keyed_subtask(spec, backend, BatchTimes(0), _batches(rows)))


class ReusedFrame(StatefulProcessor):
    """Pandas mode: yields one DataFrame object for every key, changed in place."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.frame = pd.DataFrame({"user": [""], "total": [0]})

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        self.frame.loc[0, "user"] = key[0]
        self.frame.loc[0, "total"] = sum(int(frame["amount"].sum()) for frame in rows)
        yield self.frame


def test_a_pandas_output_frame_changed_after_it_was_yielded_keeps_what_it_held(
    backend: KeyedStateBackend,
) -> None:
    """Each output row is the frame as it was when yielded, not as the processor
    changed it later."""
    rows = [(f"u{i % 9}", i) for i in range(60)]
    spec = _spec(ReusedFrame(), use_pandas=True)
    output = _rows(run_keyed_subtask(spec, backend, BatchTimes(0), _batches(rows)))
    expected: Counter[str] = Counter()
    for user, amount in rows:
        expected[user] += amount
    assert sorted(output) == sorted(expected.items())
