"""The byte-level storage a keyed backend offers each registered state.

Both keyed backends store serialized bytes, so that the state implementations
(``backends/keyed_states.py``) are written once, a snapshot is a cheap immutable view,
and the snapshot format is the same whichever backend wrote it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from itertools import repeat
from struct import Struct
from typing import NamedTuple

KEY_GROUP_PREFIX = Struct(">H")
KEY_LENGTH = Struct(">I")
_KEY_HEADER = Struct(">HI")  # KEY_GROUP_PREFIX then KEY_LENGTH, packed in one call
_new_tuple = tuple.__new__


class CurrentKey(NamedTuple):
    """A serialized key with its key group and composite-key prefix.

    The prefix is ``[key group: 2 bytes big-endian][key length: 4 bytes][key]``, so
    that byte order equals key-group order and one key's map entries are contiguous.
    (A NamedTuple rather than a frozen dataclass: one is built per record, on the hot path.)
    """

    key_group: int
    key: bytes
    prefix: bytes

    @classmethod
    def of(cls, key_group: int, key: bytes) -> CurrentKey:
        """The current-key record of serialized ``key`` in ``key_group``."""
        # tuple.__new__ skips the generated __new__'s argument handling (hot path).
        return _new_tuple(cls, (key_group, key, _KEY_HEADER.pack(key_group, len(key)) + key))

    @classmethod
    def of_many(cls, key_groups: list[int], keys: list[bytes]) -> list[CurrentKey]:
        """``of`` of each (key group, serialized key) pair, without a Python frame per
        pair (a batch's read-ahead keys)."""
        header = _KEY_HEADER.pack
        pairs = zip(key_groups, keys, strict=True)
        prefixes = [header(group, len(key)) + key for group, key in pairs]
        return list(map(_new_tuple, repeat(cls), zip(key_groups, keys, prefixes, strict=True)))


def split_composite_key(composite: bytes) -> tuple[int, bytes, bytes]:
    """``(key group, key, user key)`` of a composite key (user key empty if none)."""
    (key_group,) = KEY_GROUP_PREFIX.unpack_from(composite)
    (length,) = KEY_LENGTH.unpack_from(composite, KEY_GROUP_PREFIX.size)
    start = KEY_GROUP_PREFIX.size + KEY_LENGTH.size
    return key_group, composite[start : start + length], composite[start + length :]


Entry = tuple[bytes, bytes, bytes]
"""One stored entry of a state: (serialized key, serialized user key or b"", value bytes)."""


class StateStore(ABC):
    """The bytes of one state: a value per key, or (map state) a value per user key."""

    @abstractmethod
    def get(self, current: CurrentKey) -> bytes | None:
        """The current key's value bytes."""

    def getter(self) -> Callable[[CurrentKey], bytes | None]:
        """``get`` for hot paths: a function that gives what ``get`` gives, without the
        frames of stores that only pass reads on (the changelog's)."""
        return self.get

    @abstractmethod
    def put(self, current: CurrentKey, value: bytes) -> None:
        """Set the current key's value bytes."""

    @abstractmethod
    def delete(self, current: CurrentKey) -> None:
        """Remove the current key's value (map state: every entry of the key)."""

    @abstractmethod
    def map_get(self, current: CurrentKey, user_key: bytes) -> bytes | None:
        """The value bytes under ``user_key`` of the current key's map."""

    @abstractmethod
    def map_put(self, current: CurrentKey, user_key: bytes, value: bytes) -> None:
        """Set ``user_key`` of the current key's map."""

    @abstractmethod
    def map_remove(self, current: CurrentKey, user_key: bytes) -> None:
        """Remove ``user_key`` from the current key's map."""

    @abstractmethod
    def map_items(self, current: CurrentKey) -> Iterator[tuple[bytes, bytes]]:
        """The current key's map entries as bytes, safe against changes while iterating."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every serialized key that has a value, once each."""

    @abstractmethod
    def composite_keys_from(self, key_group: int, start: bytes, limit: int | None) -> list[bytes]:
        """Up to ``limit`` (None: all) composite keys of ``key_group`` at or after the
        composite key ``start``, in composite-key byte order. Read-only: the timer service
        reads its key groups' next timers with it."""

    @abstractmethod
    def write_entries(self, entries: Iterator[tuple[int, Entry]]) -> None:
        """Store (key group, entry) pairs as they are: used by restore."""

    @abstractmethod
    def transform_values(self, function: Callable[[bytes], bytes]) -> None:
        """Replace every value by ``function(value)``: used by serializer migration."""

    @abstractmethod
    def estimated_entries(self) -> int:
        """How many entries the store holds (a map entry counts once per user key): exact
        in memory, RocksDB's ``estimate-num-keys`` on disk. For metrics only."""


class StateStoreView(ABC):
    """A frozen view of a state's bytes, taken at a snapshot's synchronous cut."""

    @abstractmethod
    def composite_items(self, key_group: int) -> Iterable[tuple[bytes, bytes]]:
        """(composite key, value) pairs of one key group as they were at the cut, in
        composite-key byte order (``CurrentKey.prefix`` + user key, as RocksDB stores them).

        The snapshot encoder's input: a backend yields them with as little work per entry
        as it can. An iterator it returns is consumed or dropped before the cut is released.
        """

    def entries(self, key_group: int) -> Iterator[Entry]:
        """The entries of one key group, as they were at the cut."""
        for composite, value in self.composite_items(key_group):
            _, key, user_key = split_composite_key(composite)
            yield key, user_key, value
