"""Spark's ``StatefulProcessorHandle`` over our keyed state backend.

An unmodified ``pyspark.sql.streaming.StatefulProcessor`` gets a ``ProcessorHandle``:
``getValueState``/``getListState``/``getMapState`` register states in the subtask's
``KeyedStateBackend`` (values are tuples of the declared schema, encoded by
``RowTupleSerializer``, never pickled), ``registerTimer``/``deleteTimer``/``listTimers``
act on the backend's timer service, and the handle enforces Spark's lifecycle: states are
declared in ``init`` only, timers are used while rows or timers are handled and never in
time mode None. Each call acts on the key the runner made current.

DDL schema strings need a JVM to parse, which executors' Python workers lack: like
Spark's PRE_INIT phase, the driver runs ``init`` once with a ``ProcessorHandle`` in
phase PRE_INIT, which records every schema it is given, and ships the parsed schemas
(``SchemaCatalog``) to the executors.

TTL (``ttlDurationMs``) maps to our ``StateTtlConfig``, with the batch timestamp as the
backend's clock (``BatchClock``), as Spark computes expiry from the batch timestamp.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from operator import index
from struct import Struct
from typing import Any, TypeVar

from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import ListState as SparkListState
from pyspark.sql.streaming.stateful_processor import MapState as SparkMapState
from pyspark.sql.streaming.stateful_processor import StatefulProcessorHandle, TimerValues
from pyspark.sql.streaming.stateful_processor import ValueState as SparkValueState
from pyspark.sql.streaming.stateful_processor_api_client import StatefulProcessorHandleState
from pyspark.sql.types import StructType

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.errors import (
    ConfigurationError,
    DeletedStateError,
    IncompatibleStateError,
    ProcessorArgumentRangeError,
    ProcessorArgumentTypeError,
    StatefulProcessorError,
)
from statebackend.serializers import RowTupleSerializer, serializer_from_config
from statebackend.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateDescriptor,
    StateKind,
    ValueStateDescriptor,
)
from statebackend.state.interfaces import ListState, MapState
from statebackend.state.timers import TimerService
from statebackend.state.ttl import StateTtlConfig

Phase = StatefulProcessorHandleState
"""The handle's lifecycle phase: Spark's own enum (PRE_INIT, CREATED = in ``init``,
INITIALIZED = handling rows, DATA_PROCESSED = handling timers, TIMER_PROCESSED, CLOSED)."""

TIME_MODES = {"none": "None", "processingtime": "ProcessingTime", "eventtime": "EventTime"}
"""Spark's time modes, by their case-insensitive spelling."""


def parse_time_mode(time_mode: object) -> str:
    """The canonical spelling of a time mode ("None", "ProcessingTime", "EventTime");
    ConfigurationError for anything else."""
    canonical = TIME_MODES.get(str(time_mode).lower()) if isinstance(time_mode, str) else None
    if canonical is None:
        raise ConfigurationError(
            f"time_mode {time_mode!r} is invalid: choose one of {list(TIME_MODES.values())}"
        )
    return canonical


@dataclass(frozen=True)
class BatchTimes:
    """A micro-batch's clock, as Spark's ``offsets/N`` records it (ms since the epoch):
    the batch timestamp, the watermark that drops late rows (the previous batch's) and
    the watermark that fires event-time timers (this batch's)."""

    batch_timestamp_ms: int
    late_events_watermark_ms: int = 0
    eviction_watermark_ms: int = 0

    def timer_values(self, time_mode: str) -> TimerValues:
        """What the processor sees as ``TimerValues`` in ``time_mode``: both -1 in time
        mode None, else the batch timestamp and the eviction watermark (ProcessingTime
        too, as Spark gives it: 0 when the query has no watermark)."""
        if time_mode == "None":
            return TimerValues(-1, -1)
        return TimerValues(self.batch_timestamp_ms, self.eviction_watermark_ms)


class BatchClock:
    """The backend's clock (seconds) during a batch: the batch timestamp, so that TTL
    expiry follows Spark's batch time rather than the wall clock."""

    def __init__(self, timestamp_ms: int = 0) -> None:
        self.timestamp_ms = timestamp_ms

    def __call__(self) -> float:
        return self.timestamp_ms / 1000.0


DdlParser = Callable[[str, str], StructType]
"""Parses a DDL schema (the driver's, with a JVM); the second argument names the schema
in its errors ("state 'totals': schema")."""


@dataclass
class SchemaCatalog:
    """Schemas the driver parsed for the processor: DDL string -> ``StructType.json()``."""

    parsed: dict[str, str] = field(default_factory=dict)

    def record(self, schema: StructType | str, parse: DdlParser, what: str) -> str:
        """The JSON of ``schema`` (named ``what`` in errors); a DDL string is parsed with
        ``parse`` and remembered."""
        if isinstance(schema, StructType):
            return str(schema.json())
        if not isinstance(schema, str):
            raise ConfigurationError(
                f"{what} {schema!r} is invalid: give a StructType or a DDL string"
            )
        if schema not in self.parsed:
            parsed = parse(schema, what)
            if not isinstance(parsed, StructType):
                raise ConfigurationError(
                    f"{what} {schema!r} is not a struct: write it as 'name type, ...'"
                )
            self.parsed[schema] = str(parsed.json())
        return self.parsed[schema]

    def lookup(self, schema: StructType | str, what: str) -> str:
        """The JSON of ``schema`` (named ``what`` in errors) on an executor (DDL strings
        only if seen in PRE_INIT)."""
        if isinstance(schema, StructType):
            return str(schema.json())
        found = self.parsed.get(schema) if isinstance(schema, str) else None
        if found is None:
            raise ConfigurationError(
                f"{what} {schema!r} was not declared when init() ran on the driver: "
                f"declare every state in init() with the same schema on every call"
            )
        return found


def _plain(value: Any) -> Any:
    """A state value with numpy/pandas scalars turned into Python ones (as Spark does)."""
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        items = [_plain(item) for item in value]
        return items if type(value) is list else tuple(items)
    if type(value).__module__.startswith(("numpy", "pandas")):
        for convert in ("to_pydatetime", "to_pytimedelta", "item"):
            if hasattr(value, convert):
                return getattr(value, convert)()
    return value


def _int64(value: Any, what: str) -> int:
    """``value`` as Spark's handle takes it for ``what`` (a protobuf int64 field): None is
    0; an int, bool or numpy integer is that int; a float (even 2.0) or a string is a
    TypeError and a number beyond 64 bits a ValueError (our classes, subclasses of them)."""
    if value is None:
        return 0
    try:
        number = index(value)
    except TypeError:
        raise ProcessorArgumentTypeError(
            f"{what} {value!r} is a {type(value).__name__}, not an int: give whole "
            f"milliseconds as an int (Spark refuses it too)"
        ) from None
    if not -(2**63) <= number < 2**63:
        raise ProcessorArgumentRangeError(
            f"{what} {value!r} is beyond 64 bits: give milliseconds between -2**63 and 2**63 - 1"
        )
    return number


_PLAIN_TYPES = frozenset({int, float, str, bool, bytes, type(None)})


def _row_tuple(value: Any) -> tuple[Any, ...]:
    """What a state stores of a processor's value, user key or element: ``_plain`` of it,
    a list as a tuple. The ``prepare`` of every state's ``RowTupleSerializer``: the one
    place the handle's states normalize values."""
    if type(value) is tuple and _PLAIN_TYPES.issuperset(map(type, value)):
        return value  # already what _plain would make of it
    plain = _plain(value)
    return tuple(plain) if isinstance(plain, (tuple, list)) else plain


def nested_row(names: list[str]) -> Callable[[list[Any]], Row]:
    """How a state gives a nested struct of fields ``names``: as a ``Row``, as Spark's
    handle does (the state's value itself stays a tuple)."""
    row = Row(*names)
    return lambda values: row(*values)


def _none_given(name: str, operation: str) -> ProcessorArgumentTypeError:
    """The error of giving None as a state's value (or user key): a TypeError, as Spark's
    handle raises (it iterates the value's fields)."""
    return ProcessorArgumentTypeError(
        f"{operation} of state {name!r} got None: give a tuple of the state's fields "
        f"(clear() removes a value)"
    )


class _DeletedState:
    """Stands in for the backend state of a state variable whose state ``deleteIfExists``
    removed: every use raises, as Spark's handle refuses a deleted state."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        raise DeletedStateError(
            f"state {self._name!r} was deleted by deleteIfExists({self._name!r}) in init(): "
            f"delete only states the processor no longer uses"
        )


class _StateVariable:
    """What the three state kinds share: the handle (phase checks) and the backend state."""

    def __init__(self, handle: ProcessorHandle, name: str, state: Any) -> None:
        self._handle = handle
        self._name = name
        self._state = state

    def _use(self, operation: str) -> Any:
        if self._handle.serving:
            return self._state
        raise self._refused(operation)

    def _refused(self, operation: str) -> StatefulProcessorError:
        return StatefulProcessorError(
            "STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_HANDLE_STATE",
            f"Failed to perform stateful processor operation={operation} with invalid "
            f"handle state={self._handle.phase.name}: use state {self._name!r} in "
            f"handleInputRows, handleExpiredTimer or handleInitialState",
        )


_VariableT = TypeVar("_VariableT", bound=_StateVariable)
_T = TypeVar("_T")


class ProcessorValueState(_StateVariable, SparkValueState):
    """Spark's ValueState over our ValueState: one tuple per key."""

    # exists/get/update run once or more per key: the phase check is inlined (no _use call).

    def exists(self) -> bool:
        """Whether the current key has a value."""
        if self._handle.serving:
            return self._state.value() is not None
        raise self._refused("exists")

    def get(self) -> tuple[Any, ...] | None:
        """The current key's tuple, or None."""
        if self._handle.serving:
            return self._state.value()
        raise self._refused("get")

    def update(self, newValue: tuple[Any, ...]) -> None:
        """Set the current key's tuple (numpy and pandas scalars become Python ones:
        the state's serializer prepares values with ``_row_tuple``)."""
        if self._handle.serving:
            if newValue is None:
                raise _none_given(self._name, "update")
            self._state.update(newValue)
        else:
            raise self._refused("update")

    def clear(self) -> None:
        """Remove the current key's value."""
        self._use("clear").clear()


class ProcessorListState(_StateVariable, SparkListState):
    """Spark's ListState over our ListState: a list of tuples per key."""

    def exists(self) -> bool:
        """Whether the current key's list has elements."""
        state: ListState = self._use("exists")
        return bool(state.get())

    def get(self) -> Iterator[tuple[Any, ...]]:
        """The current key's tuples, in order, read when the first is asked for, as
        Spark's iterator reads them: one made before an append, put or clear gives the
        list as it is after it."""
        state: ListState = self._use("get")
        return _read_when_asked(state)

    def put(self, newState: list[tuple[Any, ...]]) -> None:
        """Replace the current key's list."""
        state: ListState = self._use("put")
        state.update(newState)

    def appendValue(self, newState: tuple[Any, ...]) -> None:
        """Append one tuple."""
        state: ListState = self._use("append_value")
        if newState is None:
            raise _none_given(self._name, "appendValue")
        state.add(newState)

    def appendList(self, newState: list[tuple[Any, ...]]) -> None:
        """Append tuples in order."""
        state: ListState = self._use("append_list")
        state.add_all(newState)

    def clear(self) -> None:
        """Remove the current key's list."""
        self._use("clear").clear()


def _read_when_asked(state: ListState) -> Iterator[tuple[Any, ...]]:
    """The elements of ``state`` as its ``get`` gives them when the first one is asked for."""
    yield from state.get()


class ProcessorMapState(_StateVariable, SparkMapState):
    """Spark's MapState over our MapState: tuple user keys to tuple values, per key;
    ``getValue`` gives a ``Row`` of the value schema's fields, as Spark's does."""

    def __init__(
        self,
        handle: ProcessorHandle,
        name: str,
        state: Any,
        value_fields: list[str],
        key_order: Callable[[tuple[Any, ...]], bytes] | None = None,
    ) -> None:
        super().__init__(handle, name, state)
        self._value_row = Row(*value_fields)
        self._key_order = key_order
        """Spark's order of the user keys (``spark_map_key_order``); None: ours."""

    def exists(self) -> bool:
        """Whether the current key's map has entries."""
        state: MapState = self._use("exists")
        return not state.is_empty()

    def getValue(self, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The value under user key ``key`` as a ``Row`` (a tuple with field names), or
        None."""
        state: MapState = self._use("get_value")
        value = state.get(key)
        return None if value is None else self._value_row(*value)

    def containsKey(self, key: tuple[Any, ...]) -> bool:
        """Whether user key ``key`` has a value."""
        state: MapState = self._use("contains_key")
        return state.contains(key)

    def updateValue(self, key: tuple[Any, ...], value: tuple[Any, ...]) -> None:
        """Set the value under user key ``key``."""
        state: MapState = self._use("update_value")
        if key is None or value is None:
            raise _none_given(self._name, "updateValue")
        state.put(key, value)

    def iterator(self) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...]]]:
        """The (user key, value) pairs, in Spark's order of the user keys."""
        state: MapState = self._use("iterator")
        order = self._key_order
        if order is None:
            return state.items()
        return _sorted_when_asked(state.items, lambda item: order(item[0]))

    def keys(self) -> Iterator[tuple[Any, ...]]:
        """The user keys, in Spark's order."""
        state: MapState = self._use("keys")
        if self._key_order is None:
            return state.keys()
        return _sorted_when_asked(state.keys, self._key_order)

    def values(self) -> Iterator[tuple[Any, ...]]:
        """The values, in Spark's order of their user keys."""
        if self._key_order is None:
            state: MapState = self._use("values")
            return state.values()
        return (value for _, value in self.iterator())

    def removeKey(self, key: tuple[Any, ...]) -> None:
        """Remove user key ``key``."""
        state: MapState = self._use("remove_key")
        state.remove(key)

    def clear(self) -> None:
        """Remove the current key's map."""
        self._use("clear").clear()


def _sorted_when_asked(
    entries: Callable[[], Iterable[_T]], key: Callable[[_T], bytes]
) -> Iterator[_T]:
    """``entries()`` sorted by ``key``, read when the first is asked for, as Spark's map
    iterators read their state."""
    yield from sorted(entries(), key=key)


_UNSAFE_WORDS = {
    "boolean": "?7x",
    "byte": "b7x",
    "short": "h6x",
    "integer": "i4x",
    "long": "q",
    "float": "f4x",
    "double": "d",
    "date": "i4x",
    "timestamp": "q",
    "timestamp_ntz": "q",
}
"""How Spark's UnsafeRow writes a value of each fixed-width type (its internal value, as
``toInternal`` gives it) into the field's 8-byte word (little-endian, zero-padded)."""
_UNSAFE_BYTES = frozenset({"string", "binary"})
"""The types an UnsafeRow keeps after its words (the word holds offset and size)."""
_UNSAFE_CONVERTED = frozenset({"date", "timestamp", "timestamp_ntz"})
"""The types whose internal value is not the Python value (``toInternal`` makes it)."""


def spark_map_key_order(schema_json: str) -> Callable[[tuple[Any, ...]], bytes] | None:
    """The order in which Spark's map state gives its user keys (``keys``, ``values``,
    ``iterator``): the byte order of its RocksDB keys, where a user key is an UnsafeRow
    nested in the key row, so by that row's size (a little-endian int), then by the row:
    its null bits, one little-endian word per field, the strings' bytes (padded to 8).
    Not by value: 256 before 1, -1 last. None for a schema with a field of another type
    (nested, decimal), whose user keys keep our order."""
    schema = StructType.fromJson(json.loads(schema_json))
    kinds = [field.dataType.typeName() for field in schema.fields]
    if not all(kind in _UNSAFE_WORDS or kind in _UNSAFE_BYTES for kind in kinds):
        return None
    to_internal = schema.toInternal if _UNSAFE_CONVERTED.intersection(kinds) else tuple
    words = Struct("<" + "".join(_UNSAFE_WORDS.get(kind, "q") for kind in kinds))
    """All words at once; a string's or binary's word is its offset and size."""
    byte_positions = [position for position, kind in enumerate(kinds) if kind in _UNSAFE_BYTES]
    bits_size = 8 * ((len(kinds) + 63) // 64)
    fixed_size = bits_size + 8 * len(kinds)

    def order(key: tuple[Any, ...]) -> bytes:
        values = list(to_internal(key))
        nulls = 0  # the null bits, as one little-endian integer
        if None in values:
            for position, value in enumerate(values):
                if value is None:
                    nulls |= 1 << position
                    values[position] = 0  # a null field's word is zero
        tail = b""
        for position in byte_positions:
            if not nulls >> position & 1:
                value = values[position]
                data = value.encode() if isinstance(value, str) else bytes(value)
                values[position] = (fixed_size + len(tail)) << 32 | len(data)
                tail += data + bytes(-len(data) % 8)
        size = fixed_size + len(tail)
        return (
            size.to_bytes(4, "little")
            + nulls.to_bytes(bits_size, "little")
            + words.pack(*values)
            + tail
        )

    if to_internal is not tuple or byte_positions:
        return order
    prefix = fixed_size.to_bytes(4, "little") + bytes(bits_size)

    def fixed_order(key: tuple[Any, ...]) -> bytes:  # fixed-width fields only: most keys
        return order(key) if None in key else prefix + words.pack(*key)

    return fixed_order


class ProcessorHandle(StatefulProcessorHandle):
    """Spark's StatefulProcessorHandle over one keyed subtask's backend.

    ``backend`` is None only in PRE_INIT (the driver's schema-collecting ``init``), where
    ``parse_ddl`` parses DDL strings into the ``catalog``; on executors the catalog
    resolves them. ``timers`` is the backend's timer service (None: timers unavailable).
    """

    def __init__(
        self,
        *,
        time_mode: str,
        catalog: SchemaCatalog,
        backend: KeyedStateBackend | None = None,
        timers: TimerService | None = None,
        parse_ddl: DdlParser | None = None,
    ) -> None:
        self.time_mode = parse_time_mode(time_mode)
        self.catalog = catalog
        self.backend = backend
        self.timers = timers
        self._parse_ddl = parse_ddl
        self.declared: dict[str, StateDescriptor] = {}
        """PRE_INIT: the states ``init`` declared, by name: what a restart checks against
        the stored states (``deleteIfExists`` clears a state's values, not its schema)."""
        self.serving = False
        """Whether states may be used now (kept by ``phase``'s setter, so that a state
        call checks one flag instead of the phase)."""
        self._variables: dict[str, list[_StateVariable]] = {}
        """The state variables ``init`` declared, by state name (what ``deleteIfExists``
        makes unusable)."""
        self.phase = Phase.PRE_INIT if backend is None else Phase.CREATED
        self.timers_registered = self.timers_deleted = 0
        """How often ``registerTimer`` and ``deleteTimer`` were called: every call, whether
        or not the timer was there, as Spark's handle counts its ``numRegisteredTimers`` and
        ``numDeletedTimers``."""

    @property
    def phase(self) -> Phase:
        """The lifecycle phase; states are usable while a key is current: handling rows,
        initial state or timers (INITIALIZED, DATA_PROCESSED), not in ``init`` or
        ``close``, where Spark has no current key."""
        return self._phase

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self._phase = phase
        self.serving = self.backend is not None and phase in (
            Phase.INITIALIZED,
            Phase.DATA_PROCESSED,
        )

    # -- states ---------------------------------------------------------------------------

    def _schema(
        self, name: str, schema: StructType | str, which: str = "schema"
    ) -> RowTupleSerializer:
        """The serializer of state ``name``'s ``which`` schema (its errors name both)."""
        what = f"state {name!r}: {which}"
        if self.phase is Phase.PRE_INIT:
            assert self._parse_ddl is not None, "the driver's handle parses DDL schemas"
            return RowTupleSerializer(
                self.catalog.record(schema, self._parse_ddl, what), _row_tuple, nested_row
            )
        return RowTupleSerializer(self.catalog.lookup(schema, what), _row_tuple, nested_row)

    def _check_declaration(self, operation: str, name: str) -> None:
        if self.phase not in (Phase.PRE_INIT, Phase.CREATED):
            raise StatefulProcessorError(
                "STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_HANDLE_STATE",
                f"Failed to perform stateful processor operation={operation} with invalid "
                f"handle state={self.phase.name}: state {name!r} can only be declared or "
                f"deleted in init()",
            )

    def _ttl(self, name: str, ttl_duration_ms: int | None) -> StateTtlConfig | None:
        # 0 is no TTL, in any time mode, as in Spark: its Python handle sends the duration
        # in a protobuf field, where 0 is the default and reads as no TTL at all. Its type
        # is checked first, as that field checks it (numpy ints are ints, floats are not).
        if ttl_duration_ms is None:
            return None
        ttl_duration_ms = _int64(ttl_duration_ms, f"state {name!r}: ttlDurationMs")
        if ttl_duration_ms == 0:
            return None
        if self.time_mode != "ProcessingTime":  # as Spark: not in EventTime either
            raise StatefulProcessorError(
                "STATEFUL_PROCESSOR_INCORRECT_TIME_MODE_TO_ASSIGN_TTL",
                f"Cannot use TTL for state={name} in timeMode={self.time_mode}, use "
                f"TimeMode.ProcessingTime() instead",
            )
        if ttl_duration_ms < 0:
            raise StatefulProcessorError(
                "STATEFUL_PROCESSOR_TTL_DURATION_MUST_BE_POSITIVE",
                f"TTL duration must be greater than zero for State store operation=get_state "
                f"on state={name}: give ttlDurationMs > 0 or None",
            )
        return StateTtlConfig(ttl_duration_ms / 1000.0)

    def _register(self, descriptor: StateDescriptor) -> Any:
        if self.backend is None:
            if descriptor.name in self.declared:  # checked once, on the driver
                raise StatefulProcessorError(
                    "STATEFUL_PROCESSOR_DUPLICATE_STATE_VARIABLE_DEFINED",
                    f"State variable with name {descriptor.name} has already been defined "
                    f"in the StatefulProcessor: give each state a name of its own",
                )
            self.declared[descriptor.name] = descriptor
            return None
        state = self.backend.get_state(descriptor)
        registered = getattr(state, "descriptor", descriptor)
        if registered.serializer_configs() != descriptor.serializer_configs():
            raise IncompatibleStateError(
                f"state {descriptor.name!r} is already declared with schema "
                f"{registered.serializer_configs()}: declare it with one schema only"
            )
        return state

    def _declared(self, variable: _VariableT) -> _VariableT:
        """Keep ``variable`` under its state's name (for ``deleteIfExists``)."""
        self._variables.setdefault(variable._name, []).append(variable)
        return variable

    def getValueState(
        self, stateName: str, schema: StructType | str, ttlDurationMs: int | None = None
    ) -> ProcessorValueState:
        """Declare (in ``init``) a value state holding tuples of ``schema``."""
        self._check_declaration("get_value_state", stateName)
        descriptor = ValueStateDescriptor(
            stateName, self._schema(stateName, schema), ttl=self._ttl(stateName, ttlDurationMs)
        )
        return self._declared(ProcessorValueState(self, stateName, self._register(descriptor)))

    def getListState(
        self, stateName: str, schema: StructType | str, ttlDurationMs: int | None = None
    ) -> ProcessorListState:
        """Declare (in ``init``) a list state of tuples of ``schema``."""
        self._check_declaration("get_list_state", stateName)
        descriptor = ListStateDescriptor(
            stateName, self._schema(stateName, schema), ttl=self._ttl(stateName, ttlDurationMs)
        )
        return self._declared(ProcessorListState(self, stateName, self._register(descriptor)))

    def getMapState(
        self,
        stateName: str,
        userKeySchema: StructType | str,
        valueSchema: StructType | str,
        ttlDurationMs: int | None = None,
    ) -> ProcessorMapState:
        """Declare (in ``init``) a map state from ``userKeySchema`` to ``valueSchema`` tuples."""
        self._check_declaration("get_map_state", stateName)
        value_serializer = self._schema(stateName, valueSchema, "value schema")
        key_serializer = self._schema(stateName, userKeySchema, "user key schema")
        descriptor = MapStateDescriptor(
            stateName, key_serializer, value_serializer, ttl=self._ttl(stateName, ttlDurationMs)
        )
        return self._declared(
            ProcessorMapState(
                self,
                stateName,
                self._register(descriptor),
                value_serializer.field_names,
                spark_map_key_order(key_serializer.schema_json),
            )
        )

    def deleteIfExists(self, stateName: str) -> None:
        """Remove state ``stateName`` for every key (in ``init``), if it exists; its state
        variables declared before are unusable from then on (as in Spark)."""
        self._check_declaration("delete_if_exists", stateName)
        backend = self.backend
        if backend is None:
            return
        for variable in self._variables.get(stateName, ()):
            variable._state = _DeletedState(stateName)
        meta = next((m for m in backend.state_meta() if m.name == stateName), None)
        if meta is None:
            return
        state = backend.get_state(_descriptor_of_stored(meta.name, meta.kind, meta.serializers))
        for key in list(backend.keys(stateName)):
            backend.set_current_key(key)
            state.clear()

    # -- timers ---------------------------------------------------------------------------

    def _timer_service(self, operation: str) -> TimerService:
        if self.time_mode == "None":
            raise StatefulProcessorError(
                "STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_TIME_MODE",
                f"Failed to perform stateful processor operation={operation} with invalid "
                f"timeMode=None: run with time_mode 'ProcessingTime' or 'EventTime'",
            )
        if self.phase not in (Phase.INITIALIZED, Phase.DATA_PROCESSED):
            raise StatefulProcessorError(
                "STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_HANDLE_STATE",
                f"Failed to perform stateful processor operation={operation} with invalid "
                f"handle state={self.phase.name}: use timers in handleInputRows, "
                f"handleExpiredTimer or handleInitialState",
            )
        if self.timers is None:
            raise ConfigurationError(
                f"{operation}: this keyed state backend has no timer service: use a "
                f"statebackend build with timers"
            )
        return self.timers

    def registerTimer(self, expiryTimestampMs: int) -> None:
        """Register a timer of the current key at ``expiryTimestampMs`` (an int, taken as
        Spark's handle takes it: ``_int64``)."""
        timers = self._timer_service("register_timer")
        expiry = _int64(expiryTimestampMs, "registerTimer: expiryTimestampMs")
        if self.time_mode == "ProcessingTime":
            timers.register_processing_time_timer(expiry)
        else:
            timers.register_event_time_timer(expiry)
        self.timers_registered += 1

    def deleteTimer(self, expiryTimestampMs: int) -> None:
        """Delete the current key's timer at ``expiryTimestampMs`` (if any; an int, taken
        as ``registerTimer`` takes it)."""
        timers = self._timer_service("delete_timer")
        expiry = _int64(expiryTimestampMs, "deleteTimer: expiryTimestampMs")
        if self.time_mode == "ProcessingTime":
            timers.delete_processing_time_timer(expiry)
        else:
            timers.delete_event_time_timer(expiry)
        self.timers_deleted += 1

    def listTimers(self) -> Iterator[int]:
        """The current key's timer timestamps, in Spark's order (``spark_timer_order``)."""
        timers = self._timer_service("list_timers")
        if self.time_mode == "ProcessingTime":
            listed = timers.processing_time_timers()
        else:
            listed = timers.event_time_timers()
        return iter(sorted(listed, key=spark_timer_order))


spark_timer_order = Struct("<q").pack
"""The order in which Spark's ``listTimers`` gives a key's timers: by the bytes of each
timestamp as its RocksDB store holds it (an UnsafeRow long: little-endian), not by time
(1_767_225_617_000 before 1_767_225_601_000). Odd, but a processor that takes the first
listed timer must get the one it gets in Spark."""


def _descriptor_of_stored(name: str, kind: StateKind, serializers: dict[str, Any]) -> Any:
    """A descriptor that takes over stored state as it is (to clear it)."""
    value = serializers["value"]
    ttl = None
    if value.get("identity") == "ttl":
        value, ttl = value["inner"], StateTtlConfig(1.0)
    value_serializer = serializer_from_config(value)
    if kind is StateKind.MAP:
        key_serializer = serializer_from_config(serializers["user_key"])
        return MapStateDescriptor(name, key_serializer, value_serializer, ttl=ttl)
    if kind is StateKind.LIST:
        return ListStateDescriptor(name, value_serializer, ttl=ttl)
    return ValueStateDescriptor(name, value_serializer, ttl=ttl)


__all__ = [
    "BatchClock",
    "BatchTimes",
    "Phase",
    "ProcessorHandle",
    "SchemaCatalog",
]
