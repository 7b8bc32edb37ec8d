"""The changelog record format: one subtask attempt's state changes of one batch.

Laid out like the full keyed format (``keyed_format.py``): a sequence of frames
(``frames.py``, each with its crc32), each key group's changes filling whole frames of
their own, and an index ``[key group, offset, length]`` in the handle. The key groups of
a contiguous range are therefore one contiguous byte range of the file: a rebuilding
subtask reads exactly its key groups with one ranged read and verifies every frame.

A change is ``[op: 1][state index: 2][key length: 4][key]`` followed by
``[user key length: 4][user key][value length: 4][value]``, with ``op`` a ``ChangeOp``
code and the state index pointing into the handle's state list. Within a key group the
changes are in (state, composite key) order, a map key's prefix delete before its
entries; their order across states and keys does not matter, since each entry is changed
at most once per record.

The handle also carries the meta info of every state the backend held at the end of the
batch (its serializers), so that a replay migrates values exactly when the live backend
did. A batch without changes writes no file (``path`` None) but still has a handle.

A record may also hold the subtask's operator state at the end of the batch (a user
function's ``CheckpointedFunction`` state): a full copy, one frame after the key groups'
frames, holding ``[header length: 4][header][blob]`` where the blob and header (a JSON
``OperatorStateHandle`` with its element spans) are the operator-state format's
(``operator_format.py``). The handle says where it is and, per state, its mode and
element count. The newest record of a subtask wins; records written before operator
state existed have none (``operator_state`` absent).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from struct import Struct
from typing import Any

from statebackend.backends.changelog import Change, ChangeOp, ChangeSet
from statebackend.backends.keyed import StateMetaInfo
from statebackend.backends.operator import OperatorStateCut
from statebackend.backends.stores import KEY_GROUP_PREFIX
from statebackend.backends.timers import TimerSnapshotInfo
from statebackend.checksums import checksum
from statebackend.errors import CheckpointCorruptedError, StateAccessError
from statebackend.keygroups import KeyGroupRange
from statebackend.redistribution import DistributionMode, StateLayout
from statebackend.serializers import SerializerConfig
from statebackend.snapshot.frames import decode_frames, encode_frame
from statebackend.snapshot.handles import (
    KeyGroupIndexedFile,
    indexed_file_from_json,
    keyed_state_from_json,
    keyed_state_json,
)
from statebackend.snapshot.keyed_format import FRAME_BYTES, LENGTH
from statebackend.snapshot.operator_format import OperatorStateHandle, encode_operator_cut

CHANGE_HEAD = Struct(">BHI")
"""``[op][state index][key length]`` of a change."""
_OP_STATE = Struct(">BH")
_LENGTHS = Struct(">II")
_KEY_FROM = KEY_GROUP_PREFIX.size
"""Where ``[key length][key]`` starts in a composite prefix."""
_EMPTY = LENGTH.pack(0)
_NO_VALUE = _LENGTHS.pack(0, 0)

HANDLE_TYPE = "changelog"


@dataclass(frozen=True)
class RecordOperatorState:
    """Where a changelog record holds its subtask's operator state (``offset`` and
    ``length`` in the record's file) and what: per named state its mode and element
    count (``states``), and the number of raw partitions (``raw``)."""

    offset: int
    length: int
    states: Mapping[str, StateLayout] = field(default_factory=dict)
    raw: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for the record's handle."""
        return {
            "offset": self.offset,
            "length": self.length,
            "states": {
                name: {"mode": layout.mode.value, "elements": layout.length}
                for name, layout in sorted(self.states.items())
            },
            "raw": self.raw,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RecordOperatorState:
        """The inverse of ``to_json``."""
        return cls(
            int(data["offset"]),
            int(data["length"]),
            {
                name: StateLayout(DistributionMode(info["mode"]), int(info["elements"]))
                for name, info in data["states"].items()
            },
            int(data.get("raw", 0)),
        )


@dataclass(frozen=True)
class ChangelogHandle(KeyGroupIndexedFile):
    """Where one subtask attempt's changelog record of one batch lives and what it holds.

    ``path`` is relative to the job's manifests directory (``../changelog/<batch>/...``),
    like every handle's path is relative to the directory of the file that lists it.
    """

    batch_id: int
    operator_id: str
    subtask: int
    attempt: str
    changes: int
    states: tuple[StateMetaInfo, ...]
    key_serializer: SerializerConfig
    timers: TimerSnapshotInfo | None = None
    """The subtask's timer clocks at the end of the batch (None in records without)."""
    operator_state: RecordOperatorState | None = None
    """Where the record holds the subtask's operator state (None: it holds none)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for batch manifests."""
        return {
            "type": HANDLE_TYPE,
            "batch_id": self.batch_id,
            "operator": self.operator_id,
            "subtask": self.subtask,
            "attempt": self.attempt,
            "changes": self.changes,
            **self.indexed_file_json(),
            **keyed_state_json(self.key_group_range, self.states, self.key_serializer, self.timers),
        } | (
            {} if self.operator_state is None else {"operator_state": self.operator_state.to_json()}
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChangelogHandle:
        """The inverse of ``to_json``; CheckpointCorruptedError if it is not one."""
        if data.get("type") != HANDLE_TYPE:
            raise CheckpointCorruptedError(f"not a changelog handle: type {data.get('type')!r}")
        operator_state = data.get("operator_state")
        return cls(
            batch_id=int(data["batch_id"]),
            operator_id=str(data["operator"]),
            subtask=int(data["subtask"]),
            attempt=str(data["attempt"]),
            changes=int(data["changes"]),
            **indexed_file_from_json(data),
            operator_state=(
                None if operator_state is None else RecordOperatorState.from_json(operator_state)
            ),
            **keyed_state_from_json(data),
        )


def encode_changes(change_set: ChangeSet, codec: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    """The record's bytes and its key-group index ``[(key group, offset, length)]``.

    The hot path of a batch's end: each change is built from its composite prefix
    ``[key group][key length][key]`` by slicing (the change's ``[key length][key]`` is the
    prefix's own), with one ``pack`` per change; frames are cut between changes.
    """
    index = {meta.name: i for i, meta in enumerate(change_set.states)}
    missing = sorted(set(change_set.changes) - set(index))
    if missing:
        raise StateAccessError(
            f"states {missing} have changes but no meta info: a backend's stores must "
            f"belong to registered or restored states"
        )
    groups: dict[bytes, list[bytes]] = {}
    pack_lengths = _LENGTHS.pack
    for name in sorted(change_set.changes, key=index.__getitem__):
        changes = change_set.changes[name]
        heads = [_OP_STATE.pack(op, index[name]) for op in ChangeOp]
        put, delete, map_put, map_remove = heads
        for prefix in sorted(changes.values):
            value = changes.values[prefix]
            parts = groups.setdefault(prefix[:_KEY_FROM], [])
            if value is None:
                parts.append(delete + prefix[_KEY_FROM:] + _NO_VALUE)
            else:
                parts.append(put + prefix[_KEY_FROM:] + pack_lengths(0, len(value)) + value)
        for prefix in sorted(changes.maps):
            key_changes = changes.maps[prefix]
            parts = groups.setdefault(prefix[:_KEY_FROM], [])
            key = prefix[_KEY_FROM:]
            if key_changes.cleared:
                parts.append(delete + key + _NO_VALUE)
            for user_key in sorted(key_changes.entries):
                value = key_changes.entries[user_key]
                if value is None:
                    parts.append(map_remove + key + LENGTH.pack(len(user_key)) + user_key + _EMPTY)
                else:
                    lengths = pack_lengths(len(user_key), len(value))
                    parts.append(map_put + key + lengths[:4] + user_key + lengths[4:] + value)
    frames: list[bytes] = []
    key_groups: list[tuple[int, int, int]] = []
    offset = 0
    for group in sorted(groups):
        start = offset
        for frame in _frames(groups.pop(group), codec):
            frames.append(frame)
            offset += len(frame)
        (key_group,) = KEY_GROUP_PREFIX.unpack(group)
        key_groups.append((key_group, start, offset - start))
    return b"".join(frames), key_groups


def _frames(changes: list[bytes], codec: int) -> Iterator[bytes]:
    """The encoded ``changes`` of one key group in frames of about ``FRAME_BYTES``."""
    chunk: list[bytes] = []
    size = 0
    for change in changes:
        chunk.append(change)
        size += len(change)
        if size >= FRAME_BYTES:
            yield encode_frame(b"".join(chunk), codec)
            chunk, size = [], 0
    if chunk:
        yield encode_frame(b"".join(chunk), codec)


def _decode_changes(payload: bytes, where: str) -> Iterator[tuple[int, Change]]:
    view, position = memoryview(payload), 0
    try:
        while position < len(view):
            op, state, key_length = CHANGE_HEAD.unpack_from(view, position)
            position += CHANGE_HEAD.size
            key = bytes(view[position : position + key_length])
            position += key_length
            parts = []
            for _ in range(2):
                (length,) = LENGTH.unpack_from(view, position)
                position += LENGTH.size
                parts.append(bytes(view[position : position + length]))
                position += length
            if position > len(view):
                raise ValueError("entry runs past the frame")
            yield state, Change(ChangeOp(op), key, parts[0], parts[1])
    except Exception as exc:
        raise CheckpointCorruptedError(f"{where}: malformed change at byte {position}") from exc


def read_changes(
    read_range: Callable[[str, int, int], bytes],
    path: str,
    handle: ChangelogHandle,
    key_groups: KeyGroupRange,
) -> Iterator[tuple[str, int, Change]]:
    """(state name, key group, change) of the key groups of ``handle`` in ``key_groups``.

    One ranged read (``read_range(path, start, length)``) of exactly those key groups,
    which are contiguous in the file; every frame read is verified.
    """
    wanted = [item for item in handle.key_groups if item[0] in key_groups]
    if not wanted or handle.path is None:
        return
    names = [meta.name for meta in handle.states]
    start = wanted[0][1]
    data = read_range(path, start, wanted[-1][1] + wanted[-1][2] - start)
    for key_group, offset, length in wanted:
        where = f"{path} (key group {key_group})"
        block = data[offset - start : offset - start + length]
        if len(block) != length:
            raise CheckpointCorruptedError(f"{where}: file is truncated")
        for payload in decode_frames(block, where):
            for state, change in _decode_changes(payload, where):
                if state >= len(names):
                    raise CheckpointCorruptedError(f"{where}: unknown state index {state}")
                yield names[state], key_group, change


_HEADER_LENGTH = Struct(">I")


def encode_operator_state(
    cut: OperatorStateCut, offset: int, codec: int
) -> tuple[bytes, RecordOperatorState]:
    """The frame holding ``cut`` in a record, placed at ``offset`` of the record's file,
    and where-and-what for the record's handle."""
    blob, states, raw = encode_operator_cut(cut)
    handle = OperatorStateHandle(None, len(blob), checksum(blob), states, raw)
    header = json.dumps(handle.to_json(), separators=(",", ":")).encode("utf-8")
    frame = encode_frame(_HEADER_LENGTH.pack(len(header)) + header + blob, codec)
    return frame, RecordOperatorState(offset, len(frame), cut.state_layouts(), len(cut.raw))


def read_operator_state(
    read_range: Callable[[str, int, int], bytes], path: str, handle: ChangelogHandle
) -> OperatorStateHandle | None:
    """The operator state of record ``handle`` (file ``path``), read with one ranged read
    and verified, as an operator-state handle holding its blob inline (an
    ``operator_format.OperatorStateReader`` reads it); None if the record holds none."""
    info = handle.operator_state
    if info is None:
        return None
    where = f"{path} (operator state)"
    data = read_range(path, info.offset, info.length)
    if len(data) != info.length:
        raise CheckpointCorruptedError(f"{where}: file is truncated")
    payload = b"".join(decode_frames(data, where))
    try:
        (length,) = _HEADER_LENGTH.unpack_from(payload)
        start = _HEADER_LENGTH.size
        stored = OperatorStateHandle.from_json(json.loads(payload[start : start + length]))
    except Exception as exc:
        raise CheckpointCorruptedError(f"{where}: malformed header") from exc
    blob = payload[start + length :]
    if len(blob) != stored.size:
        raise CheckpointCorruptedError(f"{where}: {len(blob)} bytes, expected {stored.size}")
    return OperatorStateHandle(None, stored.size, stored.checksum, stored.states, stored.raw, blob)
