"""Change capture and the changelog record format, on both keyed backends.

The model test: a live backend with its changelog on runs random batches; after each
batch its changes are drained, encoded, decoded and replayed into a replica that started
from a cut of the live backend (the "base"). The replica must equal the live backend entry
by entry (bytes and states' meta info), and a plain-Python model read through the state
interfaces. Records are read back through the format's ranged reads over their bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.changelog import Change, ChangeOp, ChangeSet
from statebackend.backends.keyed import KeyedStateBackend, StateMetaInfo
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.errors import CheckpointCorruptedError, StateAccessError
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import (
    BytesSerializer,
    FloatSerializer,
    IntSerializer,
    RowTupleSerializer,
    StrSerializer,
)
from statebackend.snapshot.changelog_format import ChangelogHandle, encode_changes, read_changes
from statebackend.snapshot.frames import check_codec, decode_frames
from statebackend.state.descriptors import MapStateDescriptor, StateKind, ValueStateDescriptor
from statebackend.state.interfaces import MapState, ValueState
from statebackend.state.timers import MIN_TIMESTAMP
from statebackend.state.ttl import StateTtlConfig, TtlUpdateType
from tests.unit.test_keyed_backends import (
    BATCHED,
    FULL_RANGE,
    KEYS,
    KINDS,
    Backends,
    FakeClock,
    M,
    Model,
    assert_matches_model,
    collect,
    key_group,
    random_ops,
    read_state,
    rebatch,
    register,
    run_ops,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def backends(tmp_path: Path, clock: FakeClock) -> Iterator[Backends]:
    made = Backends(tmp_path, clock)
    yield made
    made.dispose_all()


def to_handle(change_set: ChangeSet, codec: str = "none") -> tuple[bytes, ChangelogHandle]:
    """A record's bytes and handle, as ``ChangelogStorage.write_record`` makes them."""
    data, index = encode_changes(change_set, check_codec(codec))
    handle = ChangelogHandle(
        batch_id=1,
        operator_id="op",
        subtask=0,
        attempt="a",
        path="record" if data else None,
        size=len(data),
        checksum="",
        changes=len(change_set),
        key_group_range=change_set.key_group_range,
        key_groups=tuple(index),
        states=tuple(change_set.states),
        key_serializer=change_set.key_serializer,
        compression=codec,
        timers=change_set.timers,
    )
    return data, handle


def replay_record(
    replica: KeyedStateBackend, change_set: ChangeSet, codec: str = "none"
) -> list[tuple[int, int]]:
    """Encode the changes, read back the replica's key groups by ranged reads over the
    bytes, replay them; return the ranges that were read."""
    data, handle = to_handle(change_set, codec)
    handle = ChangelogHandle.from_json(json.loads(json.dumps(handle.to_json())))
    reads: list[tuple[int, int]] = []

    def read_range(path: str, start: int, length: int) -> bytes:
        reads.append((start, length))
        return data[start : start + length]

    key_groups = handle.key_group_range.intersection(replica.key_group_range)
    changes = list(read_changes(read_range, "record", handle, key_groups))
    replica.replay(handle.key_serializer, handle.states, changes, handle.timers)
    return reads


def decoded(change_set: ChangeSet) -> list[tuple[str, int, Change]]:
    """The changes of a record of ``change_set``, as a rebuild reads them."""
    data, handle = to_handle(change_set)
    return list(read_changes(lambda p, s, n: data[s : s + n], "record", handle, FULL_RANGE))


def restore_from_cut(source: KeyedStateBackend, replica: KeyedStateBackend) -> None:
    """Load a cut of ``source`` into ``replica`` (the base of a rebuild)."""
    cut = source.sync_cut()
    try:
        replica.restore(cut.key_serializer, cut.states, collect(cut))
    finally:
        cut.release()


def entries_of(backend: KeyedStateBackend) -> tuple[list[Any], list[Any]]:
    """The backend's states' meta info and every entry, as a cut shows them."""
    cut = backend.sync_cut()
    try:
        return list(cut.states), collect(cut)
    finally:
        cut.release()


@pytest.fixture(params=[*KINDS, BATCHED])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


HALVES = (KeyGroupRange(0, M // 2 - 1), KeyGroupRange(M // 2, M - 1))


# -- the model test -------------------------------------------------------------------------


@pytest.mark.parametrize("replica_kind", KINDS)
def test_base_plus_replay_equals_live_and_model(
    backends: Backends, kind: str, replica_kind: str
) -> None:
    live = backends.make(kind)
    live.enable_changelog()
    states = register(live)
    model = Model()
    run_ops(live, states, model, random_ops(31, 500))
    live.drain_changelog()  # batch 0: the base below already holds it
    whole = backends.make(replica_kind)
    halves = [backends.make(replica_kind, key_group_range=r) for r in HALVES]
    for replica in (whole, *halves):
        restore_from_cut(live, replica)
    for batch in range(1, 6):
        run_ops(live, states, model, random_ops(batch * 7, 400))
        change_set = live.drain_changelog()
        codec = ("none", "lz4", "zstd")[batch % 3]
        replay_record(whole, change_set, codec)
        for half in halves:
            reads = replay_record(half, change_set, codec)
            assert len(reads) <= 1  # a key-group range is one ranged read
        expected = entries_of(live)
        assert entries_of(whole) == expected
        low, high = (entries_of(half) for half in halves)
        assert low[1] + high[1] == expected[1]
    # Read through the state interfaces, the replica is the plain-Python model.
    assert_matches_model(whole, register(whole), model)
    for half in halves:
        keys = [k for k in KEYS if key_group(k) in half.key_group_range]
        assert_matches_model(half, register(half), model, keys)


@pytest.mark.parametrize("update_type", list(TtlUpdateType))
def test_replay_with_ttl_equals_live(
    backends: Backends, kind: str, clock: FakeClock, update_type: TtlUpdateType
) -> None:
    # Reads of expired values delete them and reads may refresh expiry: all of it goes
    # through the stores, so the replica must follow the live backend byte for byte.
    ttl = StateTtlConfig(10, update_type)
    live = backends.make(kind)
    live.enable_changelog()
    states = register(live, ttl)
    replica = backends.make("rocksdb" if kind == "heap" else "heap")
    rng = random.Random(3)
    now = 0.0
    for _ in range(6):
        rebatch(live, KEYS[:6])
        for op in random_ops(rng.randrange(1000), 300, KEYS[:12]):
            now += rng.choice([0, 0.25, 0.5, 1])
            clock.at(now)
            live.set_current_key(op[1])
            state = states[op[0]]
            if op[2] == "clear":
                state.clear()
            elif op[2] == "read" or op[0] in ("list", "map") and op[2] in ("get", "remove"):
                read_state(state)
            elif op[0] == "value":
                state.update(op[3])
            elif op[0] == "list":
                state.add_all(op[3])
            elif op[0] == "map":
                state.put_all(op[3])
            else:
                state.add(op[3])
        replay_record(replica, live.drain_changelog())
        assert entries_of(replica) == entries_of(live)
    # Reading both at the same time gives the same values and leaves the same bytes.
    clock.at(now + 5)
    replica_states = register(replica, ttl)
    for key in KEYS[:12]:
        live.set_current_key(key)
        replica.set_current_key(key)
        for name in states:
            assert read_state(replica_states[name]) == read_state(states[name]), (name, key)
    replica_entries, live_entries = entries_of(replica), entries_of(live)
    assert replica_entries == live_entries


def test_map_clear_is_a_prefix_delete_before_later_entries(backends: Backends, kind: str) -> None:
    descriptor = MapStateDescriptor("m", StrSerializer(), IntSerializer())
    live = backends.make(kind)
    live.enable_changelog()
    entries = live.get_state(descriptor)
    assert isinstance(entries, MapState)
    live.set_current_key("k")
    entries.put_all({"a": 1, "b": 2})
    live.drain_changelog()
    replica = backends.make(kind)
    restore_from_cut(live, replica)
    entries.put("c", 3)
    entries.clear()  # removes a, b (from the base) and c (from this batch)
    entries.put("d", 4)
    entries.remove("e")
    entries.put("a", 5)
    change_set = live.drain_changelog()
    ops = [(c.op, c.user_key) for _, _, c in decoded(change_set)]
    assert ops == [(ChangeOp.DELETE, b""), (ChangeOp.MAP_PUT, b"a"), (ChangeOp.MAP_PUT, b"d")]
    replay_record(replica, change_set)
    assert entries_of(replica) == entries_of(live)
    replica_entries = replica.get_state(descriptor)
    assert isinstance(replica_entries, MapState)
    replica.set_current_key("k")
    assert dict(replica_entries.items()) == {"a": 5, "d": 4}


def test_repeated_writes_coalesce_and_drain_starts_a_new_batch(
    backends: Backends, kind: str
) -> None:
    live = backends.make(kind)
    live.enable_changelog()
    value = live.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(value, ValueState)
    for key in ("a", "b"):
        live.set_current_key(key)
        for n in range(1000):
            value.update(n)
    live.set_current_key("b")
    value.clear()
    change_set = live.drain_changelog()
    assert len(change_set) == 2
    ops = sorted(c.op for _, _, c in decoded(change_set))
    assert ops == [ChangeOp.PUT, ChangeOp.DELETE]
    assert len(live.drain_changelog()) == 0


def test_serializer_migration_is_replayed_from_the_records_meta(
    backends: Backends, kind: str
) -> None:
    # Batch 1 writes ints; the job is upgraded and batch 2 registers the states with a
    # float serializer (the live backend migrates every value) and writes floats.
    first = backends.make(kind)
    first.enable_changelog()
    old = {
        "v": first.get_state(ValueStateDescriptor("v", IntSerializer())),
        "m": first.get_state(MapStateDescriptor("m", StrSerializer(), IntSerializer())),
    }
    for i, key in enumerate(KEYS):
        first.set_current_key(key)
        old["v"].update(i)
        old["m"].put_all({"x": i, "y": -i})
    first.drain_changelog()
    replica = backends.make("heap" if kind == "rocksdb" else "rocksdb")
    restore_from_cut(first, replica)
    for key in KEYS[:10]:
        first.set_current_key(key)
        old["v"].update(1000)
    replay_record(replica, first.drain_changelog())

    second = backends.make(kind)  # the next batch's backend, on batch 1's state
    restore_from_cut(first, second)
    second.enable_changelog()
    new = {
        "v": second.get_state(ValueStateDescriptor("v", FloatSerializer())),
        "m": second.get_state(MapStateDescriptor("m", StrSerializer(), FloatSerializer())),
    }
    for key in KEYS[5:15]:
        second.set_current_key(key)
        new["v"].update(0.5)
        new["m"].put("z", 2.5)
    replay_record(replica, second.drain_changelog())
    assert entries_of(replica) == entries_of(second)
    replica_value = replica.get_state(ValueStateDescriptor("v", FloatSerializer()))
    assert isinstance(replica_value, ValueState)
    replica.set_current_key(KEYS[0])
    assert replica_value.value() == 1000.0
    replica.set_current_key(KEYS[20])
    assert replica_value.value() == 20.0


def _rows(*fields: tuple[str, str]) -> RowTupleSerializer:
    """A RowTupleSerializer of nullable ``(name, Spark JSON type)`` fields."""
    schema = [{"name": n, "type": t, "nullable": True, "metadata": {}} for n, t in fields]
    return RowTupleSerializer(json.dumps({"type": "struct", "fields": schema}))


def test_a_field_added_in_a_later_record_survives_the_replay(backends: Backends, kind: str) -> None:
    """Batch 1 stores (n); batch 2 declares (n, note) and writes notes. The replica
    restored from batch 1's cut and both records keeps the notes: the values restored so
    far take the field, rather than the notes being dropped to fit the older values."""
    first = backends.make(kind)
    first.enable_changelog()
    value = first.get_state(ValueStateDescriptor("v", _rows(("n", "long"))))
    expected: dict[str, tuple[Any, ...]] = {}
    for i, key in enumerate(KEYS):
        first.set_current_key(key)
        value.update((i,))
        expected[key] = (i, None)
    first.drain_changelog()
    replica = backends.make("heap" if kind == "rocksdb" else "rocksdb")
    restore_from_cut(first, replica)
    second = backends.make(kind)
    restore_from_cut(first, second)
    second.enable_changelog()
    evolved = _rows(("n", "long"), ("note", "string"))
    noted = second.get_state(ValueStateDescriptor("v", evolved))
    for key in KEYS[5:15]:
        second.set_current_key(key)
        noted.update((-1, key))
        expected[key] = (-1, key)
    replay_record(replica, second.drain_changelog())
    replica_value = replica.get_state(ValueStateDescriptor("v", evolved))
    assert isinstance(replica_value, ValueState)
    for key in KEYS:
        replica.set_current_key(key)
        assert replica_value.value() == expected[key]


def test_a_field_renamed_in_a_later_record_is_the_one_a_restart_evolves_from(
    backends: Backends, kind: str
) -> None:
    """The base stores (count); a restart renames it (total), its record holds that
    schema; a restart from base + record adding a field (total, note) keeps every
    value under total, as a restart from a checkpoint of the renamed state does."""
    first = backends.make(kind)
    value = first.get_state(ValueStateDescriptor("v", _rows(("count", "long"))))
    expected: dict[str, tuple[Any, ...]] = {}
    for i, key in enumerate(KEYS):
        first.set_current_key(key)
        value.update((i,))
        expected[key] = (i, None)
    second = backends.make(kind)
    restore_from_cut(first, second)
    second.enable_changelog()
    renamed = second.get_state(ValueStateDescriptor("v", _rows(("total", "long"))))
    for key in KEYS[:5]:
        second.set_current_key(key)
        renamed.update((-1,))
        expected[key] = (-1, None)
    record = second.drain_changelog()
    evolved = ValueStateDescriptor("v", _rows(("total", "long"), ("note", "string")))
    for replica_kind in KINDS:
        replica = backends.make(replica_kind)
        restore_from_cut(first, replica)
        replay_record(replica, record)
        replica_value = replica.get_state(evolved)
        assert isinstance(replica_value, ValueState)
        for key in KEYS:
            replica.set_current_key(key)
            assert replica_value.value() == expected[key]


def test_record_size_is_proportional_to_the_changes(backends: Backends) -> None:
    live = backends.make("heap")
    encoded = [IntSerializer().serialize(n) for n in range(1_000_000)]
    live.restore(
        StrSerializer().config(),
        [StateMetaInfo("v", StateKind.VALUE, {"value": IntSerializer().config()})],
        (("v", n % M, (f"key-{n}".encode(), b"", value)) for n, value in enumerate(encoded)),
    )
    live.enable_changelog()
    value = live.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(value, ValueState)
    for key in KEYS[:10]:
        live.set_current_key(key)
        value.update(7)
    change_set = live.drain_changelog()
    data, handle = to_handle(change_set)
    assert len(change_set) == 10
    # Ten key groups, one frame each: a 13-byte frame header, then the change: op, state
    # index and key length (7 bytes), a 5-byte key, user-key and value lengths (8), an
    # 8-byte value. Nothing grows with the million keys of the state.
    assert len(data) == 10 * (13 + 7 + 5 + 8 + 8)
    assert len(json.dumps(handle.to_json())) < 1000


def test_enable_before_get_state_and_drain_only_when_enabled(backends: Backends, kind: str) -> None:
    backend = backends.make(kind)
    with pytest.raises(StateAccessError, match="enable_changelog"):
        backend.drain_changelog()
    backend.get_state(ValueStateDescriptor("v", IntSerializer()))
    with pytest.raises(StateAccessError, match="before the first get_state"):
        backend.enable_changelog()


def test_damaged_record_is_reported_with_its_path(backends: Backends) -> None:
    live = backends.make("heap")
    live.enable_changelog()
    value = live.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(value, ValueState)
    for key in KEYS:
        live.set_current_key(key)
        value.update(1)
    data, handle = to_handle(live.drain_changelog())
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF
    with pytest.raises(CheckpointCorruptedError, match="record"):
        list(read_changes(lambda p, s, n: bytes(damaged[s : s + n]), "record", handle, FULL_RANGE))


def test_a_reopened_rocksdb_records_its_changes(backends: Backends, tmp_path: Path) -> None:
    # The runtime reuses a subtask's local RocksDB across batches (close, reopen): the
    # reopened stores are recorded like new ones.
    descriptor = MapStateDescriptor("m", StrSerializer(), IntSerializer())
    first = RocksDBKeyedStateBackend(
        tmp_path / "local", max_parallelism=M, key_group_range=FULL_RANGE
    )
    entries = first.get_state(descriptor)
    assert isinstance(entries, MapState)
    for i, key in enumerate(KEYS):
        first.set_current_key(key)
        entries.put_all({"a": i, "b": -i})
    replica = backends.make("heap")
    restore_from_cut(first, replica)
    first.close()
    reopened = RocksDBKeyedStateBackend(
        tmp_path / "local", open_existing=True, max_parallelism=M, key_group_range=FULL_RANGE
    )
    try:
        reopened.enable_changelog()
        entries = reopened.get_state(descriptor)
        assert isinstance(entries, MapState)
        for key in KEYS[:5]:
            reopened.set_current_key(key)
            entries.remove("a")
            entries.put("c", 1)
        change_set = reopened.drain_changelog()
        assert len(change_set) == 10
        replay_record(replica, change_set)
        assert entries_of(replica) == entries_of(reopened)
    finally:
        reopened.dispose()


def test_a_large_key_group_spans_several_frames(backends: Backends) -> None:
    live = backends.make("heap")
    live.enable_changelog()
    value = live.get_state(ValueStateDescriptor("v", BytesSerializer()))
    assert isinstance(value, ValueState)
    group = key_group("k0")
    keys = [k for k in (f"k{n}" for n in range(5000)) if key_group(k) == group][:4]
    payloads = {key: bytes([n]) * 400_000 for n, key in enumerate(keys)}
    for key, payload in payloads.items():
        live.set_current_key(key)
        value.update(payload)
    data, handle = to_handle(live.drain_changelog())
    ((only, start, length),) = handle.key_groups
    assert (only, start, length) == (group, 0, len(data))
    assert len(list(decode_frames(data, "record"))) == 2  # 1.6 MB: cut once past 1 MB
    found = {
        StrSerializer().deserialize(c.key): c.value
        for _, _, c in read_changes(lambda p, s, n: data[s : s + n], "record", handle, FULL_RANGE)
    }
    assert found == payloads


def test_timer_changes_are_captured_and_replayed(backends: Backends, kind: str) -> None:
    """Timers live in map-kind stores: the changelog captures registrations, deletions and
    firings with no timer-specific code, and a replica rebuilt from base + records holds
    the same entries and clocks and fires exactly the timers a plain-Python set of
    (timestamp, key) says."""
    rng = random.Random(5)
    live = backends.make(kind)
    live.enable_changelog()
    timers = live.timer_service
    model: set[tuple[int, str]] = set()
    live.set_current_key(KEYS[0])
    timers.register_event_time_timer(5)
    model.add((5, KEYS[0]))
    live.drain_changelog()  # batch 0: in the base
    base = entries_of(live)
    records: list[ChangeSet] = []
    for batch in range(1, 6):
        for _ in range(60):
            key, timestamp = rng.choice(KEYS[:20]), rng.randrange(batch * 100)
            live.set_current_key(key)
            if rng.random() < 0.7:
                timers.register_event_time_timer(timestamp)
                model.add((timestamp, key))
            else:
                timers.delete_event_time_timer(timestamp)
                model.discard((timestamp, key))
        watermark = batch * 40
        fired: list[tuple[int, str]] = []
        timers.advance_watermark(watermark, lambda k, t, fired=fired: fired.append((t, k)))
        due = {timer for timer in model if timer[0] <= watermark}
        assert sorted(fired, key=lambda t: t[0]) == fired and set(fired) == due
        model -= due
        records.append(live.drain_changelog())
        replica = backends.make(kind)  # rebuilt from the base and every record so far
        replica.restore(live.key_serializer.config(), base[0], base[1])
        for record in records:
            replay_record(replica, record)
        assert entries_of(replica) == entries_of(live)
        assert replica.timer_clocks() == live.timer_clocks() == (watermark, MIN_TIMESTAMP)
    rest: list[tuple[int, str]] = []
    replica.timer_service.advance_watermark(10**9, lambda k, t: rest.append((t, k)))
    assert set(rest) == model and len(rest) == len(model)


def test_counts_take_each_entry_once_by_its_last_change(backends: Backends, kind: str) -> None:
    """``ChangeSet.counts``: what Spark's progress reports of a batch, each entry counted
    once by its last change in the batch (the figures below are worked out by hand from
    the calls)."""
    live = backends.make(kind)
    live.enable_changelog()
    value = live.get_state(ValueStateDescriptor("v", IntSerializer()))
    entries = live.get_state(MapStateDescriptor("m", StrSerializer(), IntSerializer()))
    assert isinstance(value, ValueState) and isinstance(entries, MapState)
    timers = live.timer_service
    live.set_current_key(KEYS[0])
    value.update(1)
    value.update(2)  # KEYS[0]: written once
    entries.put("x", 1)
    entries.remove("y")
    entries.clear()  # KEYS[0]'s map: cleared (one removal), x and y forgotten
    entries.put("z", 1)
    entries.remove("z")  # absent since the clear: nothing
    entries.put("w", 1)  # written
    timers.register_event_time_timer(5)  # fired below: removed
    timers.register_event_time_timer(6)
    timers.delete_event_time_timer(6)  # removed
    live.set_current_key(KEYS[1])
    value.update(1)
    value.clear()  # removed
    entries.remove("q")  # removed
    timers.register_event_time_timer(7)  # registered
    live.set_current_key(KEYS[2])
    value.clear()  # removed, though it held nothing
    fired: list[tuple[Any, int]] = []
    timers.advance_watermark(5, lambda key, timestamp: fired.append((key, timestamp)))
    assert fired == [(KEYS[0], 5)]
    counts = live.drain_changelog().counts()
    assert counts == (1 + 1, 1 + 1 + 1 + 1)  # rows written, removed; timers not counted
    assert live.drain_changelog().counts() == (0, 0)
