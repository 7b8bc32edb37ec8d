"""One keyed subtask of one micro-batch: a StatefulProcessor over Arrow record batches.

The Spark side (``arrow_path.py``) hands ``run_keyed_subtask`` the subtask's rows as
Arrow record batches sorted by (key group, key, kind, arrival): first one control row
(so that a subtask without input still runs its timers), then per key its initial-state
rows (batch 0 only) and its input rows. The runner, as Spark's transformWithState does:

1. calls ``init(handle)``;
2. per key: ``handleInitialState`` once per initial-state row (pandas mode: once per
   DataFrame of its rows), then ``handleInputRows(key, rows, timerValues)`` (Row mode: an
   iterator of ``Row``; pandas mode: of DataFrames, as Spark chunks a key's rows: at most
   ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows each) if the key has input
   rows left after dropping late events (EventTime: event time <= the late-events
   watermark);
3. fires due timers in ascending expiry order (``handleExpiredTimer``): expiry <= batch
   timestamp (ProcessingTime) or <= the eviction watermark (EventTime); a timer that a
   handler registers at an expiry already due fires in the next batch, as in Spark;
4. TTL: expired values are never returned (their expiry is computed from the batch
   timestamp); removing them physically is left to compaction;
5. calls ``close()``;

and returns the processor's output as Arrow record batches of the output schema. Keys
are tuples of the key columns, as in Spark.
"""

from __future__ import annotations

import gc
import json
import reprlib
import time

# What namedtuple's fields are: a C descriptor (a property where there is no C version).
from collections import _tuplegetter  # type: ignore[attr-defined]
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from functools import partial
from itertools import chain
from operator import eq, ne
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pandas.api.types import is_integer_dtype
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, StatefulProcessor
from pyspark.sql.types import StructType

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.stores import CurrentKey
from statebackend.errors import OutputSchemaError, SerializationError
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.api import KeyedContext, KeyedFunction
from statebackend.spark.arrow_keys import murmur3_32, serialized_keys
from statebackend.spark.pandas_times import (
    nested_value,
    pandas_frame,
    session_local_key,
    session_wall_time,
    sliceable_frame,
    utc_series,
)
from statebackend.spark.processor_handle import (
    BatchTimes,
    Phase,
    ProcessorHandle,
    SchemaCatalog,
    nested_row,
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

UNLIMITED_BYTES = 2**31 - 1
"""``max_bytes_per_batch`` that sets no limit (Spark's too)."""

_NUMPY_KINDS = frozenset("biufmMO")
"""The NumPy dtype kinds whose pandas-mode output columns of many frames are converted at
once: Arrow converts each value of them by itself (bools, ints, floats, timedeltas,
datetimes, Python objects)."""

_CONVERSION_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError)
"""What Arrow raises for output values that do not fit their column's type."""

OUTPUT_BATCH_ROWS = 10_000
YOUNG_COLLECTION_OBJECTS = 500_000
"""New objects between two young collections of the garbage collector during a batch:
a 100k-row batch then runs at most one (at 100,000, two or three, each walking the
young objects: ~3% of the subtask's CPU time)."""


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
    time_zone: str = "UTC"
    """The session time zone: pandas mode shows timestamps as its wall times
    (``pandas_times``)."""
    initial_key_columns: tuple[str, ...] = ()
    """The initial-state columns holding the key columns, in key order (empty: the key
    columns' own names)."""
    max_records_per_batch: int = 10_000
    """Pandas mode: the most rows of a key in one DataFrame that ``handleInputRows`` (or
    ``handleInitialState``) gets, as Spark chunks them
    (``spark.sql.execution.arrow.maxRecordsPerBatch``; 0 or less: no limit)."""
    max_bytes_per_batch: int = UNLIMITED_BYTES
    """Pandas mode: a key's DataFrames also end where their rows reach this many bytes at
    the average size of the rows seen so far, as Spark bounds them
    (``spark.sql.execution.arrow.maxBytesPerBatch``; ``UNLIMITED_BYTES``: no limit)."""
    int_to_decimal: bool = False
    """Pandas mode: an output column of ints fills a decimal column, each int as a
    ``Decimal`` (``spark.sql.execution.pythonUDF.pandas.intToDecimalCoercionEnabled``)."""
    int_extension: bool = False
    """Pandas mode: integer columns keep their width (``int8`` for byte) and one with
    nulls is of NumPy scalars and ``pandas.NA``, integer keys NumPy scalars, as Spark
    makes them (``spark.sql.execution.pythonUDF.pandas.preferIntExtensionDtype``)."""
    output_by_name: bool = True
    """Pandas mode: output frames' columns labelled by strings are taken by name, else by
    position (``spark.sql.legacy.execution.pandas.groupedMap.assignColumnsByName``)."""
    safe_conversion: bool = True
    """Pandas mode: an output value that a cast would change (a fraction into an integer
    column, an integer too big for its type) does not fit; else it is cast as Arrow casts
    unsafely (``spark.sql.execution.pandas.convertToArrowArraySafely``)."""

    @property
    def output_schema(self) -> StructType:
        """The declared output schema."""
        return StructType.fromJson(json.loads(self.output_schema_json))


class KeyedFunctionProcessor(StatefulProcessor):
    """Runs our ``KeyedFunction`` as a StatefulProcessor: ``open`` in ``init`` (on
    executors), ``process(key, rows, ctx)`` per key with its Rows as a list and the key as
    ``StatefulJob`` gives it: with ``single_key`` (``key_by`` named one column) the key
    column's value, else the tuple of the key columns. ``ctx.subtask`` and
    ``ctx.batch_id`` are -1 here."""

    def __init__(self, function: KeyedFunction, single_key: bool = False) -> None:
        self.function = function
        self.single_key = single_key
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
        yield from self.function.process(key[0] if self.single_key else key, list(rows), self._ctx)


KEYED_FUNCTION_METHODS = {"init": "open", "handleInputRows": "process"}
"""The KeyedFunction method each method of a ``KeyedFunctionProcessor`` runs."""


def user_method(processor: StatefulProcessor, method: str) -> str:
    """``Class.method`` of the user's code that ``processor.<method>`` runs: the
    KeyedFunction's own method for a ``KeyedFunctionProcessor`` (what a failure names)."""
    if isinstance(processor, KeyedFunctionProcessor):
        return f"{type(processor.function).__name__}.{KEYED_FUNCTION_METHODS.get(method, method)}"
    return f"{type(processor).__name__}.{method}"


def checkpointed_part(processor: StatefulProcessor) -> CheckpointedFunction | None:
    """The part of ``processor`` that keeps operator state (``function_state``): the
    processor itself, or the KeyedFunction a ``KeyedFunctionProcessor`` runs, if it is a
    CheckpointedFunction (or ListCheckpointed, wrapped); None if it keeps none."""
    user = processor.function if isinstance(processor, KeyedFunctionProcessor) else processor
    return as_checkpointed_function(user)


Run = tuple[pa.RecordBatch, int, int]
"""Rows ``start:stop`` of an Arrow record batch."""

_NO_KEY = object()
"""The key before the first row (equal to no key)."""


def _changes(column: pa.Array) -> pa.Array | None:
    """Per row but the first, whether it differs from the row before (nulls equal each
    other only); None if Arrow cannot compare the column's type."""
    after, before = column.slice(1), column.slice(0, len(column) - 1)
    try:
        differs = pc.not_equal(after, before)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    if pa.types.is_floating(column.type):  # NaN keys are one key, as Spark groups them
        differs = pc.and_not(differs, pc.and_(pc.is_nan(after), pc.is_nan(before)))
    if column.null_count:
        differs = pc.fill_null(differs, pc.xor(pc.is_null(after), pc.is_null(before)))
    return differs


def _run_starts(batch: pa.RecordBatch, columns: tuple[str, ...]) -> list[int]:
    """The rows of ``batch`` that start a run of equal ``columns`` values, in order (row 0
    first), compared by Arrow; by Python equality of the rows' values for a column of a
    type Arrow cannot compare (lists, maps, structs)."""
    size = batch.num_rows
    changed = np.zeros(size - 1, dtype=bool)
    for name in columns:
        column = batch.column(name)
        differs = _changes(column)
        if differs is None:
            values = column.to_pylist()
            changed |= np.fromiter(map(ne, values[1:], values[:-1]), dtype=bool, count=size - 1)
        else:
            changed |= differs.to_numpy(zero_copy_only=False)
    return [0, *(np.flatnonzero(changed) + 1).tolist()]


ReadAhead = Callable[[list[tuple[Any, ...]], pa.RecordBatch], "list[CurrentKey] | None"]
"""Reads ahead keys (with the rows they come from): their records, or None."""


def _read_ahead_of(backend: KeyedStateBackend, key_columns: tuple[str, ...]) -> ReadAhead:
    """``backend.read_ahead`` of keys, given their serialized bytes and key groups
    computed from their Arrow rows at once (``arrow_keys``) where the backend's key
    serializer is a ``RowTupleSerializer`` (the one ``transform_with_state`` keys by)."""
    serializer = backend.key_serializer
    if not isinstance(serializer, RowTupleSerializer):
        return lambda keys, rows: backend.read_ahead(keys)
    schema_json, max_parallelism = serializer.schema_json, backend.max_parallelism

    def read_ahead(keys: list[tuple[Any, ...]], rows: pa.RecordBatch) -> list[CurrentKey] | None:
        try:
            encoded = serialized_keys(rows, key_columns, schema_json)
            groups = murmur3_32(encoded).astype(np.int64) % max_parallelism
        except Exception:  # the backend encodes the keys itself, raising its clear errors
            return backend.read_ahead(keys)
        return backend.read_ahead(keys, (encoded.to_pylist(), groups.tolist()))

    return read_ahead


class _Block(NamedTuple):
    """Keys of one record batch that each have exactly one run of rows, an input run, in
    that batch, and no rows elsewhere: the common case, run without a step per key of
    ``_keys`` (``run_keyed_subtask``)."""

    batch: pa.RecordBatch
    keys: list[tuple[Any, ...]]
    records: list[CurrentKey | None]
    starts: list[int]
    stops: list[int]


KeyRuns = tuple[tuple[Any, ...], CurrentKey | None, list[Run], list[Run]]
"""A key, its current-key record or None, its initial-state runs and its input runs."""


def _keys(
    batches: Iterable[pa.RecordBatch],
    key_columns: tuple[str, ...],
    read_ahead: ReadAhead,
    blocks: bool = False,
) -> Iterator[KeyRuns | _Block]:
    """(key, its current-key record or None, its initial-state runs, its input runs) for
    each key with such rows, in order; a key's rows may span record batches, control rows
    are left out. The keys of each batch's initial-state and input runs go to
    ``read_ahead`` before its first key, which gives their records (or None).

    With ``blocks``, the keys of a record batch that have one input run there and no
    other rows (all but a batch's first and last input runs, when no control or
    initial-state run follows them in the batch) come as one ``_Block`` instead, in
    their place in the order.

    Runs (rows of one key and kind) are found by Arrow; only their first rows' keys
    become Python tuples. A key's record is the one read ahead for that very key object
    (equal keys may be encoded differently: 0.0 and -0.0)."""
    key: Any = _NO_KEY
    record: CurrentKey | None = None
    initial: list[Run] = []
    inputs: list[Run] = []
    for batch in batches:
        size = batch.num_rows
        if size == 0:
            continue
        starts = _run_starts(batch, (*key_columns, KIND_COLUMN))
        firsts = batch.take(pa.array(starts, pa.int64()))
        columns = (_key_values(firsts.column(name), name) for name in key_columns)
        keys = list(zip(*columns, strict=True))
        kinds = firsts.column(KIND_COLUMN).to_pylist()
        records = _run_records(firsts, keys, kinds, read_ahead)
        stops = starts[1:]
        stops.append(size)
        count = len(keys)
        # Runs [first, count - 1) form a block: input runs whose keys differ (by Python
        # equality, as below) from the keys of the runs before and after them.
        first = _first_of_inputs(firsts, kinds) + 1 if blocks else count
        if first < count - 1 and not any(map(eq, keys[first:], keys[first - 1 : -1])):
            general = range(first)
        else:
            general = range(count)
        for at in general:
            run_key, kind = keys[at], kinds[at]
            if run_key != key:
                if initial or inputs:
                    yield key, record, initial, inputs
                key, record, initial, inputs = run_key, records[at], [], []
            if kind == INPUT:
                inputs.append((batch, starts[at], stops[at]))
            elif kind == INITIAL:
                initial.append((batch, starts[at], stops[at]))
        if len(general) < count:
            if initial or inputs:  # the key of run first - 1 (an input run) ends there
                yield key, record, initial, inputs
            last = count - 1
            yield _Block(
                batch, keys[first:last], records[first:last], starts[first:last], stops[first:last]
            )
            key, record, initial = keys[last], records[last], []
            inputs = [(batch, starts[last], stops[last])]
    if initial or inputs:
        yield key, record, initial, inputs


def _first_of_inputs(firsts: pa.RecordBatch, kinds: list[int]) -> int:
    """The first run (``firsts``: each run's first row) of the input runs that end a
    batch: the run after its last control or initial-state run."""
    if kinds.count(INPUT) == len(kinds):
        return 0
    other = pc.not_equal(firsts.column(KIND_COLUMN), INPUT).to_numpy(zero_copy_only=False)
    return int(np.flatnonzero(other)[-1]) + 1


_NAN = float("nan")
"""The one NaN of keys: tuples holding it are equal (Python compares identity first),
so that a NaN key is one key, as Spark groups NaN keys (``with_key_groups`` gives them
one bit pattern)."""


def _key_values(column: pa.Array, name: str) -> list[Any]:
    """Key column ``name``'s values as Python, every NaN ``_NAN``; SerializationError
    naming it for a string that is not UTF-8 (Spark holds such strings as bytes)."""
    try:
        values = column.to_pylist()
    except UnicodeDecodeError as exc:
        raise SerializationError(
            f"key column {name!r} holds a string that is not valid UTF-8 ({exc}): key by "
            f"it as binary (CAST({name} AS BINARY)) or repair the strings"
        ) from exc
    if pa.types.is_floating(column.type) and pc.any(pc.is_nan(column)).as_py():
        return [_NAN if value != value else value for value in values]
    return values


def _run_records(
    firsts: pa.RecordBatch,
    keys: list[tuple[Any, ...]],
    kinds: list[int],
    read_ahead: ReadAhead,
) -> list[CurrentKey | None]:
    """Per run (``firsts``: each run's first row), the record ``read_ahead`` gives for
    its key (None for control runs, and for all runs where it gives none)."""
    if CONTROL not in kinds:
        records = read_ahead(keys, firsts)
        return [None] * len(keys) if records is None else list(records)
    wanted = [run_key for run_key, kind in zip(keys, kinds, strict=True) if kind != CONTROL]
    found = read_ahead(wanted, firsts.filter(pc.not_equal(firsts.column(KIND_COLUMN), CONTROL)))
    if found is None:
        return [None] * len(keys)
    given = iter(found)
    return [None if kind == CONTROL else next(given) for kind in kinds]


def output_arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema of a processor's output rows, staged and shuffled as they are
    (timestamps as UTC instants, as Spark's Arrow exchange carries them)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


class OutputBuilder:
    """Collects a processor's output (Rows/tuples/dicts or pandas DataFrames) into Arrow
    record batches of the output schema (``ready``, taken with ``take_ready``); a value
    that does not fit names its column."""

    def __init__(
        self,
        schema: StructType,
        time_zone: str = "UTC",
        int_to_decimal: bool = False,
        safe: bool = True,
        by_name: bool = True,
    ) -> None:
        self.schema = schema
        self.time_zone = time_zone
        """Naive timestamps of pandas-mode output are wall times of this zone."""
        self.int_to_decimal = int_to_decimal
        """Whether a pandas column of ints fills a decimal column (each int a Decimal)."""
        self.safe = safe
        """Whether pandas-mode output values a cast would change do not fit (else cast)."""
        self.by_name = by_name
        """Whether pandas-mode output columns are taken by name where labelled (else by
        position)."""
        self.arrow_schema = output_arrow_schema(schema)
        self.names = [field.name for field in schema.fields]
        self._struct_fillers = {
            position: filler
            for position, field in enumerate(self.arrow_schema)
            if (filler := _struct_filler(field.type)) is not None
        }
        """The columns with a struct inside, and how to fill their structs as Spark does."""
        self._rows: list[tuple[Any, ...]] = []
        """Row-mode output not in a record batch yet (``Row``s are tuples of the values)."""
        self._frames: list[list[np.ndarray]] = []
        """Pandas-mode output not in a record batch yet: per DataFrame, a copy of each
        output column's values, all of the dtypes ``_frames_dtypes``."""
        self._frames_dtypes: tuple[np.dtype, ...] = ()
        self._frames_rows = 0
        self.ready: list[pa.RecordBatch] = []
        """Full record batches not taken yet."""

    def take_ready(self) -> list[pa.RecordBatch]:
        """The full record batches collected so far (and forget them)."""
        ready = self.ready[:]
        self.ready.clear()  # the same list stays ``ready``: the runner holds it
        return ready

    def add_rows(self, rows: Iterable[Any]) -> None:
        """Take Row-mode output; each 10,000 rows become a record batch in ``ready``."""
        names = self.names
        collected = self._rows
        for row in rows:
            if type(row) is Row and getattr(row, "__fields__", None) == names:
                collected.append(row)  # the common case: Row(**fields) in order, a tuple
            else:
                collected.append(self._values(row))
            if len(collected) >= OUTPUT_BATCH_ROWS:
                self.ready.append(self.flush())
                collected = self._rows

    def _values(self, row: Any) -> tuple[Any, ...]:
        """The output schema's values of one Row-mode output row of any accepted form."""
        if isinstance(row, Row) and hasattr(row, "__fields__"):
            values = row.asDict(recursive=False)
            missing = [name for name in self.names if name not in values]
            if missing:
                raise OutputSchemaError(
                    f"output row {row!r} has no column {missing[0]!r} of the output "
                    f"schema {self.names}: return Rows with the output schema's fields"
                )
            return tuple(values[name] for name in self.names)
        if isinstance(row, dict):
            return tuple(row.get(name) for name in self.names)
        if isinstance(row, (tuple, list)) and len(row) == len(self.names):
            return tuple(row)
        raise OutputSchemaError(
            f"output row {row!r} does not fit the output schema {self.names}: "
            f"return Rows (or tuples) with {len(self.names)} fields"
        )

    def add_frames(self, frames: Iterable[Any]) -> None:
        """Take pandas-mode output (DataFrames). Consecutive frames whose output columns
        have the same NumPy dtypes are converted together, each 10,000 rows (or at
        ``finish_frames``) into a record batch in ``ready``; a frame with another dtype
        (an extension dtype such as ``Int64``, a zone-aware timestamp) into its own."""
        for frame in frames:
            if len(frame) == 0:
                continue
            positions = self._output_positions(frame)
            # The column's array as its block holds it: ``frame[name]`` of a frame just
            # made costs ~25 µs a column (pandas builds and caches a Series), this ~2.
            arrays = [frame._get_column_array(position) for position in positions]
            dtypes = tuple(array.dtype for array in arrays)
            if not all(
                isinstance(dtype, np.dtype) and dtype.kind in _NUMPY_KINDS for dtype in dtypes
            ):
                self.finish_frames()
                self.ready.append(self._frame_batch([frame.iloc[:, p] for p in positions]))
                continue
            if dtypes != self._frames_dtypes:
                self.finish_frames()
                self._frames_dtypes = dtypes
            # Copies: the processor may change a DataFrame after yielding it.
            self._frames.append([np.array(array) for array in arrays])
            self._frames_rows += len(frame)
            if self._frames_rows >= OUTPUT_BATCH_ROWS:
                self.finish_frames()

    def finish_frames(self) -> None:
        """Convert the pandas-mode output taken so far into a record batch in ``ready``.
        A column that does not convert as a whole is converted frame by frame, as Spark
        converts each DataFrame: what fits, how, and which error names which value."""
        frames, self._frames, self._frames_rows = self._frames, [], 0
        if not frames:
            return
        # The frames' dtypes: pandas infers datetime64 for an object array of datetimes.
        columns = [
            pd.Series(np.concatenate(values) if len(values) > 1 else values[0], dtype=dtype)
            for values, dtype in zip(zip(*frames, strict=True), self._frames_dtypes, strict=True)
        ]
        try:
            arrays = [
                self._from_pandas(series, self.arrow_schema.field(position).type)
                for position, series in enumerate(columns)
            ]
        except _CONVERSION_ERRORS:
            for values in frames:
                series = [pd.Series(column, dtype=column.dtype) for column in values]
                self.ready.append(self._frame_batch(series))
            return
        self.ready.append(pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema))

    def _output_positions(self, frame: pd.DataFrame) -> list[int]:
        """Where the output schema's columns are in a pandas-mode output frame: by name if
        any of its column labels is a string (and ``by_name``), as Spark takes them, else
        by position."""
        labels = frame.columns.tolist()
        if labels == self.names:
            return list(range(len(labels)))
        if not self.by_name or not any(isinstance(label, str) for label in labels):
            if len(labels) < len(self.names):
                raise OutputSchemaError(
                    f"output DataFrame has {len(labels)} columns, the output schema "
                    f"{self.names} {len(self.names)}: return a column for each"
                )
            return list(range(len(self.names)))
        missing = [name for name in self.names if name not in labels]
        if missing:
            raise OutputSchemaError(
                f"output DataFrame has no column {missing[0]!r} of the output schema "
                f"{self.names} (it has {labels}): return those columns"
            )
        return [labels.index(name) for name in self.names]

    def _frame_batch(self, columns: list[pd.Series]) -> pa.RecordBatch:
        """One output frame's columns as a record batch."""
        arrays = [
            self._column(position, self._from_pandas, series)
            for position, series in enumerate(columns)
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)

    def _from_pandas(self, series: Any, type: pa.DataType) -> pa.Array:
        """A pandas-mode output column as Arrow of ``type``, converted as Spark does:
        values Arrow does not take as that type directly (e.g. the text ``"2"`` for a
        long) are taken as they are and cast, safely unless ``safe`` is off."""
        if pa.types.is_timestamp(type) and type.tz is not None:
            series = utc_series(series, self.time_zone)
        if self.int_to_decimal and pa.types.is_decimal(type) and is_integer_dtype(series.dtype):
            series = series.apply(lambda value: None if pd.isna(value) else Decimal(int(value)))
        try:
            return pa.Array.from_pandas(series, type=type, safe=self.safe)
        except pa.ArrowInvalid:
            return pa.Array.from_pandas(series).cast(type, safe=self.safe)

    def _column(self, position: int, convert: Callable[..., pa.Array], values: Any) -> pa.Array:
        """Output column ``position`` as Arrow: ``convert`` (``pa.array``, ``_from_pandas``)
        of its ``values`` (a list, a pandas Series)."""
        try:
            return convert(values, type=self.arrow_schema.field(position).type)
        except _CONVERSION_ERRORS as exc:
            raise self._misfit(position, convert, values, exc) from exc

    def _misfit(
        self, position: int, convert: Callable[..., pa.Array], values: Any, exc: Exception
    ) -> OutputSchemaError:
        """The error of output column ``position`` that ``convert`` failed on: it names the
        column, its Spark type and its first value that does not fit."""
        name = self.names[position]
        spark_type = self.schema.fields[position].dataType.simpleString()
        arrow_type = self.arrow_schema.field(position).type
        by_position = values.iloc if hasattr(values, "iloc") else values
        shown = values.tolist() if hasattr(values, "tolist") else values  # Python scalars
        for index in range(len(values)):
            try:
                convert(by_position[index : index + 1], type=arrow_type)
            except _CONVERSION_ERRORS:
                value = shown[index]
                return OutputSchemaError(
                    f"output column {name!r} does not fit its type {spark_type}: it got "
                    f"{reprlib.repr(value)} (a {type(value).__name__}); return {spark_type} "
                    f"values there"
                )
        return OutputSchemaError(
            f"output column {name!r} does not fit its type {spark_type}: {exc}"
        )

    def flush(self) -> pa.RecordBatch:
        """The collected Row-mode output as one record batch (and forget it)."""
        rows, self._rows = self._rows, []
        # Lists, not the tuples zip makes: pa.array converts a tuple ~50x slower.
        columns = [list(column) for column in zip(*rows, strict=True)] if rows else None
        for position, fill in self._struct_fillers.items() if columns else ():
            assert columns is not None
            columns[position] = list(map(fill, columns[position]))
        arrays = [
            self._column(position, pa.array, columns[position] if columns else [])
            for position in range(len(self.names))
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema)


def _unchanged(value: Any) -> Any:
    return value


def _struct_filler(data_type: pa.DataType) -> Callable[[Any], Any] | None:
    """A function making values of ``data_type`` Arrow fills structs in as Spark does: a
    named ``Row`` by field name, a plain tuple by position (Arrow alone takes every tuple,
    which a Row is, by position, and never mixes tuples with dicts); None when the type
    holds no struct."""
    if pa.types.is_struct(data_type):
        fields = [data_type.field(i) for i in range(data_type.num_fields)]
        names = [field.name for field in fields]
        inner = [_struct_filler(field.type) or _unchanged for field in fields]

        def struct(value: Any) -> Any:
            if value is None:
                return None
            if isinstance(value, Row) and hasattr(value, "__fields__"):
                value = value.asDict(recursive=False)
            if isinstance(value, dict):
                return {n: fill(value.get(n)) for n, fill in zip(names, inner, strict=True)}
            if isinstance(value, (tuple, list)) and len(value) == len(names):
                return {n: fill(v) for n, fill, v in zip(names, inner, value, strict=True)}
            return value  # Arrow names what does not fit

        return struct
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        element = _struct_filler(data_type.value_type)
        if element is None:
            return None
        return lambda value: value if value is None else [element(item) for item in value]
    if pa.types.is_map(data_type):
        key, item = _struct_filler(data_type.key_type), _struct_filler(data_type.item_type)
        if key is None and item is None:
            return None
        fill_key, fill_item = key or _unchanged, item or _unchanged

        def entries(value: Any) -> Any:
            if value is None:
                return None
            pairs = value.items() if isinstance(value, dict) else value
            return [(fill_key(k), fill_item(v)) for k, v in pairs]

        return entries
    return None


def _row_class(names: list[str]) -> type[Row]:
    """A subclass of ``Row`` for rows of the columns ``names``: ``__fields__`` is a class
    attribute, and each name ``Row.__getattr__`` would answer (not ``__x``, not tuple or Row
    attributes such as ``count``, the first of duplicates) is a C descriptor reading its
    position, as ``collections.namedtuple`` does. A row is then one tuple allocation, and
    ``row.amount`` skips ``Row.__getattr__``'s Python search of ``__fields__``."""
    attributes: dict[str, Any] = {"__slots__": (), "__fields__": Row(*names)}
    for position, name in enumerate(names):
        if not name.startswith("__") and not hasattr(Row, name) and name not in attributes:
            attributes[name] = _tuplegetter(position, None)
    return type("Row", (Row,), attributes)


def _row_maker(names: list[str]) -> Callable[[list[list[Any]]], list[Row]]:
    """A function from column value lists to ``Row``s of the columns ``names``, each
    equal to what ``Row(*names)(*values)`` makes and behaving as it does (``isinstance``,
    fields, attributes, items, ``asDict``, repr, pickling), as instances of
    ``_row_class(names)``."""
    if not names:
        raise ValueError("a Row needs at least one column")
    row_class = _row_class(names)

    def make(columns: list[list[Any]], new: Callable[..., Row] = tuple.__new__) -> list[Row]:
        return [new(row_class, values) for values in zip(*columns, strict=True)]

    return make


class _Inputs:
    """Turns a key's runs of rows into what the processor takes (Rows or DataFrames).
    Row mode converts each Arrow batch to Rows once, when its first run is asked for."""

    def __init__(self, spec: ProcessorSpec) -> None:
        self._spec = spec
        self._input_names = list(spec.input_columns)
        self._initial_names = [INITIAL_PREFIX + name for name in spec.initial_columns]
        self._make_rows = _row_maker(self._input_names)
        self._make_initial_rows = (
            _row_maker(list(spec.initial_columns)) if spec.initial_columns else None
        )
        self._rows_of: pa.RecordBatch | None = None
        self._rows: list[Row] = []
        self._frame_of: pa.RecordBatch | None = None
        self._frame: pd.DataFrame | None = None
        self._sized_of: pa.RecordBatch | None = None
        self._sized_bytes = self._sized_rows = 0
        """The last record batch counted, and the bytes and rows of those counted."""

    @staticmethod
    def _select(run: Run, names: list[str], as_names: list[str]) -> pa.Table:
        batch, start, stop = run
        piece = batch.slice(start, stop - start).select(names)
        return pa.Table.from_batches([piece]).rename_columns(as_names)

    def batch_rows(self, batch: pa.RecordBatch) -> list[Row]:
        """Every row of ``batch`` as a Row of the input columns (the last batch's kept)."""
        if batch is not self._rows_of:
            columns = [batch.column(name).to_pylist() for name in self._input_names]
            self._rows_of, self._rows = batch, self._make_rows(columns)
        return self._rows

    def batch_frame(self, batch: pa.RecordBatch) -> pd.DataFrame | None:
        """The input columns of ``batch`` as one DataFrame whose row slices are the
        frames of its keys, or None where a key's frame must be made from its own rows
        (``sliceable_frame``; the last batch's kept)."""
        if batch is not self._frame_of:
            table = _input_table(batch, self._input_names)
            frame = sliceable_frame(table, self._spec.time_zone, self._spec.int_extension)
            self._frame_of, self._frame = batch, frame
        return self._frame

    def _frames(self, runs: list[Run], names: list[str], as_names: list[str]) -> Iterator[Any]:
        """The rows of ``runs`` (columns ``names`` as ``as_names``) as DataFrames of
        ``_frame_rows`` rows each (the last one fewer), made as they are asked for: as
        Spark chunks a key's rows for a pandas processor."""
        size = self._frame_rows(runs)
        if names is self._input_names and len(runs) == 1:  # most keys: a slice of a frame
            batch, start, stop = runs[0]
            whole = self.batch_frame(batch) if size <= 0 or stop - start <= size else None
            if whole is not None:
                yield whole.iloc[start:stop].reset_index(drop=True)  # a copy, as Spark's
                return
        table = pa.concat_tables([self._select(run, names, as_names) for run in runs])
        step = size if size > 0 else max(table.num_rows, 1)
        for offset in range(0, table.num_rows, step):
            rows = table.slice(offset, step)
            yield pandas_frame(rows, self._spec.time_zone, self._spec.int_extension)

    def _frame_rows(self, runs: list[Run]) -> int:
        """The most rows of one DataFrame of ``runs`` (0: no limit): ``max_records_per_batch``,
        and, as Spark bounds them by ``max_bytes_per_batch``, the fewest rows that reach it
        at the average size of the rows of the record batches so far (their input and
        initial-state columns' Arrow buffers; Spark's batches hold the key and input
        columns)."""
        size = self._spec.max_records_per_batch
        if self._spec.max_bytes_per_batch >= UNLIMITED_BYTES:
            return size
        for batch, _, _ in runs:
            if batch is not self._sized_of:
                self._sized_of = batch
                names = self._input_names + self._initial_names
                present = [name for name in names if batch.schema.get_field_index(name) >= 0]
                self._sized_bytes += batch.select(present).nbytes
                control = pc.sum(pc.equal(batch.column(KIND_COLUMN), CONTROL)).as_py()
                self._sized_rows += batch.num_rows - (control or 0)  # Spark has no such row
        if not self._sized_bytes:
            return size
        limit = max(1, -(-self._spec.max_bytes_per_batch * self._sized_rows // self._sized_bytes))
        return limit if size <= 0 else min(size, limit)

    def input_rows(self, runs: list[Run]) -> Iterator[Any]:
        """The key's input rows: Rows, or DataFrames of at most ``max_records_per_batch``
        rows (pandas mode)."""
        if self._spec.use_pandas:
            return self._frames(runs, self._input_names, self._input_names)
        if len(runs) == 1:  # the common case, once per key: no batch_rows frame
            batch, start, stop = runs[0]
            if batch is self._rows_of:
                return iter(self._rows[start:stop])
            return iter(self.batch_rows(batch)[start:stop])
        return chain.from_iterable(
            self.batch_rows(batch)[start:stop] for batch, start, stop in runs
        )

    def initial_states(self, runs: list[Run]) -> Iterator[Any]:
        """The key's initial-state rows: one Row each, or DataFrames of at most
        ``max_records_per_batch`` rows (pandas mode)."""
        names = list(self._spec.initial_columns)
        if self._spec.use_pandas:
            return self._frames(runs, self._initial_names, names)
        table = pa.concat_tables([self._select(run, self._initial_names, names) for run in runs])
        assert self._make_initial_rows is not None
        return iter(self._make_initial_rows([column.to_pylist() for column in table.columns]))


def _input_table(batch: pa.RecordBatch, names: list[str]) -> pa.Table:
    """The columns ``names`` of ``batch``, where the rows that are not input rows (the
    control row, initial-state rows: null in these columns, and no processor sees them)
    hold a value instead of null in integer and boolean columns: a null there would give
    the column another pandas dtype in every key's frame."""
    table = pa.Table.from_batches([batch.select(names)])
    others = pc.not_equal(batch.column(KIND_COLUMN), INPUT)
    if not pc.any(others).as_py():
        return table
    for position, field in enumerate(table.schema):
        column = table.column(position)
        if column.null_count and (
            pa.types.is_integer(field.type) or pa.types.is_boolean(field.type)
        ):
            stand_in = pa.scalar(False if pa.types.is_boolean(field.type) else 0, field.type)
            table = table.set_column(position, field, pc.if_else(others, stand_in, column))
    return table


def _drop_late_events(
    batches: Iterable[pa.RecordBatch], column: str, watermark_ms: int, counts: SubtaskCounts
) -> Iterator[pa.RecordBatch]:
    """Input rows whose event time is at or below the watermark are dropped (as Spark
    does in EventTime mode), counted into ``counts``; control and initial-state rows are
    kept."""
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
        counts.late_rows += pc.sum(late).as_py() or 0
        yield batch.filter(pc.invert(late))


@dataclass
class SubtaskCounts:
    """What one keyed subtask's batch touched, counted as it runs, and where it is."""

    keys: int = 0
    """Distinct keys with input or initial-state rows (the processor ran for them)."""
    method: str = "init"
    """The processor method running, or the last one run: the one a failure names."""
    late_rows: int = 0
    """Input rows dropped as late (EventTime mode: at or below the watermark)."""
    timers_registered: int = 0
    """``registerTimer`` calls."""
    timers_deleted: int = 0
    """``deleteTimer`` calls (fired timers not included)."""
    timers_fired: int = 0
    """Timers fired (``handleExpiredTimer`` called)."""
    timer_seconds: float = 0.0
    """Seconds spent firing timers."""


@contextmanager
def _batch_collections() -> Iterator[None]:
    """Python's cyclic garbage collector tuned for one batch, restored when it ends: a
    young collection every ``YOUNG_COLLECTION_OBJECTS`` new objects and practically no
    full one. A batch creates and keeps alive hundreds of thousands of small objects
    (Rows, keys, read-ahead state); with the default thresholds the collector walked all
    of them again and again, ~40% of the subtask's CPU time. Cycles made in the batch
    still die in young collections, or at the first full one after the batch."""
    previous = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_OBJECTS, 50, 1000)
    try:
        yield
    finally:
        gc.set_threshold(*previous)


@contextmanager
def _output_errors_first(output: OutputBuilder) -> Iterator[None]:
    """Pandas-mode output the processor yielded before it (or anything) raised is
    converted first: a frame that does not fit is the error, as when each frame was
    converted as it came (Spark converts each frame as the processor yields it)."""
    try:
        yield
    except Exception:
        output.finish_frames()
        raise


def run_keyed_subtask(
    spec: ProcessorSpec,
    backend: KeyedStateBackend,
    times: BatchTimes,
    batches: Iterable[pa.RecordBatch],
    timer_service: TimerService | None = None,
    counts: SubtaskCounts | None = None,
) -> Iterator[pa.RecordBatch]:
    """Run one keyed subtask of one batch (see the module docstring); yield its output,
    counting into ``counts`` (if given) as it goes, with the processor method it is in."""
    processor = spec.processor
    handle = ProcessorHandle(
        time_mode=spec.time_mode, catalog=spec.catalog, backend=backend, timers=timer_service
    )
    timer_values = times.timer_values(spec.time_mode)
    output = OutputBuilder(
        spec.output_schema,
        spec.time_zone,
        spec.int_to_decimal,
        spec.safe_conversion,
        spec.output_by_name,
    )
    emit = output.add_frames if spec.use_pandas else output.add_rows
    inputs = _Inputs(spec)
    if counts is None:
        counts = SubtaskCounts()

    with _batch_collections(), _output_errors_first(output):
        counts.method = "init"
        processor.init(handle)
        handle.phase = Phase.INITIALIZED
        if spec.time_mode == "EventTime" and spec.event_time_column is not None:
            batches = _drop_late_events(
                batches, spec.event_time_column, times.late_events_watermark_ms, counts
            )
        # One batch of state accesses: each Arrow batch's keys are read ahead by multi-get,
        # and the writes go to the database at once when the keys and timers are done.
        with backend.batch():
            # Bound once: this loop runs once per key.
            set_current_key, handle_input_rows = backend.set_current_key, processor.handleInputRows
            input_rows, ready = inputs.input_rows, output.ready
            read_ahead = _read_ahead_of(backend, spec.key_columns)
            shown_key = _shown_key(spec, backend.key_serializer)
            batch_rows = inputs.batch_rows
            runs = _keys(batches, spec.key_columns, read_ahead, blocks=not spec.use_pandas)
            for item in runs:
                if isinstance(item, _Block):  # keys with one input run each (Row mode)
                    rows = batch_rows(item.batch)
                    counts.keys += len(item.keys)
                    counts.method = "handleInputRows"
                    block = zip(item.keys, item.records, item.starts, item.stops, strict=True)
                    for key, record, start, stop in block:
                        set_current_key(key, record)
                        emit(handle_input_rows(key, iter(rows[start:stop]), timer_values) or ())
                        if ready:
                            yield from output.take_ready()
                    continue
                key, record, initial, input_runs = item
                counts.keys += 1
                set_current_key(key, record)
                shown = shown_key(key)
                if initial:
                    counts.method = "handleInitialState"
                    for initial_state in inputs.initial_states(initial):
                        processor.handleInitialState(shown, initial_state, timer_values)
                if input_runs:
                    counts.method = "handleInputRows"
                    emit(handle_input_rows(shown, input_rows(input_runs), timer_values) or ())
                    if ready:
                        yield from output.take_ready()

            output.finish_frames()
            yield from output.take_ready()
            handle.phase = Phase.DATA_PROCESSED
            counts.method = "handleExpiredTimer"
            started = time.perf_counter()
            _fire_timers(spec, handle, times, timer_service, emit, counts)
            counts.timer_seconds += time.perf_counter() - started
            output.finish_frames()
            yield from output.take_ready()
        handle.phase = Phase.TIMER_PROCESSED
        counts.timers_registered += handle.timers_registered
        counts.timers_deleted += handle.timers_deleted
        counts.method = "close"
        processor.close()
        handle.phase = Phase.CLOSED
        if not spec.use_pandas:
            yield output.flush()


_KEY_INTS = {"byte": np.int8, "short": np.int16, "integer": np.int32, "long": np.int64}
"""Spark's integer types, as NumPy scalars of their width (``int_extension``)."""


def _key_int(scalar: Callable[[Any], Any], value: Any) -> Any:
    """An integer key value as a NumPy scalar (``pandas.NA`` for null)."""
    return pd.NA if value is None else scalar(value)


def _shown_key(
    spec: ProcessorSpec, serializer: Any
) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """The key as the processor gets it: as it is in Row mode; in pandas mode, as Spark
    takes the key from a row of its frame, with its timestamps as wall times of the
    session time zone (``pandas_times``), its structs as ``nested_value`` makes them, and
    with ``int_extension`` its integers NumPy scalars (``pandas.NA`` for null)."""
    if not spec.use_pandas:
        return _unchanged
    local = partial(session_local_key, time_zone=spec.time_zone)
    fields = []
    if isinstance(serializer, RowTupleSerializer):
        fields = StructType.fromJson(json.loads(serializer.schema_json)).fields
    fixes: list[tuple[int, Callable[[Any], Any]]] = []
    for position, field in enumerate(fields):
        if isinstance(field.dataType, StructType):
            fixes.append((position, nested_value(field.dataType, spec.time_zone)))
        elif spec.int_extension and field.dataType.typeName() in _KEY_INTS:
            fixes.append((position, partial(_key_int, _KEY_INTS[field.dataType.typeName()])))
    if not fixes:
        return local

    def shown(key: tuple[Any, ...]) -> tuple[Any, ...]:
        values = list(local(key))
        for position, fix in fixes:
            values[position] = fix(values[position])
        return tuple(values)

    return shown


def _timer_key(spec: ProcessorSpec, serializer: Any) -> Callable[[tuple[Any, ...]], Row]:
    """A timer's key as Spark hands it to ``handleExpiredTimer`` (it unpickles the key the
    processor's timer was registered under from the JVM): a ``Row`` of the key columns,
    structs in it ``Row``s too; its timestamps (not timestamp_ntz) naive local times of
    the instant, as the key serializer decodes them, in Row mode (the processor saw a
    zone-aware datetime), and naive wall times of the session time zone in pandas mode
    (the processor saw one)."""
    make = Row(*spec.key_columns)
    fields = []
    if isinstance(serializer, RowTupleSerializer):
        fields = json.loads(serializer.schema_json)["fields"]
    nested = any(isinstance(field["type"], dict) for field in fields)
    instants = [
        position
        for position, field in enumerate(fields)
        if spec.use_pandas and field["type"] == "timestamp"
    ]
    if not nested and not instants:
        return lambda key: make(*key)
    # Nested structs as Rows: the key decoded again, as a state decodes its values.
    with_rows = RowTupleSerializer(serializer.schema_json, struct_of=nested_row) if nested else None
    time_zone = spec.time_zone

    def shown(key: tuple[Any, ...]) -> Row:
        values = list(
            key if with_rows is None else with_rows.deserialize(serializer.serialize(key))
        )
        for position in instants:
            if values[position] is not None:
                values[position] = session_wall_time(values[position], time_zone)
        return make(*values)

    return shown


def _fire_timers(
    spec: ProcessorSpec,
    handle: ProcessorHandle,
    times: BatchTimes,
    timer_service: TimerService | None,
    emit: Callable[[Iterable[Any]], None],
    counts: SubtaskCounts,
) -> None:
    """Due timers in ascending expiry order, through ``handleExpiredTimer`` (their output
    to ``emit``, their number to ``counts``), as Spark fires them: those due when the
    timer phase begins, and only they; a handler sees its own timer as registered until
    it returns (``TimerService.advance_*(fire_new=False)``)."""
    if spec.time_mode == "None" or timer_service is None:
        return
    timer_values = times.timer_values(spec.time_mode)
    assert handle.backend is not None
    shown_key = _timer_key(spec, handle.backend.key_serializer)

    def on_timer(key: Any, timestamp_ms: int) -> None:  # the timer's key is current
        counts.timers_fired += 1
        # By name, as Spark calls it: a handler may declare its parameters in any order.
        result = spec.processor.handleExpiredTimer(
            key=shown_key(key),
            timerValues=timer_values,
            expiredTimerInfo=ExpiredTimerInfo(timestamp_ms),
        )
        emit(result or ())

    if spec.time_mode == "ProcessingTime":
        timer_service.advance_processing_time(times.batch_timestamp_ms, on_timer, fire_new=False)
    else:
        timer_service.advance_watermark(times.eviction_watermark_ms, on_timer, fire_new=False)
