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
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import add, getitem
from struct import Struct
from typing import Any, cast

import numpy as np

from statebackend.backends.changelog import Change, ChangeOp, ChangeSet, MapKeyChanges
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
from statebackend.state.descriptors import StateKind

CHANGE_HEAD = Struct(">BHI")
"""``[op][state index][key length]`` of a change."""
_FITTING_OPS = {
    False: frozenset({ChangeOp.PUT, ChangeOp.DELETE}),
    True: frozenset({ChangeOp.DELETE, ChangeOp.MAP_PUT, ChangeOp.MAP_REMOVE}),
}
"""The ops a change of a value-kind (False) or map-kind (True) state can have."""
_OP_STATE = Struct(">BH")
_LENGTHS = Struct(">II")
_KEY_FROM = KEY_GROUP_PREFIX.size
"""Where ``[key length][key]`` starts in a composite prefix."""
_KEY_SLICE = slice(_KEY_FROM, None)
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


Piece = tuple[bytes, list[int]]
"""Encoded changes of one key group, back to back, and where each ends in the bytes."""


def encode_changes(change_set: ChangeSet, codec: int) -> tuple[bytes, list[tuple[int, int, int]]]:
    """The record's bytes and its key-group index ``[(key group, offset, length)]``.

    The hot path of a batch's end, with no Python step per value-kind change: a state's
    value changes are built from their sorted composite prefixes ``[key group][key
    length][key]`` less the key group (the change's ``[key length][key]`` is the
    prefix's own), their lengths and values, all at once (``_value_changes``), and cut
    into key groups by bisecting the sorted prefixes; a key group's changes are cut into
    frames by bisecting where they end.
    """
    index = {meta.name: i for i, meta in enumerate(change_set.states)}
    missing = sorted(set(change_set.changes) - set(index))
    if missing:
        raise StateAccessError(
            f"states {missing} have changes but no meta info: a backend's stores must "
            f"belong to registered or restored states"
        )
    groups: dict[bytes, list[Piece]] = {}
    for name in sorted(change_set.changes, key=index.__getitem__):
        changes = change_set.changes[name]
        heads = [_OP_STATE.pack(op, index[name]) for op in ChangeOp]
        if changes.values:
            _add_value_changes(groups, changes.values, heads[ChangeOp.PUT], heads[ChangeOp.DELETE])
        if changes.maps:
            _add_map_changes(groups, changes.maps, heads)
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


def _add_value_changes(
    groups: dict[bytes, list[Piece]], values: dict[bytes, bytes | None], put: bytes, delete: bytes
) -> None:
    """Append one value-kind state's changes, in composite-prefix order, to the pieces
    of their key groups (``groups``, by 2-byte key-group prefix)."""
    prefixes = sorted(values)
    read = list(map(values.__getitem__, prefixes))
    size = len(prefixes)
    heads: list[bytes] | None = None
    if None in read:  # deletes: no value, lengths (0, 0)
        heads = [delete if value is None else put for value in read]
        stored = [b"" if value is None else value for value in read]
    else:
        stored = cast("list[bytes]", read)
    value_sizes = list(map(len, stored))
    key_sizes = list(map(len, prefixes))
    start = 0
    if heads is None and min(value_sizes) == max(value_sizes) and min(key_sizes) == max(key_sizes):
        encoded = _fixed_width_changes(prefixes, stored, put, key_sizes[0], value_sizes[0])
        width = len(encoded) // size
        while start < size:
            stop = _key_group_end(prefixes, start)
            ends = list(range(width, (stop - start) * width + 1, width))
            groups.setdefault(prefixes[start][:_KEY_FROM], []).append(
                (encoded[start * width : stop * width], ends)
            )
            start = stop
        return
    changes = list(
        map(
            b"".join,
            zip(
                repeat(put) if heads is None else heads,
                cast("Iterator[bytes]", map(getitem, prefixes, repeat(_KEY_SLICE))),
                map(_LENGTHS.pack, repeat(0), value_sizes),
                stored,
                strict=False,  # the heads may be repeat(put), which never ends
            ),
        )
    )
    while start < size:
        stop = _key_group_end(prefixes, start)
        piece = changes[start:stop]
        groups.setdefault(prefixes[start][:_KEY_FROM], []).append(
            (b"".join(piece), list(accumulate(map(len, piece))))
        )
        start = stop


def _key_group_end(prefixes: list[bytes], start: int) -> int:
    """Where the key group of ``prefixes[start]`` ends in the sorted ``prefixes``."""
    (key_group,) = KEY_GROUP_PREFIX.unpack_from(prefixes[start])
    return bisect_left(prefixes, KEY_GROUP_PREFIX.pack(key_group + 1), start)


def _fixed_width_changes(
    prefixes: list[bytes], stored: list[bytes], put: bytes, prefix_size: int, value_size: int
) -> bytes:
    """The put changes of ``prefixes`` (all ``prefix_size`` bytes long) to ``stored``
    (all ``value_size`` bytes long), back to back, built as the columns of one byte
    matrix (a row per change) instead of one bytes object per change."""
    rows = len(prefixes)
    key_size = prefix_size - _KEY_FROM
    lengths = _LENGTHS.pack(0, value_size)
    matrix = np.empty((rows, len(put) + key_size + len(lengths) + value_size), np.uint8)
    column = len(put)
    matrix[:, :column] = np.frombuffer(put, np.uint8)
    keys = np.frombuffer(b"".join(prefixes), np.uint8).reshape(rows, prefix_size)
    matrix[:, column : column + key_size] = keys[:, _KEY_FROM:]
    column += key_size
    matrix[:, column : column + len(lengths)] = np.frombuffer(lengths, np.uint8)
    column += len(lengths)
    matrix[:, column:] = np.frombuffer(b"".join(stored), np.uint8).reshape(rows, value_size)
    return matrix.tobytes()


def _add_map_changes(
    groups: dict[bytes, list[Piece]], maps: dict[bytes, MapKeyChanges], heads: list[bytes]
) -> None:
    """Append one map-kind state's changes, key by key in composite-prefix order (a
    cleared key's prefix delete before its entries, then its entries by user key), to
    the pieces of their key groups."""
    _, delete, map_put, map_remove = heads
    for prefix in sorted(maps):
        key_changes = maps[prefix]
        pieces = groups.setdefault(prefix[:_KEY_FROM], [])  # listed even if it has none
        parts: list[bytes] = []
        key = prefix[_KEY_FROM:]
        if key_changes.cleared:
            parts.append(delete + key + _NO_VALUE)
        for user_key in sorted(key_changes.entries):
            value = key_changes.entries[user_key]
            if value is None:
                parts.append(map_remove + key + LENGTH.pack(len(user_key)) + user_key + _EMPTY)
            else:
                lengths = _LENGTHS.pack(len(user_key), len(value))
                parts.append(map_put + key + lengths[:4] + user_key + lengths[4:] + value)
        if parts:
            pieces.append((b"".join(parts), list(accumulate(map(len, parts)))))


def _frames(pieces: list[Piece], codec: int) -> Iterator[bytes]:
    """The changes of one key group (``pieces``) in frames: each frame ends with the
    first change that brings its size to ``FRAME_BYTES`` or more (the last one with the
    last change)."""
    data = b"".join(piece for piece, _ in pieces)
    ends: list[int] = []
    for _, piece_ends in pieces:
        before = ends[-1] if ends else 0
        ends.extend(map(add, piece_ends, repeat(before)) if before else piece_ends)
    start = 0
    while start < len(data):
        stop = ends[min(bisect_left(ends, start + FRAME_BYTES), len(ends) - 1)]
        yield encode_frame(data[start:stop], codec)
        start = stop


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


def changes_range(handle: ChangelogHandle, key_groups: KeyGroupRange) -> tuple[int, int] | None:
    """(start, length) of the one ranged read ``read_changes`` makes of ``handle``'s file
    for ``key_groups``; None if it reads nothing (no file, or none of the key groups)."""
    wanted = [item for item in handle.key_groups if item[0] in key_groups]
    if not wanted or handle.path is None:
        return None
    start = wanted[0][1]
    return start, wanted[-1][1] + wanted[-1][2] - start


def read_changes(
    read_range: Callable[[str, int, int], bytes],
    path: str,
    handle: ChangelogHandle,
    key_groups: KeyGroupRange,
) -> Iterator[tuple[str, int, Change]]:
    """(state name, key group, change) of the key groups of ``handle`` in ``key_groups``.

    One ranged read (``read_range(path, start, length)``, the range ``changes_range``
    gives) of exactly those key groups, which are contiguous in the file; every frame
    read is verified.
    """
    span = changes_range(handle, key_groups)
    if span is None:
        return
    names = [meta.name for meta in handle.states]
    fitting = [_FITTING_OPS[meta.kind is StateKind.MAP] for meta in handle.states]
    start = span[0]
    data = read_range(path, *span)
    for key_group, offset, length in handle.key_groups:
        if key_group not in key_groups:
            continue
        where = f"{path} (key group {key_group})"
        block = data[offset - start : offset - start + length]
        if len(block) != length:
            raise CheckpointCorruptedError(f"{where}: file is truncated")
        for payload in decode_frames(block, where):
            for state, change in _decode_changes(payload, where):
                if state >= len(names):
                    raise CheckpointCorruptedError(f"{where}: unknown state index {state}")
                if change.op not in fitting[state]:
                    raise CheckpointCorruptedError(
                        f"{where}: a {change.op.name} change of {handle.states[state].kind.value}"
                        f" state {names[state]!r}, which has no such change: the record is "
                        f"damaged, restore from an earlier checkpoint"
                    )
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
