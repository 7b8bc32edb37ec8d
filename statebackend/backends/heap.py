"""The heap keyed backend: state in Python dicts per key group (Flink's HashMap backend).

For tests and small jobs. Values are kept serialized, so reads return fresh objects, a
snapshot is a cheap copy of dicts of immutable bytes, and its snapshots restore into the
RocksDB backend and back.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from statebackend.backends.keyed import FrozenState, KeyedStateBackend, SerializedKeys
from statebackend.backends.stores import CurrentKey, Entry, StateStore, StateStoreView
from statebackend.state.timers import is_timer_state

_Groups = dict[int, dict[bytes, Any]]


class HeapStateStore(StateStore):
    """One state's bytes: key group -> key -> value bytes (map: -> user key -> bytes)."""

    def __init__(self, is_map: bool) -> None:
        self.is_map = is_map
        self.groups: _Groups = {}

    def get(self, current: CurrentKey) -> bytes | None:
        group = self.groups.get(current.key_group)
        return None if group is None else group.get(current.key)

    def estimated_entries(self) -> int:
        if self.is_map:
            return sum(len(entries) for group in self.groups.values() for entries in group.values())
        return sum(len(group) for group in self.groups.values())

    def put(self, current: CurrentKey, value: bytes) -> None:
        self.groups.setdefault(current.key_group, {})[current.key] = value

    def delete(self, current: CurrentKey) -> None:
        group = self.groups.get(current.key_group)
        if group is not None:
            group.pop(current.key, None)

    def _map(self, current: CurrentKey, create: bool) -> dict[bytes, bytes] | None:
        group = self.groups.get(current.key_group)
        if group is None:
            if not create:
                return None
            group = self.groups[current.key_group] = {}
        entries = group.get(current.key)
        if entries is None and create:
            entries = group[current.key] = {}
        return entries

    def map_get(self, current: CurrentKey, user_key: bytes) -> bytes | None:
        entries = self._map(current, create=False)
        return None if entries is None else entries.get(user_key)

    def map_put(self, current: CurrentKey, user_key: bytes, value: bytes) -> None:
        entries = self._map(current, create=True)
        assert entries is not None
        entries[user_key] = value

    def map_remove(self, current: CurrentKey, user_key: bytes) -> None:
        entries = self._map(current, create=False)
        if entries is not None:
            entries.pop(user_key, None)
            if not entries:
                self.delete(current)

    def map_items(self, current: CurrentKey) -> Iterator[tuple[bytes, bytes]]:
        entries = self._map(current, create=False)
        return iter(list(entries.items()) if entries else [])

    def keys(self) -> Iterator[bytes]:
        for group in list(self.groups.values()):
            yield from list(group)

    def composite_keys_from(self, key_group: int, start: bytes, limit: int | None) -> list[bytes]:
        # Sorts the key group: the timer service reads a heap store's key group whole, once.
        group = self.groups.get(key_group, {})
        view = HeapStoreView({key_group: group}, self.is_map)
        composites = [composite for composite, _ in view.composite_items(key_group)]
        first = bisect_left(composites, start)
        return composites[first : None if limit is None else first + limit]

    def write_entries(self, entries: Iterator[tuple[int, Entry]]) -> None:
        for key_group, (key, user_key, value) in entries:
            group = self.groups.setdefault(key_group, {})
            if self.is_map:
                group.setdefault(key, {})[user_key] = value
            else:
                group[key] = value

    def transform_values(self, function: Callable[[bytes], bytes]) -> None:
        for group in self.groups.values():
            for key, value in group.items():
                if self.is_map:
                    group[key] = {uk: function(v) for uk, v in value.items()}
                else:
                    group[key] = function(value)

    def freeze(self) -> HeapStoreView:
        """A copy of the dict structure (the bytes themselves are immutable, so shared)."""
        if self.is_map:
            copy = {g: {k: dict(m) for k, m in d.items()} for g, d in self.groups.items()}
        else:
            copy = {g: dict(d) for g, d in self.groups.items()}
        return HeapStoreView(copy, self.is_map)


def _composite_order(key: bytes) -> tuple[int, bytes]:
    # The order of the RocksDB composite key (length-prefixed), so both backends write
    # identical snapshots.
    return len(key), key


class HeapStoreView(StateStoreView):
    """A frozen copy of a heap store."""

    def __init__(self, groups: _Groups, is_map: bool) -> None:
        self._groups = groups
        self._is_map = is_map

    def composite_items(self, key_group: int) -> Iterator[tuple[bytes, bytes]]:
        group = self._groups.get(key_group, {})
        for key in sorted(group, key=_composite_order):
            prefix = CurrentKey.of(key_group, key).prefix
            if self._is_map:
                user_entries = group[key]
                for user_key in sorted(user_entries):
                    yield prefix + user_key, user_entries[user_key]
            else:
                yield prefix, group[key]


class HeapKeyedStateBackend(KeyedStateBackend):
    """Keyed state in memory; same interface and snapshot format as the RocksDB backend."""

    _timer_cache_entries = None  # all timers are in memory anyway

    def __init__(self, *, scratch_dir: Path | None = None, **options: Any) -> None:
        super().__init__(**options)
        self._scratch_dir = scratch_dir

    @property
    def scratch_dir(self) -> Path | None:
        """Where a restore downloads files (None: the system's temp directory)."""
        return self._scratch_dir

    def _create_store(self, name: str, is_map: bool) -> StateStore:
        return HeapStateStore(is_map)

    def counted_entries(self) -> int | None:
        """Exact, as the stores count in memory (``HeapStateStore.estimated_entries``)."""
        self._check_open()
        return sum(
            store.estimated_entries()
            for name, store in self._stores.items()
            if not is_timer_state(name)
        )

    def _freeze(self, names: list[str]) -> FrozenState:
        stores = self._stores
        views: dict[str, StateStoreView] = {}
        for name in names:
            store = stores[name]
            assert isinstance(store, HeapStateStore)
            views[name] = store.freeze()
        return FrozenState(views, None)

    def _close(self) -> None:
        pass

    # A batch has nothing to read ahead or buffer: the state is in memory. Its keys are
    # checked (and their records kept for set_current_key) as RocksDB's are.

    def _begin_batch(self) -> None:
        pass

    def _prefetch(
        self, keys: Iterable[Any], serialized: SerializedKeys | None = None
    ) -> list[CurrentKey]:
        return self._read_ahead_keys(keys, serialized)

    def _write_batch(self) -> None:
        if self._timer_service is not None:
            self._timer_service.settle()

    def _end_batch(self) -> None:
        pass
