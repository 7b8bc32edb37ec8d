"""The full keyed snapshot format: one file per subtask, key groups in order.

The file is a sequence of frames (``frames.py``); each key group's entries fill whole
frames of their own, and the handle keeps an index ``[key group, offset, length]`` of
the non-empty key groups. A restore of a sub-range therefore reads one contiguous byte
range and verifies every frame it read. An entry is
``[state index: 2][key length: 4][key][user key length: 4][user key][value length: 4][value]``,
the state index pointing into the handle's state list. The format does not depend on
the backend that wrote it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from struct import Struct
from typing import Any

from statebackend.backends.keyed import KeyedStateCut, StateMetaInfo
from statebackend.backends.stores import KEY_GROUP_PREFIX, KEY_LENGTH, Entry, StateStoreView
from statebackend.backends.timers import TimerSnapshotInfo
from statebackend.errors import CheckpointCorruptedError
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import SerializerConfig
from statebackend.snapshot.frames import decode_frames, encode_frame
from statebackend.snapshot.handles import (
    HandleFiles,
    KeyGroupIndexedFile,
    indexed_file_from_json,
    keyed_state_from_json,
    keyed_state_json,
)
from statebackend.state.descriptors import StateKind

ENTRY_HEAD = Struct(">HI")
LENGTH = Struct(">I")
STATE_INDEX = Struct(">H")
_NO_USER_KEY = Struct(">II")
"""A user-key length of 0 and the value length, packed in one call."""
_KEY_FROM = KEY_GROUP_PREFIX.size
"""Where ``[key length][key]`` starts in a composite key (``stores.CurrentKey``)."""
_KEY_BYTES_FROM = KEY_GROUP_PREFIX.size + KEY_LENGTH.size
"""Where the key's bytes start in a composite key."""
FRAME_BYTES = 1 << 20
"""Raw bytes gathered before a frame is cut (a key group may span several frames)."""


@dataclass(frozen=True)
class FullKeyedStateHandle(KeyGroupIndexedFile):
    """Where one subtask's full keyed snapshot lives and what is in it.

    ``path`` is relative to the checkpoint directory, so a copied directory restores.
    """

    path: str
    states: tuple[StateMetaInfo, ...]
    key_serializer: SerializerConfig
    timers: TimerSnapshotInfo | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for ``_metadata``."""
        return {
            "type": "keyed-full",
            **self.indexed_file_json(),
            **keyed_state_json(self.key_group_range, self.states, self.key_serializer, self.timers),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FullKeyedStateHandle:
        """The inverse of ``to_json``."""
        return cls(**indexed_file_from_json(data), **keyed_state_from_json(data))

    def read_entries(
        self, files: HandleFiles, key_groups: KeyGroupRange
    ) -> Iterator[tuple[str, int, Entry]]:
        """(state name, key group, entry) of its key groups in ``key_groups``, by ranged
        reads of only those (``read_keyed_entries``)."""
        return read_keyed_entries(files.read_range, files.path_of(self.path), self, key_groups)

    def read_runs(
        self, files: HandleFiles, key_groups: KeyGroupRange
    ) -> Iterator[tuple[str, int, list[tuple[bytes, bytes]]]]:
        """Runs of composite keys of its key groups in ``key_groups``, by ranged reads of
        only those (``read_composite_runs``)."""
        return read_composite_runs(files.read_range, files.path_of(self.path), self, key_groups)


def encode_keyed_cut(
    cut: KeyedStateCut, codec: int, index: list[tuple[int, int, int]]
) -> Iterator[bytes]:
    """The file's frames, key group by key group; fills ``index`` as it goes."""
    states = [
        (STATE_INDEX.pack(i), meta.kind is StateKind.MAP, cut.views[meta.name])
        for i, meta in enumerate(cut.states)
    ]
    offset = 0
    for key_group in cut.key_group_range:
        start = offset
        for frame in _key_group_frames(states, key_group, codec):
            offset += len(frame)
            yield frame
        if offset > start:
            index.append((key_group, start, offset - start))


def _key_group_frames(
    states: list[tuple[bytes, bool, StateStoreView]], key_group: int, codec: int
) -> Iterator[bytes]:
    """The frames of one key group: its entries, state by state, cut into frames of
    ``FRAME_BYTES``; ``states`` holds (packed state index, is map state, view).

    The hot loop of a snapshot, so each entry is built from its composite key
    ``[key group][key length][key][user key]`` by slicing (the entry's
    ``[key length][key]`` is the composite key's own) and its pieces are joined once per
    frame. A non-map state's composite key has no user key.
    """
    parts: list[bytes] = []
    add, pack, unpack_from = parts.extend, LENGTH.pack, LENGTH.unpack_from
    pack_no_user_key = _NO_USER_KEY.pack
    size = 0  # the raw frame's length: an entry is 8 bytes longer than key + value
    for head, is_map, view in states:
        if is_map:
            for composite, value in view.composite_items(key_group):
                (key_length,) = unpack_from(composite, _KEY_FROM)
                end = _KEY_BYTES_FROM + key_length
                user_key = composite[end:]
                add(
                    (
                        head,
                        composite[_KEY_FROM:end],
                        pack(len(user_key)),
                        user_key,
                        pack(len(value)),
                        value,
                    )
                )
                size += len(composite) + len(value) + 8
                if size >= FRAME_BYTES:
                    yield encode_frame(b"".join(parts), codec)
                    parts.clear()
                    size = 0
        else:
            for composite, value in view.composite_items(key_group):
                add((head, composite[_KEY_FROM:], pack_no_user_key(0, len(value)), value))
                size += len(composite) + len(value) + 8
                if size >= FRAME_BYTES:
                    yield encode_frame(b"".join(parts), codec)
                    parts.clear()
                    size = 0
    if parts:
        yield encode_frame(b"".join(parts), codec)


def _decode_entries(payload: bytes, where: str) -> Iterator[tuple[int, Entry]]:
    view, position = memoryview(payload), 0
    try:
        while position < len(view):
            state, key_length = ENTRY_HEAD.unpack_from(view, position)
            position += ENTRY_HEAD.size
            key = bytes(view[position : position + key_length])
            position += key_length
            parts = []
            for _ in range(2):
                (length,) = LENGTH.unpack_from(view, position)
                position += LENGTH.size
                parts.append(bytes(view[position : position + length]))
                position += length
            if position > len(view):  # a slice past the end is short, not an error
                raise ValueError("entry runs past the frame")
            yield state, (key, parts[0], parts[1])
    except Exception as exc:
        raise CheckpointCorruptedError(f"{where}: malformed entry at byte {position}") from exc


READ_BYTES = 4 << 20
"""How much a restore reads at once: consecutive key groups are fetched together."""
READ_AHEAD = 4
"""Reads in flight while earlier ones are decoded (threads of one restore)."""


def _read_batches(
    wanted: list[tuple[int, int, int]],
) -> Iterator[list[tuple[int, int, int]]]:
    """Consecutive index items grouped into reads of at most ``READ_BYTES`` (an item
    longer than that is read alone)."""
    batch: list[tuple[int, int, int]] = []
    for item in wanted:
        if batch and item[1] + item[2] - batch[0][1] > READ_BYTES:
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def read_key_group_blocks(
    read_range: Any,
    path: str,
    index: tuple[tuple[int, int, int], ...],
    key_groups: KeyGroupRange,
) -> Iterator[tuple[int, Iterator[bytes]]]:
    """(key group, its frames' payloads) for the key groups of ``index`` (``[key group,
    offset, length]``) in ``key_groups``, each frame checked as it is decoded.

    ``read_range(path, start, length)`` fetches bytes; consecutive key groups are read
    together, up to ``READ_BYTES`` at a time, and up to ``READ_AHEAD`` reads run ahead in
    threads while the caller decodes. Only the needed bytes are read.
    """
    wanted = [item for item in index if item[0] in key_groups]
    if not wanted:
        return
    with ThreadPoolExecutor(READ_AHEAD, "statebackend-read") as pool:
        reads: deque[tuple[list[tuple[int, int, int]], Future[bytes]]] = deque()
        try:
            for batch in _read_batches(wanted):
                start = batch[0][1]
                length = batch[-1][1] + batch[-1][2] - start
                reads.append((batch, pool.submit(read_range, path, start, length)))
                if len(reads) > READ_AHEAD:
                    done, data = reads.popleft()
                    yield from _split_blocks(path, done, data.result())
            while reads:
                done, data = reads.popleft()
                yield from _split_blocks(path, done, data.result())
        finally:
            for _, future in reads:
                future.cancel()


def _split_blocks(
    path: str, batch: list[tuple[int, int, int]], data: bytes
) -> Iterator[tuple[int, Iterator[bytes]]]:
    start = batch[0][1]
    for key_group, offset, length in batch:
        where = f"{path} (key group {key_group})"
        block = data[offset - start : offset - start + length]
        if len(block) != length:
            raise CheckpointCorruptedError(f"{where}: file is truncated")
        yield key_group, decode_frames(block, where)


def read_composite_runs(
    read_range: Any, path: str, handle: FullKeyedStateHandle, key_groups: KeyGroupRange
) -> Iterator[tuple[str, int, list[tuple[bytes, bytes]]]]:
    """(state name, key group, its (composite key, value) pairs) for the key groups of
    ``handle`` in ``key_groups``, read as ``read_key_group_blocks`` does: the entries
    rebuilt as the composite keys a RocksDB backend stores (``stores.CurrentKey`` + user
    key), in the file's order, which is composite-key order within each state and key
    group. The bulk restore's input (``RocksDBKeyedStateBackend.restore_sorted``)."""
    names = [meta.name for meta in handle.states]
    for key_group, payloads in read_key_group_blocks(
        read_range, path, handle.key_groups, key_groups
    ):
        where = f"{path} (key group {key_group})"
        prefix = KEY_GROUP_PREFIX.pack(key_group)
        for payload in payloads:
            for state, pairs in _decode_composites(payload, prefix, where):
                if state >= len(names):
                    raise CheckpointCorruptedError(f"{where}: unknown state index {state}")
                yield names[state], key_group, pairs


def _decode_composites(
    payload: bytes, prefix: bytes, where: str
) -> Iterator[tuple[int, list[tuple[bytes, bytes]]]]:
    """(state index, its pairs) per run of one state's entries in a frame's payload."""
    unpack_head, unpack_length = ENTRY_HEAD.unpack_from, LENGTH.unpack_from
    end, position, state = len(payload), 0, -1
    pairs: list[tuple[bytes, bytes]] = []
    try:
        while position < end:
            entry_state, key_length = unpack_head(payload, position)
            key_end = position + 6 + key_length  # [state: 2][key length: 4][key]
            (user_key_length,) = unpack_length(payload, key_end)
            user_key_end = key_end + 4 + user_key_length
            (value_length,) = unpack_length(payload, user_key_end)
            value_end = user_key_end + 4 + value_length
            if value_end > end:
                raise ValueError("entry runs past the frame")
            if entry_state != state:
                if pairs:
                    yield state, pairs
                state, pairs = entry_state, []
            key = prefix + payload[position + 2 : key_end]
            if user_key_length:
                key += payload[key_end + 4 : user_key_end]
            pairs.append((key, payload[user_key_end + 4 : value_end]))
            position = value_end
    except Exception as exc:
        raise CheckpointCorruptedError(f"{where}: malformed entry at byte {position}") from exc
    if pairs:
        yield state, pairs


def read_keyed_entries(
    read_range: Any, path: str, handle: FullKeyedStateHandle, key_groups: KeyGroupRange
) -> Iterator[tuple[str, int, Entry]]:
    """(state name, key group, entry) for the key groups of ``handle`` in ``key_groups``,
    read as ``read_key_group_blocks`` does."""
    names = [meta.name for meta in handle.states]
    for key_group, payloads in read_key_group_blocks(
        read_range, path, handle.key_groups, key_groups
    ):
        where = f"{path} (key group {key_group})"
        for payload in payloads:
            for state, entry in _decode_entries(payload, where):
                if state >= len(names):
                    raise CheckpointCorruptedError(f"{where}: unknown state index {state}")
                yield names[state], key_group, entry
