"""The five keyed state kinds, written once over a byte-level ``StateStore``.

Values are encoded here: a list is its elements, each as ``[4-byte length][bytes]``,
concatenated (so ``add`` appends bytes without decoding the list); a map entry's user key
and value are encoded separately. With a TTL, each value, list element or map value is a
``TtlValue`` encoded by ``TtlSerializer``; expired ones are never returned, and are
removed when met.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from struct import Struct
from typing import Any

from statebackend.backends.stores import CurrentKey, StateStore
from statebackend.errors import SerializationError, StateAccessError
from statebackend.serializers import Serializer
from statebackend.state.descriptors import (
    AggregatingStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateKind,
)
from statebackend.state.interfaces import (
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    State,
    ValueState,
)
from statebackend.state.ttl import Clock, TtlSerializer, TtlUpdateType, TtlValue, to_ms

_ELEMENT_LENGTH = Struct(">I")

_SHAREABLE_DEFAULT_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes})
"""Types of a default value that cannot be mutated, so every read may hand out the
object itself; any other default is deep-copied per read."""


def encode_list(elements: Iterable[bytes]) -> bytes:
    """Concatenate length-prefixed element bytes."""
    return b"".join(_ELEMENT_LENGTH.pack(len(e)) + e for e in elements)


def decode_list(data: bytes) -> list[bytes]:
    """The element bytes of an encoded list; SerializationError if ``data`` is none (an
    element's length runs past the end)."""
    view, position, elements = memoryview(data), 0, []
    while position < len(view):
        end = position + _ELEMENT_LENGTH.size
        length = _ELEMENT_LENGTH.unpack_from(view, position)[0] if end <= len(view) else None
        if length is None or end + length > len(view):
            raise SerializationError(
                f"a list state's value of {len(view)} bytes is malformed: its element at byte "
                f"{position} runs past its end; the state's stored bytes are damaged"
            )
        elements.append(bytes(view[end : end + length]))
        position = end + length
    return elements


def stored_value_serializer(descriptor: StateDescriptor) -> Serializer[Any]:
    """The serializer of what is stored per value, element or map value (TTL-wrapped)."""
    if descriptor.ttl is None:
        return descriptor.serializer
    return TtlSerializer(descriptor.serializer)


class KeyContext:
    """The current key of a backend, shared with its states, which read it on every call
    (an attribute read, where a call would cost a frame per state access)."""

    __slots__ = ("key", "record")

    def __init__(self) -> None:
        self.record: CurrentKey | None = None
        """The current key's record; None before the first key and once the backend is
        disposed (a state then asks the backend's ``require_current`` for the error)."""
        self.key: Any = None
        """The key object the record is of."""


class KeyedStateImpl(State):
    """What all kinds share: the store, the current key, and TTL wrapping.

    The store's methods and the serializer's ``encoder``/``decoder`` are resolved once
    here; a failing fast call is retried through ``serialize``/``deserialize``, which
    raise the SerializationError that names the value."""

    def __init__(
        self,
        descriptor: StateDescriptor,
        store: StateStore,
        keys: KeyContext,
        require_current: Callable[[], CurrentKey],
        clock: Clock,
    ) -> None:
        self.descriptor = descriptor
        self._store = store
        self._keys = keys
        self._require_current = require_current
        self._clock = clock
        self._ttl = descriptor.ttl
        self._serializer = stored_value_serializer(descriptor)
        self._encode_stored = self._serializer.encoder()
        self._decode_stored = self._serializer.decoder()
        self._get = store.getter()
        self._put = store.put
        self._refresh_on_read = (
            self._ttl is not None and self._ttl.update_type is TtlUpdateType.ON_READ_AND_WRITE
        )

    def _current_key(self) -> CurrentKey:
        current = self._keys.record
        return self._require_current() if current is None else current

    def _encode(self, value: Any) -> bytes:
        if self._ttl is not None:
            value = TtlValue(value, self._ttl.expiry_ms(self._clock()))
        try:
            return self._encode_stored(value)
        except Exception:
            return self._serializer.serialize(value)

    def _decode(self, data: bytes) -> tuple[bool, Any]:
        """``(alive, value)`` of stored bytes: alive is False for an expired value."""
        try:
            value = self._decode_stored(data)
        except Exception:
            value = self._serializer.deserialize(data)
        if self._ttl is None:
            return True, value
        return value.expires_at_ms > to_ms(self._clock()), value.value

    def _read_value(self) -> tuple[CurrentKey, Any]:
        """The current key and its live value (None if absent or expired)."""
        current = self._current_key()
        data = self._store.get(current)
        if data is None:
            return current, None
        alive, value = self._decode(data)
        if not alive:
            self._store.delete(current)
            return current, None
        if self._refresh_on_read:
            self._store.put(current, self._encode(value))
        return current, value

    def clear(self) -> None:
        self._store.delete(self._current_key())


class ValueStateImpl(KeyedStateImpl, ValueState):
    """ValueState over a StateStore.

    Without TTL, with a serializer whose decoded values are immutable
    (``Serializer.decodes_immutable``) and an immutable default, it remembers the last
    value it read and the current-key record it read it for: reading the same record
    again, with no write in between, gives that value without reading and decoding again
    (``exists()`` then ``get()`` of a StatefulProcessor). Only this state writes its
    store while it is registered, so the value cannot have changed.

    A key without a value reads the descriptor's default; a mutable default (a list, a
    dict...) is deep-copied on each such read, so what a caller does to it is seen by no
    other key and no later read."""

    # value() and update() are the hot path of keyed state: one frame each beside the
    # store's and the codec's, without TTL bookkeeping when there is no TTL.

    def __init__(
        self,
        descriptor: StateDescriptor,
        store: StateStore,
        keys: KeyContext,
        require_current: Callable[[], CurrentKey],
        clock: Clock,
    ) -> None:
        super().__init__(descriptor, store, keys, require_current, clock)
        self._copies_default = type(descriptor.default) not in _SHAREABLE_DEFAULT_TYPES
        self._remembers = (
            self._ttl is None and self._serializer.decodes_immutable and not self._copies_default
        )
        self._last_record: CurrentKey | None = None
        """The record of the last read (None: nothing remembered)."""
        self._last_value: Any = None

    def value(self) -> Any:
        if self._ttl is not None:
            value = self._read_value()[1]
            return self._fresh_default() if value is None else value
        current = self._keys.record
        if current is None:
            current = self._require_current()
        elif current is self._last_record:
            return self._last_value
        data = self._get(current)
        if data is None:
            value = self._fresh_default()
        else:
            try:
                value = self._decode_stored(data)
            except Exception:
                value = self._serializer.deserialize(data)
        if self._remembers:
            self._last_record, self._last_value = current, value
        return value

    def _fresh_default(self) -> Any:
        """The descriptor's default: the object itself when immutable, else a deep copy."""
        default = self.descriptor.default
        return copy.deepcopy(default) if self._copies_default else default

    def update(self, value: Any) -> None:
        self._last_record = None
        current = self._keys.record
        if current is None:
            current = self._require_current()
        if value is None:
            self._store.delete(current)
            return
        if self._ttl is None:
            try:
                data = self._encode_stored(value)
            except Exception:
                data = self._serializer.serialize(value)
        else:
            data = self._encode(value)
        self._put(current, data)

    def clear(self) -> None:
        self._last_record = None
        self._store.delete(self._current_key())


class ListStateImpl(KeyedStateImpl, ListState):
    """ListState over a StateStore; ``add`` appends without decoding the list."""

    def get(self) -> list[Any]:
        current = self._current_key()
        data = self._store.get(current)
        if data is None:
            return []
        elements = decode_list(data)
        decoded = [self._decode(e) for e in elements]
        live = [value for alive, value in decoded if alive]
        if self._refresh_on_read and live:
            self._write(current, live)
        elif len(live) != len(decoded):
            # Drop the expired elements but keep the live ones' bytes (and expiry) as stored.
            kept = [e for e, (alive, _) in zip(elements, decoded, strict=True) if alive]
            if kept:
                self._store.put(current, encode_list(kept))
            else:
                self._store.delete(current)
        return live

    def add(self, value: Any) -> None:
        self.add_all([value])

    def add_all(self, values: Iterable[Any]) -> None:
        encoded = self._encode_elements(values)
        if encoded:
            current = self._current_key()
            self._store.put(current, (self._store.get(current) or b"") + encoded)

    def update(self, values: Iterable[Any]) -> None:
        self._write(self._current_key(), values)

    def _write(self, current: CurrentKey, values: Iterable[Any]) -> None:
        encoded = self._encode_elements(values)
        if encoded:
            self._store.put(current, encoded)
        else:
            self._store.delete(current)

    def _encode_elements(self, values: Iterable[Any]) -> bytes:
        elements = list(values)
        if any(v is None for v in elements):
            raise StateAccessError(
                f"list state {self.descriptor.name!r} cannot hold None: add real elements"
            )
        return encode_list(self._encode(v) for v in elements)


class ReducingStateImpl(KeyedStateImpl, ReducingState):
    """ReducingState over a StateStore."""

    def add(self, value: Any) -> None:
        assert isinstance(self.descriptor, ReducingStateDescriptor)
        current, accumulated = self._read_value()
        if accumulated is not None:
            value = self.descriptor.reduce_function(accumulated, value)
        self._store.put(current, self._encode(value))

    def get(self) -> Any:
        return self._read_value()[1]


class AggregatingStateImpl(KeyedStateImpl, AggregatingState):
    """AggregatingState over a StateStore."""

    def add(self, value: Any) -> None:
        assert isinstance(self.descriptor, AggregatingStateDescriptor)
        function = self.descriptor.aggregate_function
        current, accumulator = self._read_value()
        if accumulator is None:
            accumulator = function.create_accumulator()
        self._store.put(current, self._encode(function.add(value, accumulator)))

    def get(self) -> Any:
        assert isinstance(self.descriptor, AggregatingStateDescriptor)
        accumulator = self._read_value()[1]
        if accumulator is None:
            return None
        return self.descriptor.aggregate_function.get_result(accumulator)


class MapStateImpl(KeyedStateImpl, MapState):
    """MapState over a StateStore: one stored entry per map entry."""

    def __init__(
        self,
        descriptor: StateDescriptor,
        store: StateStore,
        keys: KeyContext,
        require_current: Callable[[], CurrentKey],
        clock: Clock,
    ) -> None:
        super().__init__(descriptor, store, keys, require_current, clock)
        assert isinstance(descriptor, MapStateDescriptor)
        self._user_keys = descriptor.key_serializer

    def _user_key(self, user_key: Any) -> bytes:
        if user_key is None:
            raise StateAccessError(f"map state {self.descriptor.name!r} cannot take None as a key")
        return self._user_keys.serialize(user_key)

    def _live_entry(self, user_key: Any) -> tuple[bool, Any]:
        """``(found, value)`` of the entry under ``user_key``: found is False when there is
        none or it expired (then it is removed); a found value may be None. A read with
        ``ON_READ_AND_WRITE`` TTL refreshes the entry."""
        current, encoded_key = self._current_key(), self._user_key(user_key)
        data = self._store.map_get(current, encoded_key)
        if data is None:
            return False, None
        alive, value = self._decode(data)
        if not alive:
            self._store.map_remove(current, encoded_key)
            return False, None
        if self._refresh_on_read:
            self._store.map_put(current, encoded_key, self._encode(value))
        return True, value

    def get(self, user_key: Any) -> Any:
        return self._live_entry(user_key)[1]

    def put(self, user_key: Any, value: Any) -> None:
        encoded_key, encoded = self._user_key(user_key), self._encode(value)
        self._store.map_put(self._current_key(), encoded_key, encoded)

    def put_all(self, entries: Mapping[Any, Any]) -> None:
        encoded = [(self._user_key(k), self._encode(v)) for k, v in entries.items()]
        current = self._current_key()
        for key, value in encoded:
            self._store.map_put(current, key, value)

    def remove(self, user_key: Any) -> None:
        self._store.map_remove(self._current_key(), self._user_key(user_key))

    def contains(self, user_key: Any) -> bool:
        return self._live_entry(user_key)[0]

    def items(self) -> Iterator[tuple[Any, Any]]:
        current = self._current_key()
        for encoded_key, data in self._store.map_items(current):
            alive, value = self._decode(data)
            if not alive:
                self._store.map_remove(current, encoded_key)
                continue
            if self._refresh_on_read:
                self._store.map_put(current, encoded_key, self._encode(value))
            yield self._user_keys.deserialize(encoded_key), value


STATE_IMPLEMENTATIONS: dict[StateKind, type[KeyedStateImpl]] = {
    StateKind.VALUE: ValueStateImpl,
    StateKind.LIST: ListStateImpl,
    StateKind.MAP: MapStateImpl,
    StateKind.REDUCING: ReducingStateImpl,
    StateKind.AGGREGATING: AggregatingStateImpl,
}
