"""``statebackend read``: a state's entries straight from a checkpoint, without Spark.

Keyed state is streamed key group by key group (ranged reads of full snapshot files; an
incremental snapshot's files are downloaded whole, without progress reports) and
decoded with the serializers the snapshot recorded; TTL-wrapped values are unwrapped and
expired ones skipped. Timers are read from their ``by_time`` stores
(``backends/timers.py``). Operator state is read as a restore at parallelism 1 gets it: every
element of split and union state, one copy of broadcast state.

Pickled keys and values are not unpickled unless ``allow_pickle`` is given: unpickling
runs whatever code the bytes name, and a checkpoint is only as trustworthy as everyone
who can write to its storage. They come out as ``OpaqueValue``s (base64 with the
serializer named, in ``to_jsonable``).
"""

from __future__ import annotations

import ast
import datetime
import decimal
import json
import time
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

from statebackend.backends.keyed import StateMetaInfo
from statebackend.backends.keyed_states import decode_list
from statebackend.backends.operator import KEY_ROLE, VALUE_ROLE, NamedStateCut
from statebackend.backends.stores import Entry
from statebackend.backends.timers import TIME_DOMAINS, by_time_name, decode_timestamp
from statebackend.checkpoint.metadata import OperatorSnapshot
from statebackend.checkpoint.savepoints import Progress
from statebackend.errors import ConfigurationError
from statebackend.keygroups import KeyGroupRange, assign_to_key_group
from statebackend.redistribution import DistributionMode, StateLayout, plan_operator_state
from statebackend.serializers import (
    OpaqueValue,
    RowTupleSerializer,
    Serializer,
    SerializerConfig,
    reading_serializer,
    serializer_from_config,
)
from statebackend.snapshot.handles import HandleFiles, KeyedHandle
from statebackend.snapshot.operator_format import OperatorStateInfo, OperatorStateReader
from statebackend.state.descriptors import StateKind
from statebackend.state.timers import is_timer_state
from statebackend.state.ttl import TtlSerializer, TtlValue
from statebackend.tools.location import CheckpointRef

Record = dict[str, Any]
"""One output line: ``{"key": ..., "value": ...}``, or ``{"value": ...}`` for list elements
of operator state."""


@dataclass(frozen=True)
class StateSelection:
    """One named state of one operator: keyed (``keyed`` set) or operator state, or
    its timers (``timers``)."""

    operator: OperatorSnapshot
    name: str
    keyed: StateMetaInfo | None = None
    operator_state: OperatorStateInfo | None = None
    timers: bool = False


def no_such_operator(where: str, operator_id: str, known: Iterable[str]) -> ConfigurationError:
    """The error for ``operator_id`` missing from the state at ``where`` (the name the
    user gave), naming the ``known`` operators."""
    return ConfigurationError(
        f"{where} has no operator {operator_id!r}; it has {', '.join(sorted(known)) or 'none'}"
    )


def operator_of(ref: CheckpointRef, operator_id: str) -> OperatorSnapshot:
    """The operator's snapshot; ConfigurationError naming the known operators if absent."""
    snapshot = ref.metadata.operators.get(operator_id)
    if snapshot is None:
        raise no_such_operator(ref.directory, operator_id, ref.metadata.operators)
    return snapshot


def select_state(ref: CheckpointRef, operator_id: str, name: str) -> StateSelection:
    """State ``name`` of ``operator_id`` (keyed state first, then operator state).

    Raises ConfigurationError naming the operator's states if it has none of that name.
    """
    snapshot = operator_of(ref, operator_id)
    if is_timer_state(name):
        raise ConfigurationError(f"{name!r} holds timers: read them with --timers")
    names: set[str] = set()
    for ack in snapshot.subtasks:
        for meta in ack.keyed.states if ack.keyed is not None else ():
            if is_timer_state(meta.name):
                continue
            if meta.name == name:
                return StateSelection(snapshot, name, keyed=meta)
            names.add(meta.name)
        for state_name, info in (ack.operator_state.states if ack.operator_state else {}).items():
            if state_name == name:
                return StateSelection(snapshot, name, operator_state=info)
            names.add(state_name)
    known = ", ".join(sorted(names)) or "none"
    raise ConfigurationError(f"operator {operator_id!r} has no state {name!r}; it has {known}")


TIMERS = "timers"
"""The name of the selection ``select_timers`` returns."""


def select_timers(ref: CheckpointRef, operator_id: str) -> StateSelection:
    """The timers of ``operator_id`` (a selection of its keyed handles)."""
    return StateSelection(operator_of(ref, operator_id), TIMERS, timers=True)


def parse_key(text: str, config: SerializerConfig) -> Any:
    """The key written as ``text`` on the command line, for the key serializer ``config``:
    text for ``str``, a number for ``int``/``float``, JSON otherwise (a JSON array is a
    tuple for ``tuple``, ``row-tuple`` and ``pickle`` keys; a ``row-tuple`` key of one
    field may also be written as that field alone), falling back to the text itself."""
    identity = config.get("identity")
    try:
        if identity == RowTupleSerializer.identity:
            return _row_tuple_key(text, json.loads(str(config["schema_json"])))
        if identity == "str":
            return text
        if identity == "int":
            return int(text)
        if identity == "float":
            return float(text)
        if identity == "bytes":
            return text.encode("utf-8")
        if identity == "tuple":
            fields = config.get("fields", [])
            items = json.loads(text)
            if not isinstance(items, list) or len(items) != len(fields):
                raise ValueError(f"give a JSON array of {len(fields)} fields")
            return tuple(
                parse_key(item if isinstance(item, str) else json.dumps(item), field)
                for item, field in zip(items, fields, strict=True)
            )
    except ValueError as exc:
        raise ConfigurationError(
            f"key {text!r} does not fit the state's key serializer {identity}: {exc}"
        ) from exc
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return tuple(value) if isinstance(value, list) and identity == "pickle" else value


def _row_tuple_key(text: str, schema: dict[str, Any]) -> tuple[Any, ...]:
    """A ``transform_with_state`` key (a tuple of the key columns) written as a JSON array
    of its fields, or, for one key column, as that column's value: text for a string
    column, JSON for others. Each field as ``read`` prints it (``_key_field``).
    ValueError naming the fields if it is neither."""
    fields = schema.get("fields", [])
    try:
        items = json.loads(text)
    except ValueError:
        items = None
    if isinstance(items, list) and len(items) == len(fields):
        pairs = zip(items, fields, strict=True)
        return tuple(_key_field(item, field["type"]) for item, field in pairs)
    if len(fields) == 1:
        if fields[0]["type"] == "string":
            return (text,)
        if items is not None:
            return (_key_field(items, fields[0]["type"]),)
    names = [field["name"] for field in fields]
    raise ValueError(f"give a JSON array of the {len(fields)} key columns {names}")


def _key_field(item: Any, spark_type: Any) -> Any:
    """A key column's value given as JSON, in the form its column's type takes: dates and
    timestamps from ISO 8601 text, decimals from their text or number (``0.1`` as
    written, not as the float nearest to it), binary from a Python bytes literal (as
    ``read`` prints it: ``b'\\x00a'``) or as UTF-8 text. A float or double -0.0 is 0.0,
    as ``transform_with_state`` stores it (Spark's groupBy keys them as one)."""
    if item is None or not isinstance(spark_type, str):
        return item
    if spark_type in ("float", "double") and isinstance(item, float) and item == 0.0:
        return 0.0
    if spark_type == "date" and isinstance(item, str):
        return datetime.date.fromisoformat(item)
    if spark_type in ("timestamp", "timestamp_ntz") and isinstance(item, str):
        return datetime.datetime.fromisoformat(item)
    if spark_type.startswith("decimal") and isinstance(item, (int, float, str)):
        return decimal.Decimal(str(item))
    if spark_type == "binary" and isinstance(item, str):
        if item[:2] in ("b'", 'b"'):
            literal = ast.literal_eval(item)
            if isinstance(literal, bytes):
                return literal
        return item.encode("utf-8")
    return item


class _Decoder:
    """Decodes stored bytes of one state; TTL-wrapped values become (alive, inner value)."""

    def __init__(self, config: SerializerConfig, now_ms: float, allow_pickle: bool) -> None:
        self.serializer: Serializer[Any] = reading_serializer(config, allow_pickle)
        self.ttl = config.get("identity") == TtlSerializer.identity
        self.now_ms = now_ms

    def __call__(self, data: bytes) -> tuple[bool, Any]:
        value = self.serializer.deserialize(data)
        if self.ttl and isinstance(value, TtlValue):
            return value.expires_at_ms > self.now_ms, value.value
        return True, value


NO_KEY: Any = object()
"""The ``key`` argument meaning: all keys."""

_EXPIRED = object()


def _keyed_value(
    kind: StateKind, entries: list[Entry], values: _Decoder, user_keys: Serializer[Any] | None
) -> Any:
    """The live value of one key from its entries (``_EXPIRED`` if all expired)."""
    if kind is StateKind.MAP:
        assert user_keys is not None
        mapping = {}
        for _, user_key, data in entries:
            alive, value = values(data)
            if alive:
                mapping[user_keys.deserialize(user_key)] = value
        return mapping or _EXPIRED
    if kind is StateKind.LIST:
        decoded = [values(element) for element in decode_list(entries[0][2])]
        elements = [value for alive, value in decoded if alive]
        return elements or _EXPIRED
    alive, value = values(entries[0][2])
    return value if alive else _EXPIRED


def keyed_read_plan(
    ref: CheckpointRef, selection: StateSelection, key: Any = NO_KEY
) -> tuple[list[tuple[KeyedHandle, KeyGroupRange]], bytes | None]:
    """The (handle, key groups) to read, and the serialized key if one is asked.

    With a key only its key group is read, from the one handle that holds it.
    """
    handles = [ack.keyed for ack in selection.operator.subtasks if ack.keyed is not None]
    if not handles:
        return [], None
    key_bytes = None
    wanted = KeyGroupRange(0, ref.metadata.max_parallelism - 1)
    if key is not NO_KEY:
        key_bytes = serializer_from_config(handles[0].key_serializer).serialize(key)
        group = assign_to_key_group(key_bytes, ref.metadata.max_parallelism)
        wanted = KeyGroupRange(group, group)
    plan = []
    for handle in handles:
        groups = handle.key_group_range.intersection(wanted)
        if groups:
            plan.append((handle, groups))
    return plan, key_bytes


def read_bytes(ref: CheckpointRef, selection: StateSelection, key: Any = NO_KEY) -> int:
    """How many bytes ``read_state`` reads of a keyed state, or ``read_timers`` (for a
    progress bar)."""
    plan, _ = keyed_read_plan(ref, selection, key)
    return sum(handle.bytes_for(groups) for handle, groups in plan)


def read_elements(selection: StateSelection) -> int:
    """How many elements ``read_state`` reads of an operator state (for a progress bar):
    every element of a split or union state, one copy of a broadcast state."""
    name = selection.name
    layouts = [
        {name: StateLayout(handle.states[name].mode, len(handle.states[name].elements))}
        if handle is not None and name in handle.states
        else {}
        for handle in selection.operator.operator_handles()
    ]
    share = plan_operator_state(layouts, 1)[0].get(name)
    return 0 if share is None else sum(s.end - s.begin for s in share.slices)


def _keyed_entries(
    ref: CheckpointRef,
    selection: StateSelection,
    key: Any,
    progress: Progress | None,
    allow_pickle: bool,
    local_dir: Path | None,
) -> Iterator[tuple[Serializer[Any], bytes | None, Iterator[tuple[str, int, Entry]]]]:
    """Per keyed handle of the selection's operator that ``keyed_read_plan`` reads: its
    key deserializer (pickled keys opaque unless ``allow_pickle``), ``key`` serialized
    (None if no key is asked) and the handle's (state name, key group, entry) of the
    planned key groups, by ranged reads that report the bytes read to ``progress``
    (an incremental handle's files are downloaded into ``local_dir``)."""

    def read_range(path: str, start: int, length: int) -> bytes:
        data = ref.fs.read_range(path, start, length)
        if progress is not None:
            progress(len(data))
        return data

    files = HandleFiles(ref.fs, ref.directory, read_range, local_dir)
    plan, key_bytes = keyed_read_plan(ref, selection, key)
    for handle, groups in plan:
        keys = reading_serializer(handle.key_serializer, allow_pickle)
        yield keys, key_bytes, handle.read_entries(files, groups)


def read_keyed_state(
    ref: CheckpointRef,
    selection: StateSelection,
    key: Any = NO_KEY,
    progress: Progress | None = None,
    now: float | None = None,
    allow_pickle: bool = False,
    local_dir: Path | None = None,
) -> Iterator[Record]:
    """``{"key", "value"}`` per key of a keyed state (only ``key`` if given), in key-group
    order; map state values are dicts, list state values lists. Values expired at ``now``
    (seconds, default the current time) are skipped. Pickled keys and values are
    ``OpaqueValue``s unless ``allow_pickle``. Incremental snapshots are downloaded into
    ``local_dir`` (default: the system's temp directory)."""
    meta = selection.keyed
    if meta is None:
        raise ConfigurationError(f"state {selection.name!r} is not keyed state")
    now_ms = (time.time() if now is None else now) * 1000
    values = _Decoder(meta.serializers["value"], now_ms, allow_pickle)
    user_keys = (
        reading_serializer(meta.serializers["user_key"], allow_pickle)
        if meta.kind is StateKind.MAP
        else None
    )
    for keys, key_bytes, read in _keyed_entries(
        ref, selection, key, progress, allow_pickle, local_dir
    ):
        entries = (
            entry
            for name, _, entry in read
            if name == meta.name and (key_bytes is None or entry[0] == key_bytes)
        )
        for key_data, run in groupby(entries, key=lambda entry: entry[0]):
            value = _keyed_value(meta.kind, list(run), values, user_keys)
            if value is not _EXPIRED:
                yield {"key": keys.deserialize(key_data), "value": value}


def read_timers(
    ref: CheckpointRef,
    selection: StateSelection,
    key: Any = NO_KEY,
    progress: Progress | None = None,
    allow_pickle: bool = False,
    local_dir: Path | None = None,
) -> Iterator[Record]:
    """``{"domain", "timestamp", "key"}`` per timer of the selection's operator (only
    ``key``'s if given): key group by key group, in each event time then processing
    time, by (timestamp, serialized key). Pickled keys are ``OpaqueValue``s unless
    ``allow_pickle``. Incremental snapshots are downloaded into ``local_dir``."""
    names = {by_time_name(domain): domain for domain in TIME_DOMAINS}
    for keys, key_bytes, read in _keyed_entries(
        ref, selection, key, progress, allow_pickle, local_dir
    ):
        for name, _, (ts8, timer_key, _) in read:
            domain = names.get(name)
            if domain is not None and (key_bytes is None or timer_key == key_bytes):
                yield {
                    "domain": domain,
                    "timestamp": decode_timestamp(ts8),
                    "key": keys.deserialize(timer_key),
                }


def decode_operator_state(state: NamedStateCut, allow_pickle: bool = False) -> list[Record]:
    """The records of one restored operator state: ``{"value"}`` per list element,
    ``{"key", "value"}`` per broadcast entry; pickled ones opaque unless ``allow_pickle``."""
    values = reading_serializer(state.serializers[VALUE_ROLE], allow_pickle)
    if state.mode is not DistributionMode.BROADCAST:
        return [{"value": values.deserialize(e)} for e in state.entries if isinstance(e, bytes)]
    keys = reading_serializer(state.serializers[KEY_ROLE], allow_pickle)
    return [
        {"key": keys.deserialize(e[0]), "value": values.deserialize(e[1])}
        for e in state.entries
        if isinstance(e, tuple)
    ]


def restored_operator_states(
    ref: CheckpointRef,
    operator: OperatorSnapshot,
    subtask: int,
    parallelism: int,
    names: Collection[str] | None = None,
) -> dict[str, NamedStateCut]:
    """The operator states new subtask ``subtask`` of ``parallelism`` would restore
    (only ``names``, when given: the others are not read)."""
    reader = OperatorStateReader(operator.operator_handles(), ref.directory, ref.fs.read_range)
    return dict(reader.restore_cut(subtask, parallelism, names).states)


def read_state(
    ref: CheckpointRef,
    selection: StateSelection,
    key: Any = NO_KEY,
    progress: Progress | None = None,
    allow_pickle: bool = False,
    local_dir: Path | None = None,
) -> Iterator[Record]:
    """The records of the selected state (see ``read_keyed_state``); for operator state
    every element (broadcast: every entry of one copy), filtered by ``key`` for broadcast
    state. ``progress`` hears the bytes read of a keyed state (``read_bytes``), each
    element of an operator state (``read_elements``). Pickled keys and values are
    ``OpaqueValue``s unless ``allow_pickle``. Incremental snapshots are downloaded into
    ``local_dir``."""
    if selection.keyed is not None:
        yield from read_keyed_state(
            ref, selection, key, progress, allow_pickle=allow_pickle, local_dir=local_dir
        )
        return
    states = restored_operator_states(ref, selection.operator, 0, 1, {selection.name})
    for record in decode_operator_state(states[selection.name], allow_pickle):
        if progress is not None:
            progress(1)  # an element: see read_elements
        if key is NO_KEY or record.get("key", NO_KEY) == key:
            yield record


def parse_selection_key(selection: StateSelection, text: str) -> Any:
    """The ``--key`` text as a key of the selected state (keyed or broadcast state) or
    timers."""
    if selection.keyed is not None or selection.timers:
        handle = next(ack.keyed for ack in selection.operator.subtasks if ack.keyed is not None)
        return parse_key(text, handle.key_serializer)
    info = selection.operator_state
    if info is None or info.mode is not DistributionMode.BROADCAST:
        raise ConfigurationError(
            f"--key selects a key of keyed or broadcast state; {selection.name!r} is neither"
        )
    return parse_key(text, info.serializers[KEY_ROLE])


def _json_key(key: Any) -> Any:
    """A dict key as JSON can hold it: an ``OpaqueValue`` as its base64 text, a tuple (a
    map state's row-tuple user key) as its JSON text, anything else as it is."""
    if isinstance(key, OpaqueValue):
        return f"{key.serializer}:{key.to_json()['base64']}"
    if isinstance(key, tuple):
        return json.dumps(to_jsonable(key), ensure_ascii=False)
    return key


def _expose_opaque(value: Any) -> Any:
    """``value`` with every ``OpaqueValue`` in it (in lists, tuples, dict values) as its
    JSON, dates and times as ISO 8601 text, decimals as their text, bytes as their Python
    literal, and dict keys as ``_json_key`` gives them."""
    if isinstance(value, OpaqueValue):
        return value.to_json()
    if isinstance(value, (datetime.date, datetime.time)):  # a datetime is a date
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):  # a Python literal: ``read --key`` takes it back
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_expose_opaque(item) for item in value]
    if isinstance(value, dict):
        return {_json_key(k): _expose_opaque(v) for k, v in value.items()}
    return value


def to_jsonable(value: Any) -> Any:
    """``value`` if JSON can encode it (``OpaqueValue``s as ``{"serializer", "base64"}``),
    else its repr."""
    value = _expose_opaque(value)
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value
