"""The raw keyed snapshot format: one file per subtask, each key group's stream in order.

Like the full keyed format (``keyed_format.py``), the file is a sequence of checksummed
frames, each key group's bytes filling whole frames of their own, and the handle keeps
an index ``[key group, offset, length]`` of the key groups that have a stream. A
restore of any key-group range therefore reads one contiguous byte range per run of
key groups and verifies every frame it read. The bytes themselves are opaque.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from statebackend.backends.raw_keyed import RawKeyedStateCut
from statebackend.keygroups import KeyGroupRange
from statebackend.snapshot.frames import encode_frame
from statebackend.snapshot.handles import KeyGroupIndexedFile, indexed_file_from_json
from statebackend.snapshot.keyed_format import FRAME_BYTES, read_key_group_blocks

RAW_KEYED_TYPE = "raw-keyed"


@dataclass(frozen=True)
class RawKeyedStateHandle(KeyGroupIndexedFile):
    """Where one subtask's raw keyed state lives: a file (``path``, relative to the
    checkpoint directory), its key-group range and the index of its key groups."""

    path: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for ``_metadata``."""
        return {
            "type": RAW_KEYED_TYPE,
            "key_group_range": self.key_group_range.to_json(),
            **self.indexed_file_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RawKeyedStateHandle:
        """The inverse of ``to_json``."""
        return cls(
            key_group_range=KeyGroupRange.from_json(data["key_group_range"]),
            **indexed_file_from_json(data),
        )


def encode_raw_keyed_cut(
    cut: RawKeyedStateCut, codec: int, index: list[tuple[int, int, int]]
) -> Iterator[bytes]:
    """The file's frames, key group by key group; fills ``index`` as it goes."""
    offset = 0
    for key_group, stream in cut.streams.items():
        start = offset
        for chunk_start in range(0, len(stream), FRAME_BYTES):
            frame = encode_frame(stream[chunk_start : chunk_start + FRAME_BYTES], codec)
            offset += len(frame)
            yield frame
        if offset > start:
            index.append((key_group, start, offset - start))


def read_raw_keyed_streams(
    read_range: Callable[[str, int, int], bytes],
    path: str,
    handle: RawKeyedStateHandle,
    key_groups: KeyGroupRange,
) -> Iterator[tuple[int, bytes]]:
    """(key group, stream) for the key groups of ``handle`` in ``key_groups``, by ranged
    reads of only those key groups, every frame checked."""
    for key_group, payloads in read_key_group_blocks(
        read_range, path, handle.key_groups, key_groups
    ):
        yield key_group, b"".join(payloads)
