"""Timer entries read back by a restore are timers: an entry of a timer store whose
timestamp is not the 8 bytes the timer service writes (a damaged or crafted snapshot,
checkpoint file or changelog record whose checksums were made to match) is refused by
the restore, naming the file (or the state and key group), instead of firing at a
garbage timestamp or failing later as a key that does not decode.

The timer stores' layout is taken from their documentation (``backends/timers.py``):
``by_time`` keys are the 8-byte timestamp with the timer key as user key, ``by_key`` the
reverse; the expectations of the undamaged restores are the timers registered.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.changelog import ChangeSet, MapKeyChanges, StateChanges
from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend, StateMetaInfo
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.backends.stores import CurrentKey, Entry
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointCorruptedError
from statebackend.keygroups import KeyGroupRange, assign_to_key_group
from statebackend.serializers import IntSerializer
from statebackend.state.descriptors import StateKind

M = 8
EVERYTHING = KeyGroupRange(0, M - 1)
KEY = 1
KEY_BYTES = struct.pack(">q", KEY)  # IntSerializer's encoding, computed independently
KEY_GROUP = assign_to_key_group(KEY_BYTES, M)
TIMERS = {"event": 5, "processing": 7}
STORES = [f"_timers.{domain}.{index}" for domain in TIMERS for index in ("by_time", "by_key")]
BAD_TIMESTAMPS = [b"", b"abc", b"\x80" + bytes(8)]  # 0, 3 and 9 bytes


def ts8(timestamp: int) -> bytes:
    """The documented timestamp encoding: sign bit flipped, big-endian."""
    return struct.pack(">Q", timestamp + (1 << 63))


def make(kind: str, tmp_path: Path, name: str = "db") -> KeyedStateBackend:
    options: dict[str, Any] = {
        "max_parallelism": M,
        "key_group_range": EVERYTHING,
        "key_serializer": IntSerializer(),
    }
    if kind == "heap":
        return HeapKeyedStateBackend(**options)
    return RocksDBKeyedStateBackend(tmp_path / name, **options)


@pytest.fixture
def created() -> Iterator[list[KeyedStateBackend]]:
    backends: list[KeyedStateBackend] = []
    yield backends
    for backend in backends:
        backend.dispose()


def with_timers(backend: KeyedStateBackend) -> KeyedStateBackend:
    backend.set_current_key(KEY)
    backend.timer_service.register_event_time_timer(TIMERS["event"])
    backend.timer_service.register_processing_time_timer(TIMERS["processing"])
    return backend


def fired(backend: KeyedStateBackend) -> dict[str, list[tuple[Any, int]]]:
    got: dict[str, list[tuple[Any, int]]] = {"event": [], "processing": []}
    service = backend.timer_service
    service.advance_watermark(2**62, lambda key, t: got["event"].append((key, t)))
    service.advance_processing_time(2**62, lambda key, t: got["processing"].append((key, t)))
    return got


EXPECTED = {domain: [(KEY, timestamp)] for domain, timestamp in TIMERS.items()}


def damage(store: str, entry: Entry, timestamp: bytes) -> Entry:
    """``entry`` of ``store`` with its timestamp replaced by ``timestamp``."""
    key, user_key, value = entry
    if store.endswith("by_time"):
        assert key == ts8(TIMERS[store.split(".")[1]])  # the documented layout
        return timestamp, user_key, value
    assert user_key == ts8(TIMERS[store.split(".")[1]])
    return key, timestamp, value


def composite(key_group: int, entry: Entry) -> bytes:
    """A composite key as documented: [key group: 2][key length: 4][key][user key]."""
    key, user_key, _ = entry
    return struct.pack(">HI", key_group, len(key)) + key + user_key


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
@pytest.mark.parametrize("sorted_runs", [False, True], ids=["entries", "sorted-runs"])
def test_undamaged_timer_entries_restore_and_fire(
    tmp_path: Path, created: list[KeyedStateBackend], kind: str, sorted_runs: bool
) -> None:
    source = with_timers(make(kind, tmp_path, "source"))
    created.append(source)
    cut = source.sync_cut()
    entries = [(n, g, e) for g in EVERYTHING for n, e in cut.entries(g)]
    cut.release()
    assert {name for name, _, _ in entries} == set(STORES)
    target = make(kind, tmp_path)
    created.append(target)
    if sorted_runs:
        runs = [(n, g, [(composite(g, e), e[2])]) for n, g, e in entries]
        target.restore_sorted(cut.key_serializer, cut.states, runs, cut.timers)
    else:
        target.restore(cut.key_serializer, cut.states, entries, cut.timers)
    assert fired(target) == EXPECTED


@pytest.mark.parametrize("timestamp", BAD_TIMESTAMPS, ids=["0", "3", "9"])
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
@pytest.mark.parametrize("sorted_runs", [False, True], ids=["entries", "sorted-runs"])
def test_a_timer_entry_whose_timestamp_is_not_8_bytes_is_refused_by_the_restore(
    tmp_path: Path,
    created: list[KeyedStateBackend],
    kind: str,
    sorted_runs: bool,
    store: str,
    timestamp: bytes,
) -> None:
    source = with_timers(make(kind, tmp_path, "source"))
    created.append(source)
    cut = source.sync_cut()
    entries = [
        (n, g, damage(store, e, timestamp) if n == store else e)
        for g in EVERYTHING
        for n, e in cut.entries(g)
    ]
    cut.release()
    target = make(kind, tmp_path)
    created.append(target)
    with pytest.raises(CheckpointCorruptedError) as raised:
        if sorted_runs:
            runs = [(n, g, [(composite(g, e), e[2])]) for n, g, e in entries]
            target.restore_sorted(cut.key_serializer, cut.states, runs, cut.timers)
        else:
            target.restore(cut.key_serializer, cut.states, entries, cut.timers)
        fired(target)  # not reached once refused: what it gave before
    message = str(raised.value)
    assert "\n" not in message
    assert repr(store) in message and f"key group {KEY_GROUP}" in message
    assert "restore from an earlier checkpoint" in message


def _damage_column(backend: RocksDBKeyedStateBackend, store: str, timestamp: bytes) -> None:
    """Put a malformed entry into the RocksDB column of ``store`` beside the real one,
    as a crafted file would hold it."""
    column: Any = backend._columns[store]

    def entry(timestamp: bytes) -> Entry:
        if store.endswith("by_time"):
            return timestamp, KEY_BYTES, b""
        return KEY_BYTES, timestamp, b""

    assert column.get(composite(KEY_GROUP, entry(ts8(TIMERS[store.split(".")[1]])))) == b""
    column[composite(KEY_GROUP, entry(timestamp))] = b""


def _checkpoint(
    tmp_path: Path,
    incremental: bool,
    store: str | None,
    craft: Callable[[RocksDBKeyedStateBackend], None] | None = None,
) -> tuple[Any, str, Any]:
    """A completed checkpoint of one RocksDB subtask with the timers, ``store`` holding a
    malformed timer entry (None: none), written after ``craft`` (if given) damaged the
    subtask's backend."""
    storage = CheckpointStorage(
        (tmp_path / "ck").as_uri(), "job", incremental=incremental, compression="none"
    )
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    source = with_timers(make("rocksdb", tmp_path, "source"))
    try:
        assert isinstance(source, RocksDBKeyedStateBackend)
        source.timer_service.advance_watermark(1, lambda key, t: None)  # settles
        if store is not None:
            _damage_column(source, store, b"abc")
        if craft is not None:
            craft(source)
        n = coordinator.trigger({"op": 1})
        handle = source.snapshot(n, storage.snapshot_target(n, "op", 0)).result()
        assert coordinator.acknowledge(n, SubtaskAck("op", 0, 1, handle, None, coordinator.run_id))
    finally:
        source.dispose()
    return storage, storage.resolve(n), storage.load(n)


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_checkpoint_with_timers_restores_them(
    tmp_path: Path, created: list[KeyedStateBackend], kind: str, incremental: bool
) -> None:
    storage, directory, metadata = _checkpoint(tmp_path, incremental, None)
    target = make(kind, tmp_path)
    created.append(target)
    restore_keyed_state(target, storage.fs, directory, metadata, "op")
    assert fired(target) == EXPECTED
    storage.close()


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_checkpoint_file_with_a_malformed_timer_entry_is_refused_naming_it(
    tmp_path: Path, created: list[KeyedStateBackend], kind: str, incremental: bool, store: str
) -> None:
    """Full: the entry is in a frame whose checksum matches. Incremental: in the SST files
    (a fresh RocksDB backend adopts them as its database, a heap backend reads them)."""
    storage, directory, metadata = _checkpoint(tmp_path, incremental, store)
    (handle,) = metadata.operators["op"].keyed_handles()
    message = _refused_restore(storage, directory, metadata, make(kind, tmp_path), created)
    assert repr(store) in message and f"key group {KEY_GROUP}" in message
    assert "restore from an earlier checkpoint" in message
    if incremental:
        assert directory in message
    else:
        assert f"{directory}/{handle.path}" in message
    storage.close()


def _damaged_changes(changes: ChangeSet, store: str) -> ChangeSet:
    """``changes`` with the timer change of ``store`` given a 3-byte timestamp."""
    real = ts8(TIMERS[store.split(".")[1]])
    damaged = dict(changes.changes)
    if store.endswith("by_time"):
        maps = {CurrentKey.of(KEY_GROUP, b"abc").prefix: MapKeyChanges(False, {KEY_BYTES: b""})}
        assert set(changes.changes[store].maps) == {CurrentKey.of(KEY_GROUP, real).prefix}
    else:
        maps = {CurrentKey.of(KEY_GROUP, KEY_BYTES).prefix: MapKeyChanges(False, {b"abc": b""})}
        assert changes.changes[store].maps[CurrentKey.of(KEY_GROUP, KEY_BYTES).prefix].entries == {
            real: b""
        }
    damaged[store] = StateChanges({}, maps)
    return ChangeSet(
        changes.key_serializer,
        changes.max_parallelism,
        changes.key_group_range,
        changes.states,
        damaged,
        changes.timers,
    )


@pytest.mark.parametrize("store", [None, *STORES])
@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_a_changelog_record_with_a_malformed_timer_change_is_refused_naming_it(
    tmp_path: Path, created: list[KeyedStateBackend], kind: str, store: str | None
) -> None:
    changelog, source = _logging_source(kind, tmp_path, created)
    changes = source.drain_changelog()
    if store is not None:
        changes = _damaged_changes(changes, store)
    if store is None:
        target = _replayed(changelog, changes, make(kind, tmp_path), created)
        assert fired(target) == EXPECTED
        return
    message = _refused_replay(changelog, changes, make(kind, tmp_path), created)
    assert repr(store) in message and f"key group {KEY_GROUP}" in message
    assert "restore from an earlier checkpoint" in message


FOREIGN_STATES = [
    ("_timers.bogus.by_time", StateKind.MAP),  # a time domain the timer service lacks
    ("_timers.event.by_date", StateKind.MAP),  # a store it does not keep
    ("_timers.event.by_time", StateKind.VALUE),  # its store, but not a map
]
FOREIGN_IDS = ["domain", "suffix", "kind"]


def _add_foreign_state(backend: KeyedStateBackend, name: str, kind: StateKind) -> None:
    """Make the backend snapshot state ``name`` of ``kind`` among its timer states, as a
    buggy writer would: with a timer entry as documented, in the timer key's key group."""
    if name not in STORES:
        backend._store_for(name, is_map=True).map_put(
            CurrentKey.of(KEY_GROUP, ts8(3)), KEY_BYTES, b""
        )
    backend._timer_metas[name] = StateMetaInfo(name, kind, {"timer": {"identity": name}})


@pytest.mark.parametrize(("name", "kind_of_state"), FOREIGN_STATES, ids=FOREIGN_IDS)
@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_a_checkpoint_with_a_timer_state_the_timer_service_does_not_keep_is_refused(
    tmp_path: Path,
    created: list[KeyedStateBackend],
    kind: str,
    incremental: bool,
    name: str,
    kind_of_state: StateKind,
) -> None:
    """Names starting with ``_timers.`` are the timer service's (no user state may take
    one): a snapshot holding another such state, or one of its stores as another kind
    than a map, was not written by it."""

    def craft(backend: RocksDBKeyedStateBackend) -> None:
        _add_foreign_state(backend, name, kind_of_state)

    storage, directory, metadata = _checkpoint(tmp_path, incremental, None, craft)
    (handle,) = metadata.operators["op"].keyed_handles()
    assert (name, kind_of_state) in {(meta.name, meta.kind) for meta in handle.states}
    message = _refused_restore(storage, directory, metadata, make(kind, tmp_path), created)
    assert repr(name) in message and "restore from an earlier checkpoint" in message
    if incremental:
        assert directory in message
    else:
        assert f"{directory}/{handle.path}" in message
    storage.close()


@pytest.mark.parametrize(("name", "kind_of_state"), FOREIGN_STATES[:2], ids=FOREIGN_IDS[:2])
@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_a_changelog_record_with_a_timer_state_the_timer_service_does_not_keep_is_refused(
    tmp_path: Path,
    created: list[KeyedStateBackend],
    kind: str,
    name: str,
    kind_of_state: StateKind,
) -> None:
    """(A record's map change of a store recorded as a value state is refused by its
    decoder already.)"""
    changelog, source = _logging_source(kind, tmp_path, created)
    _add_foreign_state(source, name, kind_of_state)
    changes = source.drain_changelog()
    assert (name, kind_of_state) in {(meta.name, meta.kind) for meta in changes.states}
    message = _refused_replay(changelog, changes, make(kind, tmp_path), created)
    assert repr(name) in message and "restore from an earlier checkpoint" in message


OTHER_GROUP = (KEY_GROUP + 1) % M


def _move_timer(backend: RocksDBKeyedStateBackend, key: int = KEY) -> int:
    """Move the ``by_time`` entry of ``key``'s event-time timer from the key's key group
    to the next one, as a buggy writer would (its ``by_key`` entry stays); returns that
    key group."""
    column: Any = backend._columns["_timers.event.by_time"]
    key_bytes = struct.pack(">q", key)
    group = assign_to_key_group(key_bytes, M)
    entry = (ts8(TIMERS["event"]), key_bytes, b"")
    assert column.get(composite(group, entry)) == b""
    del column[composite(group, entry)]
    column[composite(group + 1, entry)] = b""
    return group + 1


@pytest.mark.parametrize(
    ("incremental", "kind"),
    [(False, "heap"), (False, "rocksdb"), (True, "heap")],
    ids=["full-heap", "full-rocksdb", "incremental-heap"],
)
def test_a_checkpoint_with_a_timer_in_another_key_group_than_its_key_is_refused(
    tmp_path: Path, created: list[KeyedStateBackend], kind: str, incremental: bool
) -> None:
    """A ``by_time`` entry lives in its timer key's key group (the module docstring);
    one in another would fire with its key in that key group, whose state is not the
    key's (and would move to another subtask on a rescale). Checked where a restore reads
    the entries anyway, not where a RocksDB backend adopts an incremental handle's files
    as they are (see the next test)."""
    storage, directory, metadata = _checkpoint(tmp_path, incremental, None, _move_timer)
    (handle,) = metadata.operators["op"].keyed_handles()
    message = _refused_restore(storage, directory, metadata, make(kind, tmp_path), created)
    assert "'_timers.event.by_time'" in message and f"in key group {OTHER_GROUP}" in message
    assert f"a key of key group {KEY_GROUP}" in message
    assert "restore from an earlier checkpoint" in message
    if incremental:
        assert directory in message
    else:
        assert f"{directory}/{handle.path}" in message
    storage.close()


def test_a_rescale_that_copies_an_incremental_handle_refuses_a_timer_in_another_key_group(
    tmp_path: Path, created: list[KeyedStateBackend]
) -> None:
    """Two subtasks' incremental handles restored into one RocksDB backend: it adopts
    one handle's files and copies the other's entries, which are checked. Each handle
    holds a timer moved to the next key group, so whichever is copied is refused."""
    storage = CheckpointStorage(
        (tmp_path / "ck").as_uri(), "job", incremental=True, compression="none"
    )
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    n = coordinator.trigger({"op": 2})
    moved = []
    for subtask, key_groups in enumerate([KeyGroupRange(0, 3), KeyGroupRange(4, 7)]):
        key = next(  # a key whose key group and the next are the subtask's
            k
            for k in range(1000)
            if assign_to_key_group(struct.pack(">q", k), M)
            in range(key_groups.start, key_groups.end)
        )
        source = RocksDBKeyedStateBackend(
            tmp_path / f"source-{subtask}",
            max_parallelism=M,
            key_group_range=key_groups,
            key_serializer=IntSerializer(),
        )
        created.append(source)
        source.set_current_key(key)
        source.timer_service.register_event_time_timer(TIMERS["event"])
        source.timer_service.advance_watermark(1, lambda key, t: None)  # settles
        moved.append(_move_timer(source, key))
        handle = source.snapshot(n, storage.snapshot_target(n, "op", subtask)).result()
        coordinator.acknowledge(n, SubtaskAck("op", subtask, 2, handle, None, coordinator.run_id))
    directory, metadata = storage.resolve(n), storage.load(n)
    target = make("rocksdb", tmp_path)
    created.append(target)
    with pytest.raises(CheckpointCorruptedError) as raised:
        restore_keyed_state(target, storage.fs, directory, metadata, "op")
        fired(target)
    message = str(raised.value)
    assert "\n" not in message and directory in message
    assert "'_timers.event.by_time'" in message
    assert any(f"in key group {group}" in message for group in moved)
    storage.close()


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_a_changelog_record_with_a_timer_in_another_key_group_than_its_key_is_refused(
    tmp_path: Path, created: list[KeyedStateBackend], kind: str
) -> None:
    changelog, source = _logging_source(kind, tmp_path, created)
    changes = source.drain_changelog()
    store = "_timers.event.by_time"
    real = CurrentKey.of(KEY_GROUP, ts8(TIMERS["event"])).prefix
    assert set(changes.changes[store].maps) == {real}
    moved = CurrentKey.of(OTHER_GROUP, ts8(TIMERS["event"])).prefix
    damaged = dict(changes.changes)
    damaged[store] = StateChanges({}, {moved: changes.changes[store].maps[real]})
    changes = ChangeSet(
        changes.key_serializer,
        changes.max_parallelism,
        changes.key_group_range,
        changes.states,
        damaged,
        changes.timers,
    )
    message = _refused_replay(changelog, changes, make(kind, tmp_path), created)
    assert repr(store) in message and f"in key group {OTHER_GROUP}" in message
    assert f"a key of key group {KEY_GROUP}" in message
    assert "restore from an earlier checkpoint" in message


def _refused_restore(
    storage: CheckpointStorage,
    directory: str,
    metadata: CheckpointMetadata,
    target: KeyedStateBackend,
    created: list[KeyedStateBackend],
) -> str:
    """The one-line CheckpointCorruptedError of restoring checkpoint ``directory`` into
    ``target`` (or of firing its timers after)."""
    created.append(target)
    with pytest.raises(CheckpointCorruptedError) as raised:
        restore_keyed_state(target, storage.fs, directory, metadata, "op")
        fired(target)
    message = str(raised.value)
    assert "\n" not in message
    return message


def _logging_source(
    kind: str, tmp_path: Path, created: list[KeyedStateBackend]
) -> tuple[ChangelogStorage, KeyedStateBackend]:
    """A job's changelog storage, and a backend with timers recording its changes."""
    changelog = ChangelogStorage(CheckpointStorage((tmp_path / "ck").as_uri(), "job"))
    source = make(kind, tmp_path, "source")
    created.append(source)
    source.enable_changelog()
    with_timers(source)
    return changelog, source


def _replayed(
    changelog: ChangelogStorage,
    changes: ChangeSet,
    target: KeyedStateBackend,
    created: list[KeyedStateBackend],
) -> KeyedStateBackend:
    """``target`` rebuilt from one record of ``changes`` committed as manifest 0."""
    created.append(target)
    record = changelog.write_record(0, "op", 0, "a", changes)
    changelog.commit(0, {"op": [record]}, max_parallelism=M)
    rebuild_keyed_state(target, changelog, changelog.load_manifest(0), "op")
    return target


def _refused_replay(
    changelog: ChangelogStorage,
    changes: ChangeSet,
    target: KeyedStateBackend,
    created: list[KeyedStateBackend],
) -> str:
    """The one-line CheckpointCorruptedError, naming the record's file, of ``_replayed``
    (or of firing the timers after it)."""
    with pytest.raises(CheckpointCorruptedError) as raised:
        fired(_replayed(changelog, changes, target, created))
    message = str(raised.value)
    path = changelog.record_path(changelog.load_manifest(0).operators["op"][0].subtasks[0])
    assert path is not None and path in message and "\n" not in message
    return message
