"""The keyed state backend interface, shared by the heap and RocksDB backends.

A backend owns one key-group range of one operator's subtask. ``set_current_key`` picks
the key that state calls act on; ``get_state`` registers a state (or takes over a
restored one, checking and migrating its serializer); ``sync_cut`` freezes the state for
a snapshot; ``restore`` loads entries read from a snapshot.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

from statebackend.backends.changelog import (
    Change,
    ChangeOp,
    ChangeSet,
    LoggingStateStore,
    apply_change,
)
from statebackend.backends.keyed_states import (
    STATE_IMPLEMENTATIONS,
    KeyContext,
    KeyedStateImpl,
    decode_list,
    encode_list,
    stored_value_serializer,
)
from statebackend.backends.stores import (
    CurrentKey,
    Entry,
    StateStore,
    StateStoreView,
    split_composite_key,
)
from statebackend.backends.timers import (
    KeyedTimerService,
    TimerClocks,
    TimerSnapshotInfo,
    check_timer_change,
    check_timer_state,
    checked_timer_entries,
    timer_state_metas,
)
from statebackend.errors import IncompatibleStateError, StateAccessError
from statebackend.keygroups import KeyGroupRange, assign_to_key_group, check_max_parallelism
from statebackend.serializers import (
    Compatibility,
    Serializer,
    SerializerConfig,
    StrSerializer,
    resolve_serializer,
    serializer_from_config,
)
from statebackend.serializers.base import config_problem
from statebackend.state.descriptors import MapStateDescriptor, StateDescriptor, StateKind
from statebackend.state.interfaces import State
from statebackend.state.timers import TimerService, is_timer_state
from statebackend.state.ttl import Clock


@dataclass(frozen=True)
class StateMetaInfo:
    """What a snapshot records of one state: its name, kind and stored serializers."""

    name: str
    kind: StateKind
    serializers: dict[str, SerializerConfig]

    @classmethod
    def of(cls, descriptor: StateDescriptor) -> StateMetaInfo:
        """The meta info of a registered descriptor (value serializer TTL-wrapped)."""
        serializers = descriptor.serializer_configs()
        serializers["value"] = stored_value_serializer(descriptor).config()
        return cls(descriptor.name, descriptor.kind, serializers)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for metadata files."""
        return {"name": self.name, "kind": self.kind.value, "serializers": self.serializers}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StateMetaInfo:
        """The inverse of ``to_json``."""
        name, kind, serializers = data["name"], StateKind(data["kind"]), data["serializers"]
        if not isinstance(name, str):
            raise TypeError(f"state name {name!r} is not a string")
        check_serializer_configs(f"state {name!r}", serializers, _roles(name, kind))
        return cls(name, kind, dict(serializers))


def _roles(name: str, kind: StateKind) -> tuple[str, ...]:
    """The serializer roles every snapshot of state ``name`` of ``kind`` records (a
    timer store's are its own)."""
    if is_timer_state(name):
        return ()
    return ("user_key", "value") if kind is StateKind.MAP else ("value",)


def check_serializer_configs(what: str, serializers: Any, roles: tuple[str, ...]) -> None:
    """TypeError unless ``serializers``, read from a snapshot for ``what``, maps each of
    ``roles`` (and maybe others) to a well-formed serializer config."""
    if not isinstance(serializers, dict):
        raise TypeError(f"{what} has serializers {serializers!r}, not a JSON object")
    missing = [role for role in roles if role not in serializers]
    if missing:
        raise TypeError(f"{what} has no {' or '.join(missing)} serializer")
    for config in serializers.values():
        problem = config_problem(config)
        if problem is not None:
            raise TypeError(f"{what}: {problem}")


@dataclass(frozen=True)
class NativeCheckpoint:
    """The native RocksDB checkpoint a cut was taken from, for the incremental format.

    ``directory`` holds the checkpoint's files (hard links; removed when the cut is
    released). ``records`` is a directory of the backend that outlives the cut and
    ``close()``/reopen (and goes with the database), where incremental snapshots note
    which files they uploaded, so that later snapshots upload each file only once.
    """

    directory: Path
    records: Path


SerializedKeys = tuple[list[bytes], list[int]]
"""Keys' serialized bytes and key groups, in the keys' order (``read_ahead``)."""

Release = Callable[[], None]
"""Frees what a snapshot's synchronous cut holds (copies, RocksDB hard links)."""

HandleT = TypeVar("HandleT")
HandleT_co = TypeVar("HandleT_co", covariant=True)


class FrozenState(NamedTuple):
    """What a backend's ``_freeze`` returns: frozen views of its stores, a release
    callable (or None) and, for RocksDB, the native checkpoint they read from."""

    views: dict[str, StateStoreView]
    release: Release | None
    native: NativeCheckpoint | None = None


@dataclass
class KeyedStateCut:
    """A backend's keyed state frozen at one instant, for the async part of a snapshot.

    Later changes to the backend do not show in it. ``release()`` frees what it holds
    (copies, RocksDB hard links) and must be called once the snapshot is written or
    abandoned.
    """

    key_serializer: SerializerConfig
    max_parallelism: int
    key_group_range: KeyGroupRange
    states: list[StateMetaInfo]
    views: dict[str, StateStoreView]
    _release: Release | None = field(default=None, repr=False)
    native: NativeCheckpoint | None = None
    timers: TimerSnapshotInfo | None = None

    def entries(self, key_group: int) -> Iterator[tuple[str, Entry]]:
        """(state name, entry) pairs of one key group, state by state in ``states`` order."""
        for meta in self.states:
            for entry in self.views[meta.name].entries(key_group):
                yield meta.name, entry

    def release(self) -> None:
        """Free the cut's resources; safe to call more than once."""
        release, self._release = self._release, None
        if release is not None:
            release()


class SnapshotResult(Protocol[HandleT_co]):
    """The asynchronous part of a snapshot while it runs (``snapshot.future``'s
    ``SnapshotFuture``): it yields the state handle, can be cancelled, and tells when it
    ends."""

    def result(self, timeout: float | None = None) -> HandleT_co:
        """The state handle, once written; raises CheckpointError if the part failed or
        was cancelled, TimeoutError after ``timeout``."""

    def cancel(self) -> bool:
        """Stop it; True means no handle is ever returned and nothing is left behind."""

    def done(self) -> bool:
        """Whether it finished, failed or was cancelled."""

    def add_done_callback(self, callback: Callable[[SnapshotResult[HandleT_co]], None]) -> None:
        """Call ``callback(self)`` when it ends (at once if it has)."""


class SnapshotTarget(Protocol[HandleT_co]):
    """Where a snapshot goes: the checkpoint layer supplies one per (operator, subtask)."""

    def write_keyed_snapshot(
        self, checkpoint_id: int, cut: KeyedStateCut
    ) -> SnapshotResult[HandleT_co]:
        """Start writing ``cut`` in the background; return its running result, which
        releases ``cut`` when it ends."""


class KeyedStateBackend(ABC):
    """Keyed state of one subtask: state per key, organised in key groups, and its timers
    (``timer_service``)."""

    _timer_cache_entries: int | None = 128
    """Timers per key group the timer service keeps in memory (None: all of them)."""

    def __init__(
        self,
        *,
        max_parallelism: int,
        key_group_range: KeyGroupRange,
        key_serializer: Serializer[Any] | None = None,
        clock: Clock = time.time,
    ) -> None:
        check_max_parallelism(max_parallelism)
        if key_group_range and key_group_range.end >= max_parallelism:
            raise StateAccessError(
                f"key-group range {key_group_range} lies outside 0..{max_parallelism - 1}"
            )
        self.max_parallelism = max_parallelism
        self.key_group_range = key_group_range
        self.key_serializer: Serializer[Any] = key_serializer or StrSerializer()
        self._encode_key = self.key_serializer.encoder()
        self.clock = clock
        self._keys = KeyContext()
        self._stores: dict[str, StateStore] = {}
        self._states: dict[str, KeyedStateImpl] = {}
        self._restored: dict[str, StateMetaInfo] = {}
        self._changelog: dict[str, LoggingStateStore] | None = None
        self._disposed = False
        self._batching = False
        self._batch_keys: dict[Any, int] | None = None
        """Keys read ahead in the open batch: key -> its position in ``_batch_key_objects``
        and ``_batch_records`` (positions, not pairs: a batch's keys then allocate no
        tuples for the garbage collector to scan); None until first needed."""
        self._batch_key_objects: list[Any] = []
        self._batch_records: list[CurrentKey] = []
        self._timer_service: KeyedTimerService | None = None
        self._timer_metas: dict[str, StateMetaInfo] = {}
        self._timer_clocks: TimerClocks | None = None
        """The clocks restored (None: none restored yet); the service owns them once created."""
        self._timer_counts: dict[str, int] | None = None
        """Timer counts known without counting (a reopened RocksDB backend's)."""

    # -- keys ---------------------------------------------------------------------------

    def set_current_key(self, key: Any, record: CurrentKey | None = None) -> None:
        """Make ``key`` the key that state calls act on.

        ``record``, if given, is the one ``read_ahead`` returned for ``key`` in the open
        batch: the key is then neither encoded nor looked up again.

        Raises StateAccessError for None or a key outside the owned key-group range,
        SerializationError for a key the key serializer cannot encode.
        """
        if self._disposed:
            self._check_open()
        keys = self._keys
        if record is not None:
            keys.record = record
            keys.key = key
            return
        known = self._batch_keys
        if known is None and self._batch_key_objects:
            known = self._index_batch_keys()
        if known:
            try:
                position = known.get(key)
            except TypeError:  # an unhashable key: never read ahead
                position = None
            # The very object read ahead: equal keys of other types (1, 1.0, True)
            # serialize differently.
            if position is not None and self._batch_key_objects[position] is key:
                keys.record = self._batch_records[position]
                keys.key = key
                return
        keys.record = self._current_key_of(key)
        keys.key = key

    def _current_key_of(self, key: Any) -> CurrentKey:
        """The current-key record of ``key``, with ``set_current_key``'s checks."""
        if key is None:
            raise StateAccessError("None cannot be a key: give every record a key")
        try:
            encoded = self._encode_key(key)
        except Exception:
            encoded = self.key_serializer.serialize(key)
        key_group = assign_to_key_group(encoded, self.max_parallelism)
        owned = self.key_group_range
        if not owned.start <= key_group <= owned.end:
            raise StateAccessError(
                f"key {key!r} is in key group {key_group}, outside this backend's "
                f"key-group range {self.key_group_range.start}..{self.key_group_range.end}: "
                f"route records to the subtask that owns their key group"
            )
        return CurrentKey.of(key_group, encoded)

    def _current_keys_of(
        self, keys: list[Any], serialized: SerializedKeys | None = None
    ) -> list[CurrentKey]:
        """The current-key records of ``keys``, as ``_current_key_of`` gives them: each
        step over all keys at once (no Python frame per key where the key serializer's
        encoder is native, as ``str.encode`` is, or where ``serialized`` gives the keys'
        bytes and key groups), and key by key with its checks and errors when a key
        fails one."""
        max_parallelism, owned = self.max_parallelism, self.key_group_range
        try:
            if serialized is None:
                encoded = list(map(self._encode_key, keys))
                groups = [assign_to_key_group(data, max_parallelism) for data in encoded]
            else:
                encoded, groups = serialized
                if len(encoded) != len(keys) or len(groups) != len(keys):
                    raise ValueError("serialized keys do not match the keys")
            checked = None not in keys and (
                not groups or owned.start <= min(groups) <= max(groups) <= owned.end
            )
        except Exception:
            checked = False
        if not checked:
            return [self._current_key_of(key) for key in keys]
        return CurrentKey.of_many(groups, encoded)

    def _read_ahead_keys(
        self, keys: Iterable[Any], serialized: SerializedKeys | None = None
    ) -> list[CurrentKey]:
        """The current-key records of ``keys`` (checked as ``set_current_key`` checks
        them; ``serialized`` as ``read_ahead`` takes it), remembered until the batch ends
        so that ``set_current_key`` of the same key objects does not compute them again."""
        keys = list(keys)
        records = self._current_keys_of(keys, serialized)
        if self._batch_keys is not None:
            self._index_keys(keys, len(self._batch_records))
        self._batch_key_objects.extend(keys)
        self._batch_records.extend(records)
        return records

    def _index_batch_keys(self) -> dict[Any, int]:
        """``_batch_keys`` of the keys read ahead so far, built when ``set_current_key``
        first looks a key up (a caller that passes records never needs it)."""
        self._batch_keys = {}
        self._index_keys(self._batch_key_objects, 0)
        return self._batch_keys

    def _index_keys(self, keys: list[Any], first: int) -> None:
        known = self._batch_keys
        assert known is not None
        try:
            known.update(zip(keys, range(first, first + len(keys)), strict=True))
        except TypeError:  # an unhashable key: it is computed again when it is set
            for position, key in enumerate(keys, first):
                with suppress(TypeError):
                    known[key] = position

    @property
    def current_key(self) -> Any:
        """The key set by ``set_current_key`` (None before the first)."""
        return self._keys.key

    def _set_current_record(self, current: CurrentKey) -> Any:
        """Make the serialized key ``current`` current (a timer's); returns the key."""
        key = self.key_serializer.deserialize(current.key)
        self._keys.record, self._keys.key = current, key
        return key

    def _require_current(self) -> CurrentKey:
        current = self._keys.record
        if current is None or self._disposed:
            self._check_open()
            raise StateAccessError("no current key: call set_current_key(key) before using state")
        return current

    # -- batches ------------------------------------------------------------------------

    @contextmanager
    def batch(self, keys: Iterable[Any] = ()) -> Iterator[None]:
        """Run the block as one batch of state accesses: the state of ``keys`` (and of
        the keys given to ``prefetch`` inside the block) is read by multi-get per state,
        on the state's first read, and writes are buffered and written at once
        when the block ends (whether it ends normally or by an exception), before a
        ``sync_cut`` and before ``drain_changelog``. Reads see the block's own writes;
        every state call gives exactly what it gives outside a batch. A backend whose
        state is in memory (heap) has nothing to read ahead or buffer, but checks the keys
        alike. Raises StateAccessError for a key ``set_current_key`` would refuse, and
        when a batch is already open."""
        self._check_open()
        if self._batching:
            raise StateAccessError("a batch is already open on this backend: end it first")
        self._batching = True
        self._begin_batch()
        try:
            self.prefetch(keys)
            yield
        finally:
            self._batching = False
            self._batch_keys, self._batch_key_objects, self._batch_records = None, [], []
            if not self._disposed:
                self._end_batch()

    def prefetch(self, keys: Iterable[Any]) -> None:
        """Inside ``batch``: add ``keys`` to the keys whose state is read ahead (by
        multi-get per state, on the state's next read). Outside a batch it does nothing."""
        if self._batching:
            self._prefetch(keys)

    def read_ahead(
        self, keys: list[Any], serialized: SerializedKeys | None = None
    ) -> list[CurrentKey] | None:
        """``prefetch`` of ``keys`` that also returns their current-key records, in
        order, for ``set_current_key(key, record)``; None outside a batch.

        ``serialized``, if given, is each key's bytes (as the key serializer encodes it)
        and key group (``assign_to_key_group`` of those bytes), computed by the caller
        for all keys at once (``spark/arrow_keys.py``): the backend then computes
        neither and checks only that the key groups are its own."""
        if not self._batching:
            return None
        return self._prefetch(keys, serialized)

    def estimated_entries(self) -> int:
        """How many entries the backend's states (timers included) hold, as the stores
        estimate them (``StateStore.estimated_entries``): for metrics, not for logic. An
        open batch's buffered writes are written first, so they count."""
        self._check_open()
        self._write_batch()
        return sum(store.estimated_entries() for store in self._stores.values())

    def counted_entries(self) -> int | None:
        """How many entries the backend's states hold, timers not counted, exactly; None
        where counting them would read them all (RocksDB: its estimate counts each
        version of an overwritten key until a compaction merges them). For metrics."""
        return None

    def estimated_memory_bytes(self) -> int | None:
        """The memory the backend's states take, as its storage estimates it; None if it
        does not (the heap backend: measuring would walk every entry). For metrics."""
        return None

    def keys(self, state_name: str) -> Iterator[Any]:
        """The keys that have a value in state ``state_name``, each once."""
        self._check_open()
        store = self._stores.get(state_name)
        if store is None:
            raise StateAccessError(f"state {state_name!r} is not registered in this backend")
        return (self.key_serializer.deserialize(k) for k in store.keys())

    # -- states -------------------------------------------------------------------------

    def get_state(self, descriptor: StateDescriptor) -> State:
        """The state described by ``descriptor``, registering it on first use.

        A restored state of the same name must be of the same kind and have a compatible
        serializer (migrated here if needed), else IncompatibleStateError.
        """
        self._check_open()
        existing = self._states.get(descriptor.name)
        if existing is not None:
            if existing.descriptor.kind is not descriptor.kind:
                raise StateAccessError(
                    f"state {descriptor.name!r} is registered as {existing.descriptor.kind.value} "
                    f"state and cannot also be {descriptor.kind.value} state: use another name"
                )
            return existing
        store = self._store_for(descriptor.name, descriptor.kind is StateKind.MAP)
        restored = self._restored.get(descriptor.name)
        if restored is not None:
            self._take_over(restored, descriptor, store)
            # Only once taken over: a failed attempt must not let a retry skip the checks.
            del self._restored[descriptor.name]
        impl = STATE_IMPLEMENTATIONS[descriptor.kind](
            descriptor, store, self._keys, self._require_current, self.clock
        )
        self._states[descriptor.name] = impl
        return impl

    def _take_over(
        self, restored: StateMetaInfo, descriptor: StateDescriptor, store: StateStore
    ) -> None:
        old_value = stored_reader(restored, descriptor)
        if old_value is not None:
            migrate_values(store, descriptor.kind, old_value, stored_value_serializer(descriptor))

    def state_meta(self) -> list[StateMetaInfo]:
        """Meta info of every state this backend holds (registered, restored, timer
        stores), by name."""
        metas = {name: StateMetaInfo.of(s.descriptor) for name, s in self._states.items()}
        metas.update(self._restored)
        metas.update(self._timer_metas)
        return [metas[name] for name in sorted(metas)]

    # -- timers ---------------------------------------------------------------------------

    @property
    def timer_service(self) -> TimerService:
        """The backend's event-time and processing-time timers (one service per backend),
        created on first use from the timer stores the backend holds."""
        return self._timers()

    def _timers(self) -> KeyedTimerService:
        self._check_open()
        if self._timer_service is None:
            for name, kind, serializers in timer_state_metas():
                self._timer_metas[name] = StateMetaInfo(name, kind, serializers)
                self._restored.pop(name, None)
            self._timer_service = KeyedTimerService(
                lambda name: self._store_for(name, is_map=True),
                self.key_group_range,
                self._timer_cache_entries,
                self._require_current,
                self._set_current_record,
                self._timer_clocks or TimerClocks(),
                self._timer_counts,
            )
        return self._timer_service

    def timer_clocks(self) -> TimerClocks:
        """The watermark and processing time (restored ones until the service exists)."""
        if self._timer_service is not None:
            return self._timer_service.clocks
        return self._timer_clocks or TimerClocks()

    def _timer_snapshot_info(self) -> TimerSnapshotInfo:
        if self._timer_service is None and not any(map(is_timer_state, self._stores)):
            return TimerSnapshotInfo.empty(self.timer_clocks())
        return self._timers().snapshot_info()

    # -- snapshot and restore -------------------------------------------------------------

    def sync_cut(self) -> KeyedStateCut:
        """Freeze the current state (the synchronous part of a snapshot)."""
        self._check_open()
        self._write_batch()
        timers = self._timer_snapshot_info()
        metas = self.state_meta()
        frozen = self._freeze([meta.name for meta in metas])
        return KeyedStateCut(
            self.key_serializer.config(),
            self.max_parallelism,
            self.key_group_range,
            metas,
            frozen.views,
            frozen.release,
            frozen.native,
            timers,
        )

    def snapshot(
        self, checkpoint_id: int, target: SnapshotTarget[HandleT]
    ) -> SnapshotResult[HandleT]:
        """Take the synchronous cut now and hand it to ``target`` to write in the background.

        Returns the target's running result (a ``SnapshotFuture`` for the checkpoint
        storage).
        """
        cut = self.sync_cut()
        try:
            return target.write_keyed_snapshot(checkpoint_id, cut)
        except BaseException:
            cut.release()
            raise

    def restore(
        self,
        key_serializer: SerializerConfig,
        states: Iterable[StateMetaInfo],
        entries: Iterable[tuple[str, int, Entry]],
        timers: TimerSnapshotInfo | None = None,
        *,
        source: str | None = None,
    ) -> None:
        """Load snapshot entries (state name, key group, entry) of this backend's range,
        and the snapshot's timer clocks (``timers``; several restores keep the earliest).

        Must precede ``get_state`` for the restored names, and ``timer_service``; entries
        of key groups outside the range are skipped. The key serializer must match the
        stored one exactly (keys decide key groups), else IncompatibleStateError. An entry
        of a timer store that is no timer's is CheckpointCorruptedError naming ``source``
        (the file the entries come from), if given, and the state and key group.
        """
        conversions = self._begin_restore(key_serializer, states, timers, source)
        in_range = (
            (name, (key_group, entry))
            for name, key_group, entry in entries
            if key_group in self.key_group_range
        )
        for name, run in groupby(in_range, key=itemgetter(0)):
            items: Iterator[tuple[int, Entry]] = (item for _, item in run)
            convert = conversions.get(name)
            if convert is not None:
                items = ((group, (k, uk, convert(value))) for group, (k, uk, value) in items)
            if is_timer_state(name):
                items = checked_timer_entries(name, items, source, self.max_parallelism)
            self._restored_store(name).write_entries(items)
        self._end_restore(timers)

    def restore_sorted(
        self,
        key_serializer: SerializerConfig,
        states: Iterable[StateMetaInfo],
        runs: Iterable[tuple[str, int, list[tuple[bytes, bytes]]]],
        timers: TimerSnapshotInfo | None = None,
        *,
        source: str | None = None,
    ) -> int:
        """``restore`` from runs of (state name, key group, its (composite key, value)
        pairs) in a snapshot's order, as the snapshot readers give them; returns the number
        of entries loaded. This one splits the composite keys into entries; a backend that
        loads sorted runs faster overrides it (RocksDB: SST files, ingested)."""
        loaded = 0

        def entries() -> Iterator[tuple[str, int, Entry]]:
            nonlocal loaded
            for name, key_group, pairs in runs:
                if key_group not in self.key_group_range:
                    continue
                loaded += len(pairs)
                for composite, value in pairs:
                    _, key, user_key = split_composite_key(composite)
                    yield name, key_group, (key, user_key, value)

        self.restore(key_serializer, states, entries(), timers, source=source)
        return loaded

    @property
    def scratch_dir(self) -> Path | None:
        """Where a restore downloads and stages files for this backend (None: the system's
        temp directory); RocksDB's is beside its database, so files can be moved in."""
        return None

    def accepts_native_checkpoint(self) -> bool:
        """Whether ``restore_native_checkpoint`` can make a native checkpoint (an
        incremental snapshot's RocksDB files) this backend's data now: never, but for a
        fresh RocksDB backend."""
        return False

    def restore_native_checkpoint(
        self,
        directory: Path,
        key_serializer: SerializerConfig,
        states: Iterable[StateMetaInfo],
        timers: TimerSnapshotInfo | None = None,
        *,
        source: str | None = None,
    ) -> None:
        """``restore`` without reading an entry: the native checkpoint in ``directory``
        becomes this backend's data. StateAccessError unless
        ``accepts_native_checkpoint()``."""
        raise StateAccessError(
            f"{type(self).__name__} cannot adopt a native checkpoint: restore its entries "
            f"with restore_sorted"
        )

    def _begin_restore(
        self,
        key_serializer: SerializerConfig,
        states: Iterable[StateMetaInfo],
        timers: TimerSnapshotInfo | None,
        source: str | None = None,
    ) -> dict[str, Callable[[bytes], bytes]]:
        """The checks and registrations of ``restore`` before any entry is loaded: a
        backend's own restore paths (bulk loading) start with it and end with
        ``_end_restore``. Returns, by state name, how to re-encode the values about to be
        loaded where an earlier restore into this backend stored that state with another
        value serializer (``_reconcile``): they must be loaded through it."""
        states = list(states)
        self._check_restorable(key_serializer, states, source)
        if self._timer_service is not None and (
            timers is not None or any(is_timer_state(meta.name) for meta in states)
        ):
            raise StateAccessError("timers are already in use: restore before timer_service")
        if any(is_timer_state(meta.name) for meta in states):
            self._timer_counts = None  # restored timers are counted when the service starts
        return self._register_restored(states)

    def _register_restored(
        self, states: list[StateMetaInfo]
    ) -> dict[str, Callable[[bytes], bytes]]:
        """Take the meta info of a handle or record about to be loaded: a state seen for
        the first time keeps it; one restored before is reconciled with it
        (``_reconcile``). Returns the conversions the loaded values need, by state name."""
        conversions: dict[str, Callable[[bytes], bytes]] = {}
        for meta in states:
            self._store_for(meta.name, meta.kind is StateKind.MAP)
            previous = self._restored.get(meta.name)
            if previous is None:
                self._restored[meta.name] = meta
                continue
            kept, convert = _reconcile(previous, meta, self._stores[meta.name])
            self._restored[meta.name] = kept
            if convert is not None:
                conversions[meta.name] = convert
        return conversions

    def _restored_store(self, name: str) -> StateStore:
        """The store of restored state ``name``; IncompatibleStateError if the snapshot
        gave no meta info for it."""
        store = self._stores.get(name)
        if store is None:
            raise IncompatibleStateError(
                f"snapshot has entries of state {name!r} but no meta info for it"
            )
        return store

    def _end_restore(self, timers: TimerSnapshotInfo | None) -> None:
        """Keep the restored timer clocks (several restores keep the earliest)."""
        if timers is not None:
            restored = timers.clocks
            self._timer_clocks = (
                restored if self._timer_clocks is None else self._timer_clocks.merged(restored)
            )

    def _check_restorable(
        self,
        key_serializer: SerializerConfig,
        states: Iterable[StateMetaInfo],
        source: str | None = None,
    ) -> None:
        """StateAccessError or IncompatibleStateError unless ``states``, stored with
        ``key_serializer``, can be restored now; CheckpointCorruptedError (naming
        ``source``, the file, if given) for a timer state the timer service does not keep."""
        self._check_open()
        if self.key_serializer.compatibility_with(key_serializer) is not (
            Compatibility.COMPATIBLE_AS_IS
        ):
            raise IncompatibleStateError(
                f"the state was keyed with key serializer {key_serializer}, not "
                f"{self.key_serializer.config()}: restore with the same key serializer"
            )
        for meta in states:
            if is_timer_state(meta.name):
                check_timer_state(meta.name, meta.kind, source)
            if meta.name in self._states:
                raise StateAccessError(
                    f"state {meta.name!r} is already in use: restore before get_state"
                )

    def _store_for(self, name: str, is_map: bool) -> StateStore:
        """The store through which state ``name`` is used, created on first use; with the
        changelog on, a ``LoggingStateStore`` around it. Whatever mutates state must
        take its store here, so that the changelog sees the change."""
        store = self._stores.get(name)
        if store is None:
            store = self._stores[name] = self._create_store(name, is_map)
        if self._changelog is None:
            return store
        logged = self._changelog.get(name)
        if logged is None:
            logged = self._changelog[name] = LoggingStateStore(store, is_map)
        return logged

    # -- changelog (``backends/changelog.py``) ----------------------------------------------

    def enable_changelog(self) -> None:
        """Record every change to this backend's state from now on, per batch, for
        ``drain_changelog``. Call it before the first ``get_state`` (after a restore or
        replay, which are not changes)."""
        self._check_open()
        if self._changelog is not None:
            return
        if self._states or self._timer_service is not None:
            raise StateAccessError(
                "the changelog must be enabled before the first get_state and timer_service, "
                "or changes made through the states taken so far would not be recorded"
            )
        self._changelog = {}

    def drain_changelog(self) -> ChangeSet:
        """The changes since ``enable_changelog`` or the previous drain, coalesced per
        entry, with the states' meta info now; the next batch starts empty."""
        self._check_open()
        if self._changelog is None:
            raise StateAccessError(
                "this backend does not record changes: call enable_changelog() first"
            )
        self._write_batch()
        changes = {name: store.take_changes() for name, store in self._changelog.items()}
        return ChangeSet(
            self.key_serializer.config(),
            self.max_parallelism,
            self.key_group_range,
            self.state_meta(),
            {name: groups for name, groups in changes.items() if groups},
            self._timer_snapshot_info(),
        )

    def replay(
        self,
        key_serializer: SerializerConfig,
        states: Iterable[StateMetaInfo],
        changes: Iterable[tuple[str, int, Change]],
        timers: TimerSnapshotInfo | None = None,
        same_batch: bool = False,
        *,
        source: str | None = None,
    ) -> None:
        """Apply the changes (state name, key group, change) of one changelog record to
        the key groups of this backend's range, after ``restore``, before ``get_state``
        and ``timer_service``.

        ``states`` is the meta info the record was written with: a state whose value
        serializer differs from the one restored so far is migrated to it first, as the
        live backend did when the state was registered with the new serializer, unless
        the one restored so far reads the record's (the record of an old subtask that had
        not registered the state since a serializer change, replayed after one that had,
        on a rescale): then the record's values are converted (``_reconcile``). The
        record's timer clocks (``timers``) replace the ones restored so far (records are
        replayed in batch order and clocks only move forward), unless ``same_batch``: a
        record of the batch whose clocks were replayed last (another old subtask's, on
        a rescale) leaves the earliest of both, as a restore from several handles does.
        A change that writes an entry of a timer store that is no timer's is
        CheckpointCorruptedError naming ``source`` (the record's file), if given.
        """
        states = list(states)
        self._check_restorable(key_serializer, states, source)
        if self._timer_service is not None:
            raise StateAccessError("timers are already in use: replay before timer_service")
        if timers is not None:
            clocks = self._timer_clocks
            if same_batch and clocks is not None:
                self._timer_clocks = clocks.merged(timers.clocks)
            else:
                self._timer_clocks = timers.clocks
        if any(is_timer_state(meta.name) for meta in states):
            self._timer_counts = None  # replayed timers are counted when the service starts
        conversions = self._register_restored(states)
        stores = self._stores  # not through the changelog: a replay is no change
        owned = self.key_group_range
        timer_stores = {meta.name for meta in states if is_timer_state(meta.name)}
        for name, key_group, change in changes:
            if key_group in owned:
                target = stores.get(name)
                if target is None:
                    raise IncompatibleStateError(
                        f"changelog record has changes of state {name!r} but no meta info for it"
                    )
                convert = conversions.get(name)
                if convert is not None and change.op in (ChangeOp.PUT, ChangeOp.MAP_PUT):
                    change = change._replace(value=convert(change.value))
                if name in timer_stores and change.op in (ChangeOp.PUT, ChangeOp.MAP_PUT):
                    is_map = change.op is ChangeOp.MAP_PUT
                    check_timer_change(
                        name,
                        key_group,
                        change.key,
                        change.user_key,
                        is_map,
                        source,
                        self.max_parallelism,
                    )
                apply_change(target, key_group, change)

    def dispose(self) -> None:
        """Release everything the backend holds; it cannot be used afterwards."""
        if not self._disposed:
            self._disposed = True
            self._keys.record = None  # states held elsewhere now fail as disposed
            self._states.clear()
            self._stores.clear()
            self._changelog = None
            self._timer_service = None
            self._close()

    def _check_open(self) -> None:
        if self._disposed:
            raise StateAccessError("this keyed state backend was disposed")

    # -- what each backend provides -------------------------------------------------------

    @abstractmethod
    def _create_store(self, name: str, is_map: bool) -> StateStore:
        """A new, empty store for state ``name``."""

    @abstractmethod
    def _freeze(self, names: list[str]) -> FrozenState:
        """Frozen views of the named stores, a release callable (or None), and the native
        checkpoint behind them if there is one."""

    @abstractmethod
    def _close(self) -> None:
        """Free the backend's resources."""

    @abstractmethod
    def _begin_batch(self) -> None:
        """Start buffering writes (``batch``)."""

    @abstractmethod
    def _prefetch(
        self, keys: Iterable[Any], serialized: SerializedKeys | None = None
    ) -> list[CurrentKey]:
        """Read ahead the state of ``keys`` in the open batch, if there is anything to
        read ahead; their records, checked as ``_current_key_of`` checks them (through
        ``_read_ahead_keys``)."""

    @abstractmethod
    def _write_batch(self) -> None:
        """Write the open batch's buffered writes now (the batch stays open); nothing
        when no batch is open."""

    @abstractmethod
    def _end_batch(self) -> None:
        """Write the batch's buffered writes and stop buffering."""


def stored_reader(restored: StateMetaInfo, descriptor: StateDescriptor) -> Serializer[Any] | None:
    """Check that ``descriptor`` can take over the stored state ``restored``: None when its
    values are readable as they are, the serializer to migrate them from otherwise;
    IncompatibleStateError naming the state if it is of another kind, a map state's user
    keys would need migrating, or its values cannot be read."""
    if restored.kind is not descriptor.kind:
        raise IncompatibleStateError(
            f"state {descriptor.name!r} was stored as {restored.kind.value} state and "
            f"cannot be read as {descriptor.kind.value} state: declare it as "
            f"{restored.kind.value} state again, or give the new state another name"
        )
    if isinstance(descriptor, MapStateDescriptor):
        stored_key = restored.serializers.get("user_key", {})
        if descriptor.key_serializer.compatibility_with(stored_key) is not (
            Compatibility.COMPATIBLE_AS_IS
        ):
            try:
                written: object = serializer_from_config(stored_key)
            except Exception:  # a config of an unknown or damaged serializer: as it is
                written = stored_key
            raise IncompatibleStateError(
                f"map state {descriptor.name!r} was stored with user keys {written!r}, which "
                f"{descriptor.key_serializer!r} cannot read (map keys are not migrated): "
                f"declare the user key as it was stored, or give the state another name"
            )
    new_value = stored_value_serializer(descriptor)
    return resolve_serializer(descriptor.name, new_value, restored.serializers["value"])


def _value_converter(
    kind: StateKind, old: Serializer[Any], new: Serializer[Any]
) -> Callable[[bytes], bytes]:
    """Re-encodes one stored value (each element of a list state) from ``old`` to ``new``."""
    if kind is StateKind.LIST:
        return lambda data: encode_list(
            new.serialize(old.deserialize(e)) for e in decode_list(data)
        )
    return lambda data: new.serialize(old.deserialize(data))


def migrate_values(
    store: StateStore, kind: StateKind, old: Serializer[Any], new: Serializer[Any]
) -> None:
    """Re-encode every value of ``store`` (each element of a list state) from ``old`` to
    ``new``: a serializer migration."""
    store.transform_values(_value_converter(kind, old, new))


def _reconcile(
    previous: StateMetaInfo, meta: StateMetaInfo, store: StateStore
) -> tuple[StateMetaInfo, Callable[[bytes], bytes] | None]:
    """The meta info a restored state keeps when another handle or changelog record of it
    comes with ``meta``, and how that one's values convert to it (None: as they are).

    The subtasks of one checkpoint or batch may store a state with different value
    serializers: a subtask takes a serializer change when it registers the state, and
    one that had no key for it since has not. When ``meta``'s serializer and the one
    restored so far (``previous``) read each other's values as they are, ``meta``
    replaces it: a changelog record is later than what it is replayed onto, and its
    names (a field renamed) are the ones a later schema evolves from by name. Else, when
    ``previous`` reads ``meta``'s values, it stays and they are converted as they are
    loaded; otherwise, or if that would drop part of them (``migration_loses``: a field
    ``meta``'s has and ``previous``'s lacks) and ``meta``'s reads it, what ``store`` holds
    so far is migrated to ``meta``'s. The state's declaration migrates the result once
    more as it asks. IncompatibleStateError when neither reads the other, or the kinds
    differ.
    """
    if previous.kind is not meta.kind:
        raise IncompatibleStateError(
            f"state {meta.name!r} was stored as {previous.kind.value} state and later as "
            f"{meta.kind.value} state: the changelog cannot be replayed"
        )
    if previous.serializers.get("value") == meta.serializers.get("value"):
        return meta, None  # timers have no value serializer
    kept = serializer_from_config(previous.serializers["value"])
    new = serializer_from_config(meta.serializers["value"])
    as_is = Compatibility.COMPATIBLE_AS_IS
    if (
        new.compatibility_with(previous.serializers["value"]) is as_is
        and kept.compatibility_with(meta.serializers["value"]) is as_is
    ):
        return meta, None  # the same bytes both ways (a field renamed): the later names
    lossy = kept.migration_loses(meta.serializers["value"]) and (
        new.compatibility_with(previous.serializers["value"]) is not Compatibility.INCOMPATIBLE
    )
    if not lossy:
        try:
            old = resolve_serializer(meta.name, kept, meta.serializers["value"])
        except IncompatibleStateError:
            pass
        else:
            return previous, None if old is None else _value_converter(meta.kind, old, kept)
    stored = resolve_serializer(meta.name, new, previous.serializers["value"])
    if stored is not None:
        migrate_values(store, meta.kind, stored, new)
    return meta, None
