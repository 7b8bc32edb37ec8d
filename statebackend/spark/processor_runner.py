"""One keyed subtask of one micro-batch: a StatefulProcessor over Arrow record batches.

The Spark side (``arrow_path.py``) hands ``run_keyed_subtask`` the subtask's rows as
Arrow record batches sorted by (key group, key, kind, arrival): first one control row
(so that a subtask without input still runs its timers), then per key its initial-state
rows (batch 0 only) and its input rows. The runner, as Spark's transformWithState does:

1. calls ``init(handle)``;
2. per key: ``handleInitialState`` once per initial-state row (pandas mode: once per key
   with its rows as one DataFrame), then ``handleInputRows(key, rows, timerValues)``
   (Row mode: an iterator of ``Row``; pandas mode: of DataFrames) if the key has input
   rows left after dropping late events (EventTime: event time <= the late-events
   watermark);
3. fires due timers in ascending expiry order (``handleExpiredTimer``): expiry <= batch
   timestamp (ProcessingTime) or <= the eviction watermark (EventTime);
4. TTL: expired values are never returned (their expiry is computed from the batch
   timestamp); removing them physically is left to compaction;
5. calls ``close()``;

and returns the processor's output as Arrow record batches of the output schema. Keys
are tuples of the key columns, as in Spark.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, StatefulProcessor
from pyspark.sql.types import StructType

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.errors import OutputSchemaError
from statebackend.spark.api import KeyedContext, KeyedFunction
from statebackend.spark.processor_handle import (
    BatchTimes,
    Phase,
    ProcessorHandle,
    SchemaCatalog,
)
from statebackend.state.functions import CheckpointedFunction, as_checkpointed_function
from statebackend.state.timers import TimerService

KIND_COLUMN = "__sb_kind"
KEY_GROUP_COLUMN = "__sb_key_group"
SUBTASK_COLUMN = "__sb_subtask"
SEQUENCE_COLUMN = "__sb_seq"
INITIAL_PREFIX = "__sb_init_"
CONTROL, INITIAL, INPUT = 0, 1, 2
"""Row kinds: the subtask's control row, an initial-state row, an input row."""

OUTPUT_BATCH_ROWS = 10_000


@dataclass(frozen=True)
class ProcessorSpec:
    """What every keyed subtask of a stream runs, the same for all batches."""

    processor: StatefulProcessor
    use_pandas: bool
    time_mode: str
    key_columns: tuple[str, ...]
    input_columns: tuple[str, ...]
    initial_columns: tuple[str, ...]
    """The initial-state DataFrame's columns (carried as ``INITIAL_PREFIX + name``)."""
    output_schema_json: str
    catalog: SchemaCatalog
    event_time_column: str | None = None

    @property
    def output_schema(self) -> StructType:
        """The declared output schema."""
        return StructType.fromJson(json.loads(self.output_schema_json))


class KeyedFunctionProcessor(StatefulProcessor):
    """Runs our ``KeyedFunction`` as a StatefulProcessor: ``open`` in ``init`` (on
    executors), ``process(key, rows, ctx)`` per key with the key (a tuple of the key
    columns) and its Rows as a list. ``ctx.subtask`` and ``ctx.batch_id`` are -1 here."""

    def __init__(self, function: KeyedFunction) -> None:
        self.function = function
        self._ctx: KeyedContext | None = None

    def init(self, handle: Any) -> None:
        """Open the function over the handle's backend (nothing on the driver)."""
        if handle.backend is None:
            return
        self._ctx = KeyedContext(handle.backend, subtask=-1, batch_id=-1)
        self.function.open(self._ctx)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        """All rows of ``key`` in this batch, through ``process``."""
        assert self._ctx is not None
        yield from self.function.process(key, list(rows), self._ctx)


def checkpointed_part(processor: StatefulProcessor) -> CheckpointedFunction | None:
    """The part of ``processor`` that keeps operator state (``function_state``): the
    processor itself, or the KeyedFunction a ``KeyedFunctionProcessor`` runs, if it is a
    CheckpointedFunction (or ListCheckpointed, wrapped); None if it keeps none."""
    user = processor.function if isinstance(processor, KeyedFunctionProcessor) else processor
    return as_checkpointed_function(user)


def _key_runs(
    batches: Iterable[pa.RecordBatch],
    key_columns: tuple[str, ...],
    prefetch: Callable[[Iterable[tuple[Any, ...]]], None],
) -> Iterator[tuple[tuple[Any, ...], int, pa.RecordBatch, int, int]]:
    """(key, kind, batch, start, stop) for each run of rows with the same key and kind,
    in order: rows ``start:stop`` of ``batch``. The keys of each batch's initial-state
    and input rows go to ``prefetch`` before its first run."""
    for batch in batches:
        if batch.num_rows == 0:
            continue
        keys = list(zip(*(batch.column(name).to_pylist() for name in key_columns), strict=True))
        kinds = batch.column(KIND_COLUMN).to_pylist()
        read = (key for key, kind in zip(keys, kinds, strict=True) if kind != CONTROL)
        prefetch(dict.fromkeys(read))
        start = 0
        key, kind = keys[0], kinds[0]
        for end in range(1, batch.num_rows):
            if keys[end] != key or kinds[end] != kind:
                yield key, kind, batch, start, end
                start, key, kind = end, keys[end], kinds[end]
        yield key, kind, batch, start, batch.num_rows


class OutputBuilder:
    """Collects a processor's output (Rows/tuples/dicts or pandas DataFrames) into Arrow
    record batches of the output schema; a value that does not fit names its column."""

    def __init__(self, schema: StructType) -> None:
        from pyspark.sql.pandas.types import to_arrow_schema

        self.schema = schema
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")
        self.names = [field.name for field in schema.fields]
        self._rows: list[tuple[Any, ...]] = []

    def add_rows(self, rows: Iterable[Any]) -> Iterator[pa.RecordBatch]:
        """Take Row-mode output; yield full record batches as they fill up."""
        width = len(self.names)
        names = self.names
        for row in rows:
            if type(row) is Row and getattr(row, "__fields__", None) == names:
                self._rows.append(tuple(row))  # the common case: Row(**fields) in order
            elif isinstance(row, Row) and hasattr(row, "__fields__"):
                values = row.asDict(recursive=False)
                missing = [name for name in self.names if name not in values]
                if missing:
                    raise OutputSchemaError(
                        f"output row {row!r} has no column {missing[0]!r} of the output "
                        f"schema {self.names}: return Rows with the output schema's fields"
                    )
                self._rows.append(tuple(values[name] for name in self.names))
            elif isinstance(row, dict):
                self._rows.append(tuple(row.get(name) for name in self.names))
            elif isinstance(row, (tuple, list)) and len(row) == width:
                self._rows.append(tuple(row))
            else:
                raise OutputSchemaError(
                    f"output row {row!r} does not fit the output schema {self.names}: "
                    f"return Rows (or tuples) with {width} fields"
                )
            if len(self._rows) >= OUTPUT_BATCH_ROWS:
                yield self.flush()

    def add_frames(self, frames: Iterable[Any]) -> Iterator[pa.RecordBatch]:
        """Take pandas-mode output (DataFrames); yield one record batch per DataFrame."""
        for frame in frames:
            if len(frame) == 0:
                continue
            by_name = all(isinstance(label, str) for label in frame.columns)
            arrays = []
            for position, field in enumerate(self.arrow_schema):
                if by_name and field.name not in frame.columns:
                    raise OutputSchemaError(
                        f"output DataFrame has no column {field.name!r} of the output schema "
                        f"{self.names} (it has {list(frame.columns)}): return those columns"
                    )
                series = frame[field.name] if by_name else frame.iloc[:, position]
                arrays.append(self._column(field, pa.Array.from_pandas, series))
            yield pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)

    @staticmethod
    def _column(field: pa.Field, convert: Callable[..., pa.Array], values: Any) -> pa.Array:
        try:
            return convert(values, type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
            raise OutputSchemaError(
                f"output column {field.name!r} does not fit its type {field.type}: {exc}"
            ) from exc

    def flush(self) -> pa.RecordBatch:
        """The collected Row-mode output as one record batch (and forget it)."""
        rows, self._rows = self._rows, []
        columns = list(zip(*rows, strict=True)) if rows else [() for _ in self.names]
        arrays = [
            self._column(field, pa.array, values)
            for field, values in zip(self.arrow_schema, columns, strict=True)
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)


def _table_rows(table: pa.Table) -> Iterator[Row]:
    """The table's rows as ``Row`` objects with its column names."""
    row_type = Row(*table.column_names)
    columns = [column.to_pylist() for column in table.columns]
    return (row_type(*values) for values in zip(*columns, strict=True))


def _batch_rows(batch: pa.RecordBatch, names: list[str]) -> list[Row]:
    """Every row of ``batch`` as a ``Row`` of the columns ``names``, equal to what
    ``Row(*names)(*values)`` makes, built without its per-row Python calls."""
    row_type = Row(*names)
    new_tuple = tuple.__new__
    rows = []
    for values in zip(*(batch.column(name).to_pylist() for name in names), strict=True):
        row = new_tuple(Row, values)
        row.__dict__["__fields__"] = row_type
        rows.append(row)
    return rows


Run = tuple[pa.RecordBatch, int, int]
"""Rows ``start:stop`` of an Arrow record batch."""


class _Inputs:
    """Turns a key's runs of rows into what the processor takes (Rows or DataFrames).
    Row mode converts each Arrow batch to Rows once, when its first run is asked for."""

    def __init__(self, spec: ProcessorSpec) -> None:
        self._spec = spec
        self._initial_names = [INITIAL_PREFIX + name for name in spec.initial_columns]
        self._rows_of: pa.RecordBatch | None = None
        self._rows: list[Row] = []

    @staticmethod
    def _select(run: Run, names: list[str], as_names: list[str]) -> pa.Table:
        batch, start, stop = run
        piece = batch.slice(start, stop - start).select(names)
        return pa.Table.from_batches([piece]).rename_columns(as_names)

    def input_rows(self, runs: list[Run]) -> Iterator[Any]:
        """The key's input rows: Rows, or one DataFrame per run (pandas mode)."""
        names = list(self._spec.input_columns)
        for run in runs:
            if self._spec.use_pandas:
                yield self._select(run, names, names).to_pandas()
                continue
            batch, start, stop = run
            if batch is not self._rows_of:
                self._rows_of, self._rows = batch, _batch_rows(batch, names)
            yield from self._rows[start:stop]

    def initial_states(self, runs: list[Run]) -> Iterator[Any]:
        """The key's initial-state rows: one Row each, or one DataFrame (pandas mode)."""
        if not runs:
            return
        names = list(self._spec.initial_columns)
        table = pa.concat_tables([self._select(run, self._initial_names, names) for run in runs])
        if self._spec.use_pandas:
            yield table.to_pandas()
        else:
            yield from _table_rows(table)


def _drop_late_events(
    batches: Iterable[pa.RecordBatch], column: str, watermark_ms: int
) -> Iterator[pa.RecordBatch]:
    """Input rows whose event time is at or below the watermark are dropped (as Spark
    does in EventTime mode); control and initial-state rows are kept."""
    for batch in batches:
        event_time = batch.column(column)
        if pa.types.is_timestamp(event_time.type):
            event_ms = pc.divide(pc.cast(pc.cast(event_time, pa.timestamp("us")), pa.int64()), 1000)
        else:
            event_ms = pc.cast(event_time, pa.int64())
        late = pc.and_(
            pc.equal(batch.column(KIND_COLUMN), INPUT),
            pc.fill_null(pc.less_equal(event_ms, watermark_ms), False),
        )
        yield batch.filter(pc.invert(late))


@dataclass
class SubtaskCounts:
    """What one keyed subtask's batch touched, counted as it runs."""

    keys: int = 0
    """Distinct keys with input or initial-state rows (the processor ran for them)."""


def run_keyed_subtask(
    spec: ProcessorSpec,
    backend: KeyedStateBackend,
    times: BatchTimes,
    batches: Iterable[pa.RecordBatch],
    timer_service: TimerService | None = None,
    counts: SubtaskCounts | None = None,
) -> Iterator[pa.RecordBatch]:
    """Run one keyed subtask of one batch (see the module docstring); yield its output,
    counting into ``counts`` (if given) as it goes."""
    processor = spec.processor
    handle = ProcessorHandle(
        time_mode=spec.time_mode, catalog=spec.catalog, backend=backend, timers=timer_service
    )
    timer_values = times.timer_values(spec.time_mode)
    output = OutputBuilder(spec.output_schema)
    emit = output.add_frames if spec.use_pandas else output.add_rows
    inputs = _Inputs(spec)

    processor.init(handle)
    handle.phase = Phase.INITIALIZED
    if spec.time_mode == "EventTime" and spec.event_time_column is not None:
        batches = _drop_late_events(batches, spec.event_time_column, times.late_events_watermark_ms)
    # One batch of state accesses: each Arrow batch's keys are read ahead by multi-get,
    # and the writes go to the database at once when the keys and timers are done.
    with backend.batch():
        key_runs = _key_runs(batches, spec.key_columns, backend.prefetch)
        for key, runs in groupby(key_runs, key=lambda run: run[0]):
            by_kind: dict[int, list[Run]] = {CONTROL: [], INITIAL: [], INPUT: []}
            for _, kind, batch, start, stop in runs:
                by_kind[kind].append((batch, start, stop))
            if not by_kind[INITIAL] and not by_kind[INPUT]:
                continue  # the control row
            if counts is not None:
                counts.keys += 1
            backend.set_current_key(key)
            for initial_state in inputs.initial_states(by_kind[INITIAL]):
                processor.handleInitialState(key, initial_state, timer_values)
            if by_kind[INPUT]:
                rows = inputs.input_rows(by_kind[INPUT])
                yield from emit(processor.handleInputRows(key, rows, timer_values) or ())

        handle.phase = Phase.DATA_PROCESSED
        yield from _fire_timers(spec, handle, times, timer_service, emit)
    handle.phase = Phase.TIMER_PROCESSED
    processor.close()
    handle.phase = Phase.CLOSED
    if not spec.use_pandas:
        yield output.flush()


def _fire_timers(
    spec: ProcessorSpec,
    handle: ProcessorHandle,
    times: BatchTimes,
    timer_service: TimerService | None,
    emit: Callable[[Iterable[Any]], Iterator[pa.RecordBatch]],
) -> Iterator[pa.RecordBatch]:
    """Due timers in ascending expiry order, through ``handleExpiredTimer``; the handler
    sees its own timer as registered (``ProcessorHandle.expiring``), as in Spark."""
    if spec.time_mode == "None" or timer_service is None:
        return
    timer_values = times.timer_values(spec.time_mode)
    fired: list[pa.RecordBatch] = []

    def on_timer(key: Any, timestamp_ms: int) -> None:
        assert handle.backend is not None
        handle.backend.set_current_key(key)
        handle.expiring = timestamp_ms
        try:
            result = spec.processor.handleExpiredTimer(
                key, timer_values, ExpiredTimerInfo(timestamp_ms)
            )
            fired.extend(emit(result or ()))
        finally:
            handle.expiring = None

    if spec.time_mode == "ProcessingTime":
        timer_service.advance_processing_time(times.batch_timestamp_ms, on_timer)
    else:
        timer_service.advance_watermark(times.eviction_watermark_ms, on_timer)
    yield from fired
