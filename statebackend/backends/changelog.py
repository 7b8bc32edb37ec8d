"""Change capture for the per-batch changelog (Flink's FLIP-158 changelog state backend).

Once ``KeyedStateBackend.enable_changelog()`` is called, every ``StateStore`` the backend
hands out is wrapped in a ``LoggingStateStore``: it passes each call to the store and
records the four mutations (``put``, ``delete``, ``map_put``, ``map_remove``) with the key
group, key, user key and value bytes. Whatever mutates state through a store is captured
with no code of its own (TTL clean-up on read, timers kept in map-kind stores), provided
it takes its store from ``KeyedStateBackend._store_for`` and its state has meta info
(``state_meta``). With the changelog off nothing is wrapped: it costs nothing.

Within a batch the last write of a (state, key, user key) wins, so a batch's record is
proportional to the distinct entries it changed. ``delete`` of a map-kind state's key
removes all the key's entries: it is kept as a prefix delete that drops the key's earlier
entries of the batch and is applied before the entries written after it.

Not recorded: reads, ``write_entries`` (restore loads state, it does not change it) and
``transform_values`` (a serializer migration is replayed from the states' meta info that
every record carries: ``KeyedStateBackend.replay``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple

from statebackend.backends.stores import CurrentKey, Entry, StateStore
from statebackend.backends.timers import TimerSnapshotInfo
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import SerializerConfig
from statebackend.state.timers import is_timer_state

if TYPE_CHECKING:
    from statebackend.backends.keyed import StateMetaInfo


class ChangeOp(IntEnum):
    """What a logged change does to its entry (the values are the record format's codes)."""

    PUT = 0
    """Set a key's value (value-kind states)."""
    DELETE = 1
    """Remove a key's value; of a map-kind state: every entry of the key."""
    MAP_PUT = 2
    """Set one user key of a key's map."""
    MAP_REMOVE = 3
    """Remove one user key of a key's map."""


class Change(NamedTuple):
    """One logged change: the op, the serialized key, user key (b"" if none) and value
    (b"" for removals)."""

    op: ChangeOp
    key: bytes
    user_key: bytes
    value: bytes


@dataclass
class MapKeyChanges:
    """A batch's changes of one key of a map-kind state: whether all its entries were
    removed first, then the user keys written since (None: removed)."""

    cleared: bool = False
    entries: dict[bytes, bytes | None] = field(default_factory=dict)


class LoggingStateStore(StateStore):
    """A store that records its mutations, coalesced per batch (see the module docstring)."""

    def __init__(self, inner: StateStore, is_map: bool) -> None:
        self.inner = inner
        self.is_map = is_map
        self.values: dict[bytes, bytes | None] = {}
        """Value-kind changes of the batch: composite prefix -> value (None: deleted)."""
        self.maps: dict[bytes, MapKeyChanges] = {}
        """Map-kind changes of the batch, by the key's composite prefix."""

    def get(self, current: CurrentKey) -> bytes | None:
        return self.inner.get(current)

    def getter(self) -> Callable[[CurrentKey], bytes | None]:
        return self.inner.getter()  # reads are not logged: no frame of ours

    def estimated_entries(self) -> int:
        return self.inner.estimated_entries()

    def put(self, current: CurrentKey, value: bytes) -> None:
        self.inner.put(current, value)
        self.values[current.prefix] = value

    def delete(self, current: CurrentKey) -> None:
        self.inner.delete(current)
        if self.is_map:
            self.maps[current.prefix] = MapKeyChanges(cleared=True)
        else:
            self.values[current.prefix] = None

    def map_get(self, current: CurrentKey, user_key: bytes) -> bytes | None:
        return self.inner.map_get(current, user_key)

    def map_put(self, current: CurrentKey, user_key: bytes, value: bytes) -> None:
        self.inner.map_put(current, user_key, value)
        changes = self.maps.get(current.prefix)
        if changes is None:
            changes = self.maps[current.prefix] = MapKeyChanges()
        changes.entries[user_key] = value

    def map_remove(self, current: CurrentKey, user_key: bytes) -> None:
        self.inner.map_remove(current, user_key)
        changes = self.maps.get(current.prefix)
        if changes is None:
            changes = self.maps[current.prefix] = MapKeyChanges()
        if changes.cleared:
            changes.entries.pop(user_key, None)  # absent since the clear: nothing to log
        else:
            changes.entries[user_key] = None

    def map_items(self, current: CurrentKey) -> Iterator[tuple[bytes, bytes]]:
        return self.inner.map_items(current)

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()

    def composite_keys_from(self, key_group: int, start: bytes, limit: int | None) -> list[bytes]:
        return self.inner.composite_keys_from(key_group, start, limit)

    def write_entries(self, entries: Iterator[tuple[int, Entry]]) -> None:
        self.inner.write_entries(entries)

    def transform_values(self, function: Callable[[bytes], bytes]) -> None:
        self.inner.transform_values(function)

    def take_changes(self) -> StateChanges:
        """The batch's changes; the next batch starts empty."""
        changes = StateChanges(self.values, self.maps)
        self.values, self.maps = {}, {}
        return changes


@dataclass(frozen=True)
class StateChanges:
    """One state's changes of a batch, by composite prefix (``CurrentKey.prefix``, which
    starts with the key group): value-kind changes (None: deleted) or map-kind ones."""

    values: dict[bytes, bytes | None]
    maps: dict[bytes, MapKeyChanges]

    def __len__(self) -> int:
        return len(self.values) + sum(
            change.cleared + len(change.entries) for change in self.maps.values()
        )

    def written_and_removed(self) -> tuple[int, int]:
        """How many entries the changes write and remove: a value or map entry written
        counts once, a value or map entry removed once, and a map key cleared once (its
        entries are not counted: that would take reading them)."""
        removed = sum(value is None for value in self.values.values())
        written = len(self.values) - removed
        for change in self.maps.values():
            map_removed = sum(value is None for value in change.entries.values())
            written += len(change.entries) - map_removed
            removed += map_removed + change.cleared
        return written, removed

    def __bool__(self) -> bool:
        return bool(self.values or self.maps)


def apply_change(store: StateStore, key_group: int, change: Change) -> None:
    """Apply one logged change to ``store`` (the replay of a record)."""
    current = CurrentKey.of(key_group, change.key)
    op = change.op
    if op is ChangeOp.PUT:
        store.put(current, change.value)
    elif op is ChangeOp.DELETE:
        store.delete(current)
    elif op is ChangeOp.MAP_PUT:
        store.map_put(current, change.user_key, change.value)
    else:
        store.map_remove(current, change.user_key)


@dataclass(frozen=True)
class ChangeSet:
    """One batch's changes of one keyed backend, as ``KeyedStateBackend.drain_changelog``
    returns them: the backend's key serializer, key groups and states' meta info at the
    end of the batch, the changes of each state that has any, by name, and the timers'
    clocks at the end of the batch (clocks are no store entries: a record carries them)."""

    key_serializer: SerializerConfig
    max_parallelism: int
    key_group_range: KeyGroupRange
    states: list[StateMetaInfo]
    changes: dict[str, StateChanges]
    timers: TimerSnapshotInfo

    def __len__(self) -> int:
        return sum(len(changes) for changes in self.changes.values())

    def counts(self) -> ChangeCounts:
        """What the batch's changes amount to, for metrics (``ChangeCounts``)."""
        written = removed = 0
        for name, changes in self.changes.items():
            if not is_timer_state(name):
                state_written, state_removed = changes.written_and_removed()
                written += state_written
                removed += state_removed
        return ChangeCounts(written, removed)


class ChangeCounts(NamedTuple):
    """A batch's changes counted as Spark's state operator progress counts them: entries
    of the states (timers not included) written and removed
    (``StateChanges.written_and_removed``). Each entry counts once, by its last change in
    the batch (a value updated twice is written once), where Spark counts every call."""

    rows_written: int
    rows_removed: int
