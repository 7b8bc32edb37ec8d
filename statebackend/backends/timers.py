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

Registering and deleting read nothing from the store on the way (as Flink's
``RocksDBCachingPriorityQueueSet.add``). Within a key group's cached range the cache
tells whether the timer exists and both entries change at once. Beyond it the change
waits in memory (``TimerQueue.settle``) until something reads the timer stores or
writes them out: the backend settles before it writes its buffered writes
(``KeyedStateBackend._write_batch``: the end of a batch, a snapshot's synchronous cut,
a changelog drain, ``close``), the queue before it lists a key's timers, refills a
cache or counts, and after ``_PENDING_LIMIT`` waiting changes. Settling reads whether
each waiting timer exists, in key order (RocksDB serves sorted reads faster than
random ones), and writes only those whose existence changes: counts are exact
whenever they are read, and the stores hold every timer before they are written out.

The watermark and processing time are not entries (they are per subtask, not per key
group): they travel in the keyed handle as ``TimerSnapshotInfo`` with the timer counts
and earliest timestamps, and a restore from several handles (rescale) takes the minimum.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from struct import Struct
from struct import error as struct_error
from typing import Any, NamedTuple

import mmh3

from statebackend.backends.stores import (
    KEY_GROUP_PREFIX,
    KEY_LENGTH,
    CurrentKey,
    Entry,
    StateStore,
    split_composite_key,
)
from statebackend.errors import CheckpointCorruptedError, StateAccessError
from statebackend.keygroups import KeyGroupRange, assign_to_key_group
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
_TIME_PREFIX = Struct(">HIQ")
"""A ``by_time`` composite key's prefix: key group, key length (8) and ``ts8`` at once."""
_PENDING_LIMIT = 10_000
"""Timer changes beyond the cached ranges that may wait for ``TimerQueue.settle``."""
_SIGN_BIT = 1 << 63
_KEY_LENGTH_FROM = KEY_GROUP_PREFIX.size
_KEY_FROM = _TIME_FROM = KEY_GROUP_PREFIX.size + KEY_LENGTH.size
"""Where a composite key's key starts (a ``by_time`` key's: its ``ts8``)."""
_LENGTH_8 = KEY_LENGTH.pack(_TIMESTAMP.size)
_new_tuple = tuple.__new__
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
        raise _bad_timestamp(timestamp)
    return timestamp


def _bad_timestamp(timestamp: Any) -> StateAccessError:
    return StateAccessError(
        f"timer timestamp {timestamp!r} is not an int of signed 64 bits: give milliseconds"
    )


_TIMESTAMP_IN_KEY = {
    **{by_time_name(domain): True for domain in TIME_DOMAINS},
    **{by_key_name(domain): False for domain in TIME_DOMAINS},
}
"""The timer stores, by name: whether an entry's timestamp is its key (else its user key)."""


def check_timer_state(name: str, kind: StateKind, source: str | None) -> None:
    """CheckpointCorruptedError (naming ``source``, the file, if given) unless state
    ``name`` of ``kind``, a timer state being restored, is one of the four map stores the
    timer service keeps: no other state may take a name with the timer prefix."""
    if _TIMESTAMP_IN_KEY.get(name) is not None and kind is StateKind.MAP:
        return
    where = f"{source}: " if source else ""
    problem = (
        f"is a {kind.value} state, not the timer service's map state"
        if name in _TIMESTAMP_IN_KEY
        else f"is not one of the timer service's states {sorted(_TIMESTAMP_IN_KEY)}"
    )
    raise CheckpointCorruptedError(
        f"{where}timer state {name!r} {problem}: the checkpoint is damaged, restore from an "
        f"earlier checkpoint"
    )


def _malformed_timer(
    name: str, key_group: int, problem: str, source: str | None
) -> CheckpointCorruptedError:
    where = f"{source}: " if source else ""
    return CheckpointCorruptedError(
        f"{where}timer state {name!r} has {problem} in key group {key_group}: the state is "
        f"damaged, restore from an earlier checkpoint"
    )


def _bad_length(length: int, what: str = "an entry") -> str:
    return f"{what} with a timestamp of {length} bytes (not 8)"


_hash = mmh3.hash
"""``keygroups.assign_to_key_group`` is ``_hash(key, 0, False) % max_parallelism``: the
restore checks compute it inline: a Python call per timer would double what they add to a
restore."""


def _other_key_group(timer_key: bytes, max_parallelism: int, what: str = "a timer") -> str:
    return f"{what} of a key of key group {assign_to_key_group(timer_key, max_parallelism)}"


def checked_timer_entries(
    name: str,
    items: Iterator[tuple[int, Entry]],
    source: str | None = None,
    max_parallelism: int | None = None,
) -> Iterator[tuple[int, Entry]]:
    """``items`` (key group, entry) of state ``name`` being restored, as they are; of a
    timer store, CheckpointCorruptedError (naming ``source``, the file, if given) at the
    first entry whose timestamp is not the 8 bytes the timer service writes, or, given
    ``max_parallelism``, at a ``by_time`` entry in another key group than its timer
    key's."""
    in_key = _TIMESTAMP_IN_KEY.get(name)
    if in_key is None:
        return items
    return _checked(name, in_key, items, source, max_parallelism if in_key else None)


def _checked(
    name: str,
    in_key: bool,
    items: Iterator[tuple[int, Entry]],
    source: str | None,
    max_parallelism: int | None,
) -> Iterator[tuple[int, Entry]]:
    for item in items:
        key_group, entry = item
        length = len(entry[0 if in_key else 1])
        if length != _TIMESTAMP.size:
            raise _malformed_timer(name, key_group, _bad_length(length), source)
        if max_parallelism and _hash(entry[1], 0, False) % max_parallelism != key_group:
            raise _malformed_timer(
                name, key_group, _other_key_group(entry[1], max_parallelism), source
            )
        yield item


def check_timer_composites(
    name: str, composites: Iterable[bytes], source: str | None, max_parallelism: int | None = None
) -> None:
    """``checked_timer_entries`` of composite keys (``stores.CurrentKey`` + user key)
    of state ``name``: CheckpointCorruptedError unless each one of a timer store is a
    timer's (in its timer key's key group only if ``max_parallelism`` is given)."""
    in_key = _TIMESTAMP_IN_KEY.get(name)
    if in_key is None:
        return
    groups = max_parallelism if in_key else None
    for composite in composites:
        try:
            key_group, key, user_key = split_composite_key(composite)
        except struct_error:
            key_group = int.from_bytes(composite[: KEY_GROUP_PREFIX.size], "big")
            raise _malformed_timer(name, key_group, "a truncated key", source) from None
        length = len(key if in_key else user_key)
        if length != _TIMESTAMP.size:
            raise _malformed_timer(name, key_group, _bad_length(length), source)
        if groups and _hash(user_key, 0, False) % groups != key_group:
            raise _malformed_timer(name, key_group, _other_key_group(user_key, groups), source)


def check_timer_change(
    name: str,
    key_group: int,
    key: bytes,
    user_key: bytes,
    is_map: bool,
    source: str | None,
    max_parallelism: int | None = None,
) -> None:
    """CheckpointCorruptedError unless a changelog change that writes an entry of state
    ``name`` (``is_map``: a map entry, else a value) is a timer's, if it is a timer
    store's (in its timer key's key group too, given ``max_parallelism``)."""
    in_key = _TIMESTAMP_IN_KEY.get(name)
    if in_key is None:
        return
    if not is_map:
        raise _malformed_timer(name, key_group, "a value change (timers are map entries)", source)
    length = len(key if in_key else user_key)
    if length != _TIMESTAMP.size:
        raise _malformed_timer(name, key_group, _bad_length(length, "a change"), source)
    if in_key and max_parallelism and _hash(user_key, 0, False) % max_parallelism != key_group:
        problem = _other_key_group(user_key, max_parallelism, "a change")
        raise _malformed_timer(name, key_group, problem, source)


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
    while a frontier exists; ``_pending`` holds changes of timers beyond the frontier only
    (a frontier moves to later timers only by a refill, which settles them first);
    ``_heads`` holds an entry for the first cached timer of every key group, among stale
    entries that are skipped when met.
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
        self._pending: dict[bytes, bool] = {}
        """Changes beyond the cached ranges not yet applied (see ``settle``): ``by_key``
        composite key -> whether the timer is to be present. Only bytes and bools, which
        the garbage collector does not track: thousands of tuples waiting here would be
        promoted to its oldest generation and trigger full collections."""
        self._count = 0 if count is None else count
        self._held: dict[CurrentKey, set[int]] | None = None
        """While ``fire(..., fire_new=False)`` runs: per key, the due timers registered
        meanwhile, registered when it returns (``_held_until``: its bound)."""
        self._held_until = 0
        self._doomed: dict[CurrentKey, set[int]] = {}
        """While ``fire(..., fire_new=False)`` runs: per key, the due timers deleted
        meanwhile. They are no longer listed, but still fire in their turn."""
        self._firing: tuple[CurrentKey, int] | None = None
        self._firing_listed = False
        """While ``fire(..., fire_new=False)`` runs ``on_timer``: its timer, and whether it
        is listed (as in Spark, until its handler returns, unless deleted)."""
        read = None if count is None or cache_entries is None else cache_entries + 1
        for key_group in key_groups:
            composites = by_time.composite_keys_from(
                key_group, KEY_GROUP_PREFIX.pack(key_group), read
            )
            if count is None:
                self._count += len(composites)
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
        self.settle()
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

    def change(self, current: CurrentKey, timestamp: Any, present: bool) -> None:
        """Register (``present``) or delete the timer (current key, ``timestamp``):
        registering a timer that exists or deleting one that does not changes nothing.
        StateAccessError for a timestamp that is not an int of signed 64 bits.

        Within the key group's cached range the cache tells whether the timer exists and
        the stores change now; beyond it the change waits in ``_pending`` for ``settle``
        (as Flink's RocksDB timer queue, registering reads nothing from the store)."""
        if type(timestamp) is not int:  # the exact type: one test on the hot path
            timestamp = check_timestamp(timestamp)  # passes int subclasses but bool
        key_group, key, prefix = current
        try:
            time_prefix = _TIME_PREFIX.pack(key_group, 8, timestamp + _SIGN_BIT)
        except struct_error:
            raise _bad_timestamp(timestamp) from None
        if self._held is not None and timestamp <= self._held_until:
            self._hold(current, timestamp, present, time_prefix)
            return
        composite = time_prefix + key
        ts8 = time_prefix[_TIME_FROM:]
        frontier = self._frontier.get(key_group)
        if frontier is not None and composite > frontier:
            pending = self._pending
            pending[prefix + ts8] = present
            if len(pending) >= _PENDING_LIMIT:
                self.settle()
            return
        cache = self._cache.get(key_group)
        if cache is None:
            if not present:
                return
            cache = self._cache[key_group] = []
        index = bisect_left(cache, composite)
        if (index < len(cache) and cache[index] == composite) is present:
            return
        self._write(current, _new_tuple(CurrentKey, (key_group, ts8, time_prefix)), present)
        if not present:
            self._removed_from_cache(key_group, cache, index)
            return
        cache.insert(index, composite)
        if index == 0:
            heappush(self._heads, _head(key_group, composite))
            if len(self._heads) > 2 * len(self._cache) + 64:
                self._compact_heads()
        limit = self._cache_entries
        if limit is not None and len(cache) > limit:
            cache.pop()  # the last stays in the store only
            self._frontier[key_group] = cache[-1]

    def _write(self, current: CurrentKey, time_key: CurrentKey, present: bool) -> None:
        """Put or remove both entries of the timer (current key, ``time_key.key``: its
        ``ts8``), and count it."""
        ts8 = time_key.key
        if present:
            self._by_key.map_put(current, ts8, b"")
            self._by_time.map_put(time_key, current.key, b"")
            self._count += 1
        else:
            self._by_key.map_remove(current, ts8)
            self._by_time.map_remove(time_key, current.key)
            self._count -= 1

    def settle(self) -> None:
        """Apply the changes waiting beyond the cached ranges: read whether each timer
        exists (in key order, which RocksDB serves faster than random order) and write
        only those whose existence changes. Must run before anything reads the stores or
        writes their buffered writes out; until then the waiting changes are in no store."""
        pending = self._pending
        if not pending:
            return
        self._pending = {}
        exists, write = self._by_key.map_get, self._write
        for composite, present in sorted(pending.items()):
            # composite = [key group][key length][key][ts8]: the records without packing.
            prefix, ts8 = composite[:-8], composite[-8:]
            key_group = prefix[0] << 8 | prefix[1]
            current = _new_tuple(CurrentKey, (key_group, prefix[_KEY_FROM:], prefix))
            if (exists(current, ts8) is None) is present:
                time_prefix = prefix[:_KEY_LENGTH_FROM] + _LENGTH_8 + ts8
                write(current, _new_tuple(CurrentKey, (key_group, ts8, time_prefix)), present)

    @property
    def count(self) -> int:
        """How many timers the queue holds."""
        self.settle()
        return self._count

    def _compact_heads(self) -> None:
        """Drop the stale heads (timers registered in descending order leave many)."""
        self._heads = [_head(g, cache[0]) for g, cache in self._cache.items() if cache]
        heapify(self._heads)

    def _hold(self, current: CurrentKey, timestamp: int, present: bool, time_prefix: bytes) -> None:
        """A change of a due timer while ``fire(..., fire_new=False)`` runs, as Spark's
        transformWithState treats it: the timers due when firing began all fire, and only
        they; a timer fires with its handler seeing it registered, and is deleted when the
        handler returns. So a new one is held for after the call; a deleted one still
        fires, unlisted, unless it was one held; the firing one is listed or not."""
        held = self._held
        assert held is not None
        if (current, timestamp) == self._firing:
            self._firing_listed = present
        elif present:
            doomed = self._doomed.get(current)
            if doomed and timestamp in doomed:
                doomed.discard(timestamp)
            elif not self._exists(current, time_prefix):
                held.setdefault(current, set()).add(timestamp)
        elif timestamp in held.get(current, ()):
            held[current].discard(timestamp)
        elif self._exists(current, time_prefix):
            self._doomed.setdefault(current, set()).add(timestamp)

    def _exists(self, current: CurrentKey, time_prefix: bytes) -> bool:
        """Whether the timer (current key, the timestamp of ``time_prefix``) is stored,
        from the cache within its range, else from what waits in ``_pending`` or the
        store: one lookup."""
        key_group, key, prefix = current
        composite = time_prefix + key
        frontier = self._frontier.get(key_group)
        if frontier is not None and composite > frontier:
            ts8 = time_prefix[_TIME_FROM:]
            waiting = self._pending.get(prefix + ts8)
            if waiting is not None:
                return waiting
            return self._by_key.map_get(current, ts8) is not None
        cache = self._cache.get(key_group)
        if not cache:
            return False
        index = bisect_left(cache, composite)
        return index < len(cache) and cache[index] == composite

    def timestamps(self, current: CurrentKey) -> Iterator[int]:
        """The current key's timer timestamps, ascending (while timers fire with
        ``fire_new=False``, as its handlers see them)."""
        self.settle()
        registered = {decode_timestamp(ts8) for ts8, _ in self._by_key.map_items(current)}
        if self._held is not None:
            registered.update(self._held.get(current, ()))
            registered.difference_update(self._doomed.get(current, ()))
            firing = self._firing
            if firing is not None and firing[0] == current and self._firing_listed:
                registered.add(firing[1])
        return iter(sorted(registered))

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

    def fire(
        self, until: int, on_timer: Callable[[CurrentKey, int], None], fire_new: bool = True
    ) -> int:
        """Remove and pass to ``on_timer`` every timer at or before ``until``, in
        (timestamp, key) order; returns how many. Timers that ``on_timer`` registers at or
        before ``until`` fire too (Flink's timer service), or with ``fire_new=False`` are
        held and registered when this returns, to fire in a later call, while the due
        timers it deletes still fire (Spark's transformWithState: the timers due when
        firing begins fire, and only they)."""
        if fire_new:
            return self._fire(until, on_timer)
        self._held, self._held_until = {}, until

        def as_in_spark(current: CurrentKey, timestamp: int) -> None:
            doomed = self._doomed.get(current, set())
            was_deleted = timestamp in doomed
            doomed.discard(timestamp)
            self._firing, self._firing_listed = (current, timestamp), not was_deleted
            try:
                on_timer(current, timestamp)
            finally:
                self._firing = None

        try:
            return self._fire(until, as_in_spark)
        finally:
            # Deleted timers left (on_timer raised before their turn) are deleted, and the
            # new ones registered: the queue holds what the handlers left, as with
            # fire_new=True.
            held, doomed, self._held, self._doomed = self._held, self._doomed, None, {}
            for changes, present in ((doomed, False), (held, True)):
                for current, timestamps in changes.items():
                    for timestamp in sorted(timestamps):
                        self.change(current, timestamp, present)

    def _fire(self, until: int, on_timer: Callable[[CurrentKey, int], None]) -> int:
        fired = 0
        while (head := self._first()) is not None and head[0] <= until:
            timestamp, key, key_group, _ = heappop(self._heads)
            ts8 = encode_timestamp(timestamp)
            current = CurrentKey.of(key_group, key)
            self._by_time.map_remove(CurrentKey.of(key_group, ts8), key)
            self._by_key.map_remove(current, ts8)
            self._count -= 1
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

    def settle(self) -> None:
        """Apply the timer changes that wait beyond the cached ranges (``TimerQueue.settle``):
        the backend calls it before it writes its buffered writes out."""
        self._event.settle()
        self._processing.settle()

    def register_event_time_timer(self, timestamp: int) -> None:
        self._event.change(self._current_key(), timestamp, True)

    def register_processing_time_timer(self, timestamp: int) -> None:
        self._processing.change(self._current_key(), timestamp, True)

    def delete_event_time_timer(self, timestamp: int) -> None:
        self._event.change(self._current_key(), timestamp, False)

    def delete_processing_time_timer(self, timestamp: int) -> None:
        self._processing.change(self._current_key(), timestamp, False)

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

    def _fire(self, queue: TimerQueue, until: int, on_timer: OnTimer, fire_new: bool) -> int:
        set_current = self._set_current

        def fire_one(current: CurrentKey, timestamp: int) -> None:
            on_timer(set_current(current), timestamp)

        return queue.fire(until, fire_one, fire_new)

    def advance_watermark(self, timestamp: int, on_timer: OnTimer, fire_new: bool = True) -> int:
        until = max(self._clocks.watermark, check_timestamp(timestamp))
        self._clocks = self._clocks._replace(watermark=until)
        return self._fire(self._event, until, on_timer, fire_new)

    def advance_processing_time(
        self, timestamp: int, on_timer: OnTimer, fire_new: bool = True
    ) -> int:
        until = max(self._clocks.processing_time, check_timestamp(timestamp))
        self._clocks = self._clocks._replace(processing_time=until)
        return self._fire(self._processing, until, on_timer, fire_new)

    def snapshot_info(self) -> TimerSnapshotInfo:
        """The clocks, counts and earliest timestamps now."""
        return TimerSnapshotInfo(
            self._clocks,
            self.counts(),
            {domain: queue.earliest() for domain, queue in self._queues.items()},
        )
