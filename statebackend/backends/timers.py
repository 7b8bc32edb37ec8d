"""Timers of a keyed backend, stored as ordinary keyed state (Flink's InternalTimerService
over a key-group-partitioned priority queue).

Why ordinary state: a timer is written and removed only through the ``StateStore``
methods (``map_put`` / ``map_remove``) of stores the backend creates like any other
state's, so full and incremental snapshots, the heap <-> RocksDB canonical format,
restore and rescale by key-group ranges, and any wrapper around the stores (a changelog)
carry timers with no timer-specific code. Per time domain there are two map stores:

- ``_timers.<domain>.by_time``: key ``ts8`` in the *timer key's* key group, user key the
  serialized timer key, value empty. Its composite key
  ``[key group][length 8][ts8][key]`` orders a key group's timers by (timestamp, key),
  in RocksDB and in the heap's canonical order alike. ``ts8`` is the timestamp's
  order-preserving encoding (sign bit flipped, big-endian).
- ``_timers.<domain>.by_key``: the timer key with user key ``ts8``: the current key's
  timers for listing, and the existence check that makes registering idempotent and
  deleting a missing timer free.

Firing is a merge over key groups, not a scan: per key group, a sorted in-memory cache of
its first timers (up to ``cache_entries``, as Flink's RocksDB timer cache; the heap
backend caches them all), refilled from the store with one ordered read when it runs
empty; above the caches, a heap of the key groups' first timers. A timer registered below
a key group's cached range goes into the cache too, so one registered while firing that is
already due fires in the same call. The caches are filled once, when the service is
created (one ordered read per key group), which is also when the timers are counted,
unless their count is known (a RocksDB backend reopened after ``close()``): then only the
first ``cache_entries`` are read per key group.

The watermark and processing time are not entries (they are per subtask, not per key
group): they travel in the keyed handle as ``TimerSnapshotInfo`` with the timer counts
and earliest timestamps, and a restore from several handles (rescale) takes the minimum.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from struct import Struct
from typing import Any, NamedTuple

from statebackend.backends.stores import KEY_GROUP_PREFIX, KEY_LENGTH, CurrentKey, StateStore
from statebackend.errors import StateAccessError
from statebackend.keygroups import KeyGroupRange
from statebackend.state.descriptors import StateKind
from statebackend.state.timers import (
    MAX_TIMESTAMP,
    MIN_TIMESTAMP,
    TIMER_STATE_PREFIX,
    OnTimer,
    TimerService,
)

EVENT_TIME = "event"
PROCESSING_TIME = "processing"
TIME_DOMAINS = (EVENT_TIME, PROCESSING_TIME)

_TIMESTAMP = Struct(">Q")
_SIGN_BIT = 1 << 63
_TIME_FROM = KEY_GROUP_PREFIX.size + KEY_LENGTH.size
"""Where ``ts8`` starts in a ``by_time`` composite key."""
_TIMER_KEY_FROM = _TIME_FROM + _TIMESTAMP.size
"""Where the serialized timer key starts in a ``by_time`` composite key."""


def by_time_name(domain: str) -> str:
    """The name of the store of ``domain``'s timers ordered by (key group, time, key)."""
    return f"{TIMER_STATE_PREFIX}{domain}.by_time"


def by_key_name(domain: str) -> str:
    """The name of the store of ``domain``'s timers by key."""
    return f"{TIMER_STATE_PREFIX}{domain}.by_key"


def encode_timestamp(timestamp: int) -> bytes:
    """``ts8``: 8 bytes whose byte order is the signed order of ``timestamp``."""
    return _TIMESTAMP.pack(timestamp + _SIGN_BIT)


def decode_timestamp(data: bytes) -> int:
    """The inverse of ``encode_timestamp``."""
    return int(_TIMESTAMP.unpack(data)[0]) - _SIGN_BIT


def check_timestamp(timestamp: Any) -> int:
    """``timestamp`` if it is an int of signed 64 bits, else StateAccessError."""
    if (
        not isinstance(timestamp, int)
        or isinstance(timestamp, bool)
        or not MIN_TIMESTAMP <= timestamp <= MAX_TIMESTAMP
    ):
        raise StateAccessError(
            f"timer timestamp {timestamp!r} is not an int of signed 64 bits: give milliseconds"
        )
    return timestamp


def timer_state_metas() -> list[tuple[str, StateKind, dict[str, Any]]]:
    """(name, kind, serializers) of the four timer stores, for ``StateMetaInfo``."""
    metas: list[tuple[str, StateKind, dict[str, Any]]] = []
    for domain in TIME_DOMAINS:
        for name, layout in ((by_time_name(domain), "by_time"), (by_key_name(domain), "by_key")):
            metas.append((name, StateKind.MAP, {"timer": {"identity": f"timer.{layout}"}}))
    return metas


class TimerClocks(NamedTuple):
    """A subtask's event-time and processing-time clocks."""

    watermark: int = MIN_TIMESTAMP
    processing_time: int = MIN_TIMESTAMP

    def merged(self, other: TimerClocks) -> TimerClocks:
        """The clocks of a subtask restored from two: the earlier of each."""
        return TimerClocks(
            min(self.watermark, other.watermark), min(self.processing_time, other.processing_time)
        )


@dataclass(frozen=True)
class TimerSnapshotInfo:
    """What a keyed handle records of its timers: the clocks, and per time domain the
    number of timers and the earliest timestamp (None when there are none)."""

    clocks: TimerClocks
    counts: dict[str, int]
    earliest: dict[str, int | None]

    @classmethod
    def empty(cls, clocks: TimerClocks) -> TimerSnapshotInfo:
        """No timers, with ``clocks``."""
        return cls(clocks, dict.fromkeys(TIME_DOMAINS, 0), dict.fromkeys(TIME_DOMAINS))

    def to_json(self) -> dict[str, Any]:
        """``{"watermark", "processing_time", "event": {"count", "earliest"}, "processing":
        {...}}``."""
        document: dict[str, Any] = {
            "watermark": self.clocks.watermark,
            "processing_time": self.clocks.processing_time,
        }
        for domain in TIME_DOMAINS:
            document[domain] = {"count": self.counts[domain], "earliest": self.earliest[domain]}
        return document

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TimerSnapshotInfo:
        """The inverse of ``to_json``."""
        return cls(
            TimerClocks(int(data["watermark"]), int(data["processing_time"])),
            {d: int(data[d]["count"]) for d in TIME_DOMAINS},
            {
                d: None if data[d]["earliest"] is None else int(data[d]["earliest"])
                for d in TIME_DOMAINS
            },
        )


_Head = tuple[int, bytes, int, bytes]
"""A key group's first timer in the heap of heads: (timestamp, serialized key, key group,
``by_time`` composite key). Heap order is (timestamp, key)."""


def _head(key_group: int, composite: bytes) -> _Head:
    (shifted,) = _TIMESTAMP.unpack_from(composite, _TIME_FROM)
    return shifted - _SIGN_BIT, composite[_TIMER_KEY_FROM:], key_group, composite


class TimerQueue:
    """The timers of one time domain: two stores, a cache of each key group's first
    timers and a heap of the key groups' heads (see the module docstring).

    Invariant, per key group: ``_cache`` holds, sorted, exactly the stored timers ordered
    at or before ``_frontier`` (all its timers when it has no frontier), and is not empty
    while a frontier exists; ``_heads`` holds an entry for the first cached timer of every
    key group, among stale entries that are skipped when met.
    """

    def __init__(
        self,
        by_time: StateStore,
        by_key: StateStore,
        key_groups: KeyGroupRange,
        cache_entries: int | None,
        count: int | None = None,
    ) -> None:
        self._by_time = by_time
        self._by_key = by_key
        self._cache_entries = cache_entries
        self._cache: dict[int, list[bytes]] = {}
        self._frontier: dict[int, bytes] = {}
        self._heads: list[_Head] = []
        self.count = 0 if count is None else count
        read = None if count is None or cache_entries is None else cache_entries + 1
        for key_group in key_groups:
            composites = by_time.composite_keys_from(
                key_group, KEY_GROUP_PREFIX.pack(key_group), read
            )
            if count is None:
                self.count += len(composites)
            if composites:
                self._fill(key_group, composites[:cache_entries], len(composites))

    def _fill(self, key_group: int, composites: list[bytes], available: int) -> None:
        """Cache ``composites``, the first ``available`` timers after the frontier."""
        self._cache[key_group] = composites
        if composites and len(composites) < available:
            self._frontier[key_group] = composites[-1]
        else:
            self._frontier.pop(key_group, None)
        if composites:
            heappush(self._heads, _head(key_group, composites[0]))

    def _refill(self, key_group: int) -> None:
        limit = self._cache_entries
        composites = self._by_time.composite_keys_from(
            key_group, self._frontier[key_group] + b"\x00", limit
        )
        # A full batch may have more behind it; a short one ends the key group.
        self._fill(key_group, composites, len(composites) + (len(composites) == limit))

    def _removed_from_cache(self, key_group: int, cache: list[bytes], index: int) -> None:
        del cache[index]
        if cache:
            if index == 0:
                heappush(self._heads, _head(key_group, cache[0]))
        elif key_group in self._frontier:
            self._refill(key_group)

    def _find(self, current: CurrentKey, ts8: bytes) -> tuple[CurrentKey, bytes, int | None, bool]:
        """Where the timer (current key, ``ts8``) is: its ``by_time`` key and composite
        key, its index in its key group's cache (None when the cache does not cover it)
        and whether it exists. The cache is asked when it covers the timer (it holds every
        timer up to its frontier), the ``by_key`` store otherwise."""
        key_group = current.key_group
        time_key = CurrentKey.of(key_group, ts8)
        composite = time_key.prefix + current.key
        frontier = self._frontier.get(key_group)
        if frontier is not None and composite > frontier:
            return time_key, composite, None, self._by_key.map_get(current, ts8) is not None
        cache = self._cache.get(key_group)
        if not cache:
            return time_key, composite, 0, False
        index = bisect_left(cache, composite)
        return time_key, composite, index, index < len(cache) and cache[index] == composite

    def register(self, current: CurrentKey, timestamp: int) -> None:
        """Add the timer (current key, ``timestamp``) unless it exists."""
        ts8 = encode_timestamp(timestamp)
        time_key, composite, index, exists = self._find(current, ts8)
        if exists:
            return
        self._by_key.map_put(current, ts8, b"")
        self._by_time.map_put(time_key, current.key, b"")
        self.count += 1
        if index is None:
            return  # only in the store, until the cache reaches it
        key_group = current.key_group
        cache = self._cache.setdefault(key_group, [])
        cache.insert(index, composite)
        if index == 0:
            heappush(self._heads, _head(key_group, composite))
            if len(self._heads) > 2 * len(self._cache) + 64:
                self._compact_heads()
        limit = self._cache_entries
        if limit is not None and len(cache) > limit:
            cache.pop()  # the last stays in the store only
            self._frontier[key_group] = cache[-1]

    def _compact_heads(self) -> None:
        """Drop the stale heads (timers registered in descending order leave many)."""
        self._heads = [_head(g, cache[0]) for g, cache in self._cache.items() if cache]
        heapify(self._heads)

    def delete(self, current: CurrentKey, timestamp: int) -> None:
        """Remove the timer (current key, ``timestamp``) if it exists."""
        ts8 = encode_timestamp(timestamp)
        time_key, _, index, exists = self._find(current, ts8)
        if not exists:
            return
        self._by_key.map_remove(current, ts8)
        self._by_time.map_remove(time_key, current.key)
        self.count -= 1
        if index is not None:
            key_group = current.key_group
            self._removed_from_cache(key_group, self._cache[key_group], index)

    def timestamps(self, current: CurrentKey) -> Iterator[int]:
        """The current key's timer timestamps, ascending."""
        return iter(sorted(decode_timestamp(ts8) for ts8, _ in self._by_key.map_items(current)))

    def _first(self) -> _Head | None:
        """The earliest timer, dropping stale heads."""
        heads, caches = self._heads, self._cache
        while heads:
            head = heads[0]
            cache = caches.get(head[2])
            if cache and cache[0] == head[3]:
                return head
            heappop(heads)
        return None

    def earliest(self) -> int | None:
        """The earliest timer's timestamp (None if there is none)."""
        head = self._first()
        return None if head is None else head[0]

    def fire(self, until: int, on_timer: Callable[[CurrentKey, int], None]) -> int:
        """Remove and pass to ``on_timer`` every timer at or before ``until``, in
        (timestamp, key) order, including those ``on_timer`` registers; returns how many."""
        fired = 0
        while (head := self._first()) is not None and head[0] <= until:
            timestamp, key, key_group, _ = heappop(self._heads)
            ts8 = encode_timestamp(timestamp)
            current = CurrentKey.of(key_group, key)
            self._by_time.map_remove(CurrentKey.of(key_group, ts8), key)
            self._by_key.map_remove(current, ts8)
            self.count -= 1
            self._removed_from_cache(key_group, self._cache[key_group], 0)
            on_timer(current, timestamp)
            fired += 1
        return fired


class KeyedTimerService(TimerService):
    """The ``TimerService`` of one keyed backend (see the module docstring).

    ``store(name)`` gives the backend's store of that name, ``current_key()`` the current
    key (raising when there is none) and ``set_current(current)`` makes a key current and
    returns it deserialized.
    """

    def __init__(
        self,
        store: Callable[[str], StateStore],
        key_groups: KeyGroupRange,
        cache_entries: int | None,
        current_key: Callable[[], CurrentKey],
        set_current: Callable[[CurrentKey], Any],
        clocks: TimerClocks,
        counts: dict[str, int] | None = None,
    ) -> None:
        self._queues = {
            domain: TimerQueue(
                store(by_time_name(domain)),
                store(by_key_name(domain)),
                key_groups,
                cache_entries,
                None if counts is None else counts[domain],
            )
            for domain in TIME_DOMAINS
        }
        self._event = self._queues[EVENT_TIME]
        self._processing = self._queues[PROCESSING_TIME]
        self._current_key = current_key
        self._set_current = set_current
        self._clocks = clocks

    @property
    def clocks(self) -> TimerClocks:
        """The watermark and processing time."""
        return self._clocks

    def counts(self) -> dict[str, int]:
        """How many timers each time domain holds."""
        return {domain: queue.count for domain, queue in self._queues.items()}

    def register_event_time_timer(self, timestamp: int) -> None:
        self._event.register(self._current_key(), check_timestamp(timestamp))

    def register_processing_time_timer(self, timestamp: int) -> None:
        self._processing.register(self._current_key(), check_timestamp(timestamp))

    def delete_event_time_timer(self, timestamp: int) -> None:
        self._event.delete(self._current_key(), check_timestamp(timestamp))

    def delete_processing_time_timer(self, timestamp: int) -> None:
        self._processing.delete(self._current_key(), check_timestamp(timestamp))

    def event_time_timers(self) -> Iterator[int]:
        return self._event.timestamps(self._current_key())

    def processing_time_timers(self) -> Iterator[int]:
        return self._processing.timestamps(self._current_key())

    @property
    def current_watermark(self) -> int:
        return self._clocks.watermark

    @property
    def current_processing_time(self) -> int:
        return self._clocks.processing_time

    def _fire(self, queue: TimerQueue, until: int, on_timer: OnTimer) -> int:
        set_current = self._set_current

        def fire_one(current: CurrentKey, timestamp: int) -> None:
            on_timer(set_current(current), timestamp)

        return queue.fire(until, fire_one)

    def advance_watermark(self, timestamp: int, on_timer: OnTimer) -> int:
        until = max(self._clocks.watermark, check_timestamp(timestamp))
        self._clocks = self._clocks._replace(watermark=until)
        return self._fire(self._event, until, on_timer)

    def advance_processing_time(self, timestamp: int, on_timer: OnTimer) -> int:
        until = max(self._clocks.processing_time, check_timestamp(timestamp))
        self._clocks = self._clocks._replace(processing_time=until)
        return self._fire(self._processing, until, on_timer)

    def snapshot_info(self) -> TimerSnapshotInfo:
        """The clocks, counts and earliest timestamps now."""
        return TimerSnapshotInfo(
            self._clocks,
            self.counts(),
            {domain: queue.earliest() for domain, queue in self._queues.items()},
        )
