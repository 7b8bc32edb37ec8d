"""Operator (non-keyed) state: named lists and broadcast maps per subtask, and raw bytes.

Values are serialized when they are stored, so a value the serializer cannot encode is
rejected at once and leaves the state as it was, and a snapshot (``sync_cut``) is a
cheap copy of immutable bytes. A restored backend takes each state's stored bytes as they
are, or migrates them, when the state is first asked for with a serializer; states never
asked for are carried into the next snapshot untouched.

The backend is the ``OperatorStateStore`` that user functions implementing
``state.functions.CheckpointedFunction`` are handed; ``backends.operator_redistribution``
divides its cuts among new subtasks on restore.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar, cast

from statebackend.errors import IncompatibleStateError, SerializationError, StateAccessError
from statebackend.redistribution import DistributionMode, StateLayout
from statebackend.serializers import (
    Serializer,
    SerializerConfig,
    migrate,
    resolve_serializer,
)
from statebackend.state.descriptors import check_state_name

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

VALUE_ROLE = "value"
KEY_ROLE = "user_key"

Entry = bytes | tuple[bytes, bytes]
"""A stored list element, or a stored broadcast map entry (key bytes, value bytes)."""


@dataclass(frozen=True)
class NamedStateCut:
    """An immutable copy of one named operator state.

    ``serializers`` holds the configs by role: ``"value"`` (list elements, map values)
    and, for broadcast state, ``"user_key"``. ``entries`` are the serialized list
    elements, or for broadcast state the (key bytes, value bytes) pairs.
    """

    mode: DistributionMode
    serializers: Mapping[str, SerializerConfig]
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class OperatorStateCut:
    """An immutable copy of one subtask's operator state: named states and raw partitions."""

    states: Mapping[str, NamedStateCut] = field(default_factory=dict)
    raw: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "states", MappingProxyType(dict(self.states)))

    # An in-memory ``OperatorStateSource`` (see ``operator_redistribution``):

    def state_layouts(self) -> Mapping[str, StateLayout]:
        """Mode and element count of every named state."""
        return {name: StateLayout(s.mode, len(s.entries)) for name, s in self.states.items()}

    def state_serializers(self) -> Mapping[str, Mapping[str, SerializerConfig]]:
        """The serializer configs of every named state."""
        return {name: state.serializers for name, state in self.states.items()}

    def raw_count(self) -> int:
        """How many raw partitions the cut holds."""
        return len(self.raw)

    def read_elements(self, name: str, begin: int, end: int) -> Sequence[Entry]:
        """Elements ``begin`` to ``end`` (exclusive) of state ``name``."""
        return self.states[name].entries[begin:end]

    def read_raw(self, begin: int, end: int) -> Sequence[bytes]:
        """Raw partitions ``begin`` to ``end`` (exclusive)."""
        return self.raw[begin:end]


def _migrated(
    name: str, new: Serializer[Any], stored: SerializerConfig, data: list[bytes]
) -> list[bytes]:
    """``data`` written by the serializer ``stored`` describes, made readable by ``new``."""
    old = resolve_serializer(name, new, stored)
    return data if old is None else [migrate(item, old, new) for item in data]


class OperatorListState(Generic[T]):
    """A named list of elements of one subtask, redistributed on restore by its mode."""

    def __init__(
        self,
        name: str,
        mode: DistributionMode,
        serializer: Serializer[T],
        elements: Iterable[bytes] = (),
    ) -> None:
        self.name = name
        self.mode = mode
        self._serializer = serializer
        self._elements = list(elements)

    def get(self) -> list[T]:
        """The elements, in the order they were added."""
        return [self._serializer.deserialize(item) for item in self._elements]

    def add(self, value: T) -> None:
        """Append ``value``; SerializationError (and no change) if it cannot be encoded."""
        self._elements.append(self._serializer.serialize(value))

    def add_all(self, values: Iterable[T]) -> None:
        """Append all ``values``, or none of them if one cannot be encoded."""
        self._elements.extend([self._serializer.serialize(value) for value in values])

    def update(self, values: Iterable[T]) -> None:
        """Replace the elements by ``values``, or keep them if one cannot be encoded."""
        self._elements = [self._serializer.serialize(value) for value in values]

    def clear(self) -> None:
        """Remove all elements."""
        self._elements = []

    def _configs(self) -> dict[str, SerializerConfig]:
        return {VALUE_ROLE: self._serializer.config()}

    def _adopt(self, serializer: Serializer[T], stored: Mapping[str, SerializerConfig]) -> None:
        """Take ``serializer``, migrating elements written as ``stored`` describes."""
        self._elements = _migrated(self.name, serializer, stored[VALUE_ROLE], self._elements)
        self._serializer = serializer

    def _cut(self) -> NamedStateCut:
        return NamedStateCut(self.mode, self._configs(), tuple(self._elements))


class BroadcastState(Generic[K, V]):
    """A named map of one subtask; on restore every new subtask gets a copy of it."""

    mode = DistributionMode.BROADCAST

    def __init__(
        self,
        name: str,
        key_serializer: Serializer[K],
        value_serializer: Serializer[V],
        entries: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        self.name = name
        self._keys = key_serializer
        self._values = value_serializer
        self._entries = dict(entries)

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key``, or ``default`` when it has none."""
        data = self._entries.get(self._keys.serialize(key))
        return default if data is None else self._values.deserialize(data)

    def put(self, key: K, value: V) -> None:
        """Map ``key`` to ``value``; SerializationError (and no change) if either fails."""
        key_bytes, value_bytes = self._keys.serialize(key), self._values.serialize(value)
        self._entries[key_bytes] = value_bytes

    def put_all(self, mapping: Mapping[K, V]) -> None:
        """Put every entry of ``mapping``, or none of them if one cannot be encoded."""
        encoded = {self._keys.serialize(k): self._values.serialize(v) for k, v in mapping.items()}
        self._entries.update(encoded)

    def remove(self, key: K) -> None:
        """Remove ``key`` if it is present."""
        self._entries.pop(self._keys.serialize(key), None)

    def contains(self, key: K) -> bool:
        """Whether ``key`` has a value."""
        return self._keys.serialize(key) in self._entries

    def items(self) -> Iterator[tuple[K, V]]:
        """The (key, value) pairs, in insertion order."""
        for key, value in list(self._entries.items()):
            yield self._keys.deserialize(key), self._values.deserialize(value)

    def keys(self) -> Iterator[K]:
        """The keys, in insertion order."""
        return (self._keys.deserialize(key) for key in list(self._entries))

    def values(self) -> Iterator[V]:
        """The values, in key insertion order."""
        return (self._values.deserialize(value) for value in list(self._entries.values()))

    def is_empty(self) -> bool:
        """Whether the map has no entries."""
        return not self._entries

    def clear(self) -> None:
        """Remove all entries."""
        self._entries.clear()

    def _configs(self) -> dict[str, SerializerConfig]:
        return {KEY_ROLE: self._keys.config(), VALUE_ROLE: self._values.config()}

    def _adopt(
        self,
        key_serializer: Serializer[K],
        value_serializer: Serializer[V],
        stored: Mapping[str, SerializerConfig],
    ) -> None:
        """Take the serializers, migrating entries written as ``stored`` describes."""
        keys = _migrated(self.name, key_serializer, stored[KEY_ROLE], list(self._entries))
        values = _migrated(
            self.name, value_serializer, stored[VALUE_ROLE], list(self._entries.values())
        )
        self._entries = dict(zip(keys, values, strict=True))
        self._keys, self._values = key_serializer, value_serializer

    def _cut(self) -> NamedStateCut:
        return NamedStateCut(self.mode, self._configs(), tuple(self._entries.items()))


_AnyState = OperatorListState[Any] | BroadcastState[Any, Any]
S = TypeVar("S", bound=_AnyState)
_Elements = tuple[bytes, ...]
_Pairs = tuple[tuple[bytes, bytes], ...]


class OperatorStateBackend:
    """The operator state of one subtask, fresh or restored from a (redistributed) cut.

    A state name belongs to one kind: asking for it as another kind is a
    StateAccessError (or an IncompatibleStateError when the restored state has another
    mode). Asking again with another serializer checks compatibility and migrates, as a
    restore does.
    """

    def __init__(self, restored: OperatorStateCut | None = None) -> None:
        self._is_restored = restored is not None
        self._pending: dict[str, NamedStateCut] = dict(restored.states) if restored else {}
        self._states: dict[str, _AnyState] = {}
        self._raw: list[bytes] = list(restored.raw) if restored else []

    @property
    def is_restored(self) -> bool:
        """Whether this backend was created from a checkpoint (even an empty share of one)."""
        return self._is_restored

    def get_list_state(self, name: str, serializer: Serializer[T]) -> OperatorListState[T]:
        """The split list state ``name``: on rescale its elements are divided among subtasks."""
        return self._list_state(name, DistributionMode.SPLIT, serializer)

    def get_union_list_state(self, name: str, serializer: Serializer[T]) -> OperatorListState[T]:
        """The union list state ``name``: on restore every subtask gets all elements."""
        return self._list_state(name, DistributionMode.UNION, serializer)

    def get_broadcast_state(
        self, name: str, key_serializer: Serializer[K], value_serializer: Serializer[V]
    ) -> BroadcastState[K, V]:
        """The broadcast map state ``name``: on restore every subtask gets a copy."""
        state, stored = self._lookup(
            name,
            DistributionMode.BROADCAST,
            lambda entries: BroadcastState(
                name, key_serializer, value_serializer, cast(_Pairs, entries)
            ),
        )
        state._adopt(key_serializer, value_serializer, stored)
        self._register(state)
        return state

    def set_raw_state(self, partitions: Sequence[bytes]) -> None:
        """Replace this subtask's raw state: opaque partitions carried through checkpoints.

        On rescale each partition goes, whole, to one new subtask (split mode).
        """
        if isinstance(partitions, (bytes, bytearray, memoryview)) or not all(
            isinstance(p, (bytes, bytearray, memoryview)) for p in partitions
        ):
            raise SerializationError("raw operator state must be a sequence of bytes partitions")
        self._raw = [bytes(p) for p in partitions]

    def get_raw_state(self) -> list[bytes]:
        """The raw partitions set here or restored to this subtask."""
        return list(self._raw)

    def sync_cut(self) -> OperatorStateCut:
        """An immutable copy of all state, unaffected by later changes (restored states
        never asked for are included as they were restored)."""
        states = dict(self._pending)
        states.update((name, state._cut()) for name, state in self._states.items())
        return OperatorStateCut(states, tuple(self._raw))

    def _list_state(
        self, name: str, mode: DistributionMode, serializer: Serializer[T]
    ) -> OperatorListState[T]:
        state, stored = self._lookup(
            name,
            mode,
            lambda entries: OperatorListState(name, mode, serializer, cast(_Elements, entries)),
        )
        state._adopt(serializer, stored)
        self._register(state)
        return state

    def _lookup(
        self, name: str, mode: DistributionMode, create: Callable[[tuple[Entry, ...]], S]
    ) -> tuple[S, Mapping[str, SerializerConfig]]:
        """The state ``name`` (registered, else restored, else new from ``create``) and the
        configs of the serializers its bytes were written with; checks name and mode."""
        check_state_name(name)
        state = self._states.get(name)
        if state is not None:
            if state.mode is not mode:
                raise StateAccessError(
                    f"operator state {name!r} is registered as {state.mode.value} state and "
                    f"cannot be used as {mode.value} state: give the states different names"
                )
            return cast(S, state), state._configs()
        restored = self._pending.get(name)
        if restored is None:
            created = create(())
            return created, created._configs()
        if restored.mode is not mode:
            raise IncompatibleStateError(
                f"operator state {name!r} was checkpointed as {restored.mode.value} state and "
                f"cannot be restored as {mode.value} state: keep its kind or rename it"
            )
        return create(restored.entries), restored.serializers

    def _register(self, state: _AnyState) -> None:
        self._pending.pop(state.name, None)
        self._states[state.name] = state
