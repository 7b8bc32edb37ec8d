"""The full keyed format's readers refuse an entry that runs past its frame."""

from __future__ import annotations

import pytest

from statebackend.backends.keyed import StateMetaInfo
from statebackend.errors import CheckpointCorruptedError
from statebackend.keygroups import KeyGroupRange
from statebackend.snapshot.frames import check_codec, encode_frame
from statebackend.snapshot.keyed_format import (
    ENTRY_HEAD,
    LENGTH,
    FullKeyedStateHandle,
    read_composite_runs,
    read_keyed_entries,
)
from statebackend.state.descriptors import StateKind


def _file_of(payload: bytes) -> tuple[bytes, FullKeyedStateHandle]:
    """One frame of ``payload`` (a checksum the frame matches) as key group 0's block."""
    data = encode_frame(payload, check_codec("none"))
    handle = FullKeyedStateHandle(
        path="f",
        size=len(data),
        checksum="",
        key_group_range=KeyGroupRange(0, 0),
        key_groups=((0, 0, len(data)),),
        compression="none",
        states=(StateMetaInfo("s", StateKind.VALUE, {}),),
        key_serializer={},
    )
    return data, handle


def _entry(key: bytes, value: bytes, value_length: int) -> bytes:
    return ENTRY_HEAD.pack(0, len(key)) + key + LENGTH.pack(0) + LENGTH.pack(value_length) + value


@pytest.mark.parametrize("reader", [read_keyed_entries, read_composite_runs])
def test_an_entry_longer_than_its_frame_is_corruption(reader: object) -> None:
    whole = _entry(b"k1", b"value", 5)
    data, handle = _file_of(whole + _entry(b"k2", b"abc", 10))

    def read_range(path: str, start: int, length: int) -> bytes:
        return data[start : start + length]

    with pytest.raises(CheckpointCorruptedError, match="malformed entry"):
        list(reader(read_range, "f", handle, KeyGroupRange(0, 0)))  # type: ignore[operator]


def test_whole_entries_read_back() -> None:
    data, handle = _file_of(_entry(b"k1", b"value", 5) + _entry(b"k2", b"", 0))

    def read_range(path: str, start: int, length: int) -> bytes:
        return data[start : start + length]

    entries = list(read_keyed_entries(read_range, "f", handle, KeyGroupRange(0, 0)))
    assert entries == [("s", 0, (b"k1", b"", b"value")), ("s", 0, (b"k2", b"", b""))]
