"""``encode_changes`` against a plain-Python encoding of the record format it documents."""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest

from statebackend.backends.changelog import ChangeOp, ChangeSet, MapKeyChanges, StateChanges
from statebackend.backends.keyed import StateMetaInfo
from statebackend.backends.stores import CurrentKey
from statebackend.backends.timers import TimerClocks, TimerSnapshotInfo
from statebackend.errors import CheckpointCorruptedError
from statebackend.keygroups import KeyGroupRange
from statebackend.snapshot import changelog_format
from statebackend.snapshot.changelog_format import ChangelogHandle, encode_changes, read_changes
from statebackend.snapshot.frames import FRAME_HEADER, encode_frame
from statebackend.snapshot.keyed_format import FRAME_BYTES
from statebackend.state.descriptors import StateKind


def reference_record(change_set: ChangeSet, codec: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    """The record as the module docstring describes it, change by change: per key group
    (ascending) its changes in (state, composite key) order, a map key's prefix delete
    before its entries; frames cut after the change that brings a frame to FRAME_BYTES."""
    index = {meta.name: i for i, meta in enumerate(change_set.states)}
    groups: dict[int, list[bytes]] = {}

    def change(op: int, state: int, prefix: bytes, user_key: bytes, value: bytes) -> None:
        key_group, length = struct.unpack(">HI", prefix[:6])
        key = prefix[6:]
        assert len(key) == length
        groups.setdefault(key_group, []).append(
            struct.pack(">BHI", op, state, length)
            + key
            + struct.pack(">I", len(user_key))
            + user_key
            + struct.pack(">I", len(value))
            + value
        )

    for name in sorted(change_set.changes, key=lambda name: index[name]):
        state, changes = index[name], change_set.changes[name]
        for prefix in sorted(changes.values):
            value = changes.values[prefix]
            change(1 if value is None else 0, state, prefix, b"", value or b"")
        for prefix in sorted(changes.maps):
            key_group = struct.unpack(">H", prefix[:2])[0]
            groups.setdefault(key_group, [])
            if changes.maps[prefix].cleared:
                change(1, state, prefix, b"", b"")
            for user_key, value in sorted(changes.maps[prefix].entries.items()):
                change(3 if value is None else 2, state, prefix, user_key, value or b"")
    frames: list[bytes] = []
    index_entries, offset = [], 0
    for key_group in sorted(groups):
        start, frame = offset, b""
        for encoded in groups[key_group]:
            frame += encoded
            if len(frame) >= FRAME_BYTES:
                frames.append(encode_frame(frame, codec))
                offset, frame = offset + len(frames[-1]), b""
        if frame:
            frames.append(encode_frame(frame, codec))
            offset += len(frames[-1])
        index_entries.append((key_group, start, offset - start))
    return b"".join(frames), index_entries


def random_change_set(rng: random.Random, fixed_width: bool) -> ChangeSet:
    """Random value and map changes over a few states and key groups; with
    ``fixed_width`` every value-kind state has keys and values of one size each and no
    deletes (the shape of numeric keys and flat-struct values)."""

    def some_bytes(size: int) -> bytes:
        return bytes(rng.randrange(256) for _ in range(size))

    states, changes = [], {}
    for number in range(rng.randrange(1, 4)):
        name = f"state-{number}"
        kind = rng.choice([StateKind.VALUE, StateKind.MAP])
        states.append(StateMetaInfo(name, kind, {}))
        key_size, value_size = rng.randrange(1, 4), rng.randrange(1, 20)
        large = rng.random() < 0.2  # a few values that fill several frames per key group
        values: dict[bytes, bytes | None] = {}
        maps: dict[bytes, MapKeyChanges] = {}
        for _ in range(rng.randrange(0, 12 if large else 200)):
            size = key_size if fixed_width else rng.randrange(0, 4)
            prefix = CurrentKey.of(rng.randrange(6), some_bytes(size)).prefix
            if kind is StateKind.VALUE:
                deleted = not fixed_width and rng.random() < 0.2
                size = value_size if fixed_width else rng.randrange(1, 20)
                repeat = FRAME_BYTES // 3 // size if large else 1
                values[prefix] = None if deleted else some_bytes(size) * repeat
            else:
                entries = maps.setdefault(prefix, MapKeyChanges(cleared=rng.random() < 0.3))
                for _ in range(rng.randrange(0, 3)):
                    user_key = some_bytes(rng.randrange(0, 3))
                    removed = rng.random() < 0.3
                    entries.entries[user_key] = None if removed else some_bytes(rng.randrange(5))
        if values or maps:
            changes[name] = StateChanges(values, maps)
    return ChangeSet(
        {}, 128, KeyGroupRange(0, 127), states, changes, TimerSnapshotInfo.empty(TimerClocks())
    )


@pytest.mark.parametrize("codec", [0, 1])
def test_records_equal_the_documented_format(codec: int, monkeypatch: Any) -> None:
    fixed_width_states = []
    build = changelog_format._fixed_width_changes

    def counted(*args: Any) -> bytes:
        fixed_width_states.append(args)
        return build(*args)

    monkeypatch.setattr(changelog_format, "_fixed_width_changes", counted)
    rng = random.Random(codec)
    for trial in range(120):
        change_set = random_change_set(rng, fixed_width=trial % 2 == 0)
        assert encode_changes(change_set, codec) == reference_record(change_set, codec), trial
    assert len(fixed_width_states) > 50  # both ways of building value changes were compared


# The ops the record format documents (``ChangeOp``'s codes) and the state kinds whose
# stores they apply to: a value-kind store takes puts and deletes, a map-kind store
# deletes of a key's whole map and puts and removals of its entries.
PUT, DELETE, MAP_PUT, MAP_REMOVE = 0, 1, 2, 3
FITTING = {False: {PUT, DELETE}, True: {DELETE, MAP_PUT, MAP_REMOVE}}


def _with_op(payload: bytes, change: int, op: int) -> bytes:
    """``payload`` (a frame's changes, as documented) with change number ``change``'s op
    set to ``op``."""
    position = 0
    for _ in range(change):
        _, _, key_length = struct.unpack_from(">BHI", payload, position)
        position += 7 + key_length
        for _ in range(2):
            (length,) = struct.unpack_from(">I", payload, position)
            position += 4 + length
    return payload[:position] + bytes([op]) + payload[position + 1 :]


@pytest.mark.parametrize("is_map", [False, True], ids=["value-state", "map-state"])
def test_a_change_whose_op_does_not_fit_its_state_kind_is_corruption(is_map: bool) -> None:
    """A MAP_PUT of a value state or a PUT of a map state (a damaged op byte in a frame
    whose crc32 matches) was replayed: a heap backend's map state then raised a raw
    AttributeError, its value state a misleading SerializationError."""
    states = [
        StateMetaInfo("count", StateKind.VALUE, {"value": {"identity": "int", "version": 1}}),
        StateMetaInfo(
            "tags",
            StateKind.MAP,
            {
                "user_key": {"identity": "str", "version": 1},
                "value": {"identity": "int", "version": 1},
            },
        ),
    ]
    prefix = CurrentKey.of(3, b"k").prefix
    changes = {
        "count": StateChanges({prefix: b"\x00" * 8}, {}),
        "tags": StateChanges({}, {prefix: MapKeyChanges(False, {b"t": b"\x01" * 8})}),
    }
    change_set = ChangeSet(
        {"identity": "str", "version": 1},
        8,
        KeyGroupRange(0, 7),
        states,
        changes,
        TimerSnapshotInfo.empty(TimerClocks()),
    )
    data, index = encode_changes(change_set, 0)
    ((_, offset, length),) = index
    payload = data[offset + FRAME_HEADER.size : offset + length]
    handle = ChangelogHandle(
        path="r",
        size=len(data),
        checksum="crc32:00000000",
        key_group_range=KeyGroupRange(0, 7),
        key_groups=tuple(index),
        compression="none",
        batch_id=1,
        operator_id="op",
        subtask=0,
        attempt="a",
        changes=2,
        states=tuple(states),
        key_serializer={"identity": "str", "version": 1},
    )

    def read(payload: bytes) -> list[Any]:
        frame = encode_frame(payload, 0)
        assert len(frame) == length  # the same layout, its checksum made to match
        record = data[:offset] + frame

        def read_range(path: str, start: int, size: int) -> bytes:
            return record[start : start + size]

        return list(
            read_changes(
                read_range, "file:///c/job/changelog/1/op-0-a", handle, KeyGroupRange(0, 7)
            )
        )

    # The record as written: change 0 is the value state's, change 1 the map state's.
    assert [(name, change.op) for name, _, change in read(payload)] == [
        ("count", ChangeOp.PUT),
        ("tags", ChangeOp.MAP_PUT),
    ]
    change = 1 if is_map else 0
    for op in (PUT, DELETE, MAP_PUT, MAP_REMOVE):
        damaged = _with_op(payload, change, op)
        if op in FITTING[is_map]:
            assert read(damaged)[change][2].op == op
            continue
        with pytest.raises(CheckpointCorruptedError) as raised:
            read(damaged)
        message = str(raised.value)
        assert "file:///c/job/changelog/1/op-0-a" in message and "\n" not in message
        assert ("'tags'" if is_map else "'count'") in message
        assert "restore from an earlier checkpoint" in message
