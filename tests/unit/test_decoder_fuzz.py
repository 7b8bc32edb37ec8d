"""Every decoder of what statebackend reads back from storage, fuzzed: valid bytes built
with the real encoders, then damaged (bit flips, truncation, inserted and deleted bytes,
length fields set to huge values, JSON values of the wrong type, missing keys, deep
nesting). Each read must give back exactly what was written or raise the error class
its module documents for damage (CheckpointCorruptedError, or SerializationError for a
value's bytes), with a one-line message naming the file; never another exception type,
never an allocation sized by a damaged length field."""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statebackend.errors import CheckpointCorruptedError
from statebackend.snapshot.frames import FRAME_HEADER, decode_frames, encode_frame

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MEMORY_LIMIT = 64 << 20
"""Peak bytes a decoder may allocate for a small input whatever its length fields say."""
HUGE_LENGTHS = (0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 0x10000000)


# -- damage ------------------------------------------------------------------------------


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with one to three kinds of damage done to it."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "length"]))
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind == "flip" and out:
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del out[at:]
        elif kind == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del out[at : at + draw(st.integers(1, 8))]
        elif kind == "length" and len(out) >= 4:
            at = min(at, len(out) - 4)
            struct.pack_into(">I", out, at, draw(st.sampled_from(HUGE_LENGTHS)))
    return bytes(out)


def check_error(error: BaseException, where: str) -> None:
    """The damage error is one line and names the file it was found in."""
    message = str(error)
    assert "\n" not in message, message
    assert where in message, message


def read_back(
    read: Callable[[], Any], expected: Any, where: str, errors: tuple[type[Exception], ...]
) -> None:
    """``read()`` gives ``expected`` or raises one of ``errors`` naming ``where``."""
    try:
        got = read()
    except errors as exc:
        check_error(exc, where)
        return
    assert got == expected


def peak_allocation(call: Callable[[], Any]) -> int:
    """The peak bytes Python allocated while ``call`` ran (its exception ignored)."""
    tracemalloc.start()
    try:
        call()
    except Exception:  # noqa: S110 - only the allocation is measured here
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# -- frames ------------------------------------------------------------------------------

_PAYLOADS = st.lists(
    st.one_of(st.binary(max_size=200), st.builds(lambda n: b"ab" * n, st.integers(0, 3000))),
    min_size=1,
    max_size=3,
)


@FUZZ
@given(_PAYLOADS, st.integers(0, 2), st.data())
def test_damaged_frames_read_back_or_are_corruption(
    payloads: list[bytes], codec: int, data: st.DataObject
) -> None:
    frames = [encode_frame(p, codec) for p in payloads]
    broken = data.draw(damaged(b"".join(frames)))
    try:
        got = list(decode_frames(broken, "chk-1/f"))
    except CheckpointCorruptedError as exc:
        check_error(exc, "chk-1/f")
        return
    # Frames cut off after a whole frame are whole frames: the readers check the length
    # of what they read against the file's index, not decode_frames.
    assert got == payloads[: len(got)]
    assert broken == b"".join(frames[: len(got)])


@pytest.mark.parametrize("codec", [0, 1, 2])
def test_every_truncation_of_frames_is_corruption(codec: int) -> None:
    payloads = [b"abc" * 300, bytes(range(256))]
    encoded = b"".join(encode_frame(p, codec) for p in payloads)
    ends = {len(encode_frame(payloads[0], codec))}
    for cut in set(range(1, len(encoded))) - ends:
        with pytest.raises(CheckpointCorruptedError, match="chk-1/f"):
            list(decode_frames(encoded[:cut], "chk-1/f"))


def _zstd_frame_without_content_size(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(write_content_size=False).compress(data)


@pytest.mark.parametrize("raw_length", HUGE_LENGTHS)
@pytest.mark.parametrize(
    "codec, payload",
    [
        (1, encode_frame(b"hello world " * 100, 1)[FRAME_HEADER.size :]),
        (1, b"\x00" * 64),  # a stored frame whose codec byte says lz4
        (2, encode_frame(b"hello world " * 100, 2)[FRAME_HEADER.size :]),
        (2, _zstd_frame_without_content_size(b"hello world " * 100)),
    ],
    ids=["lz4", "none-as-lz4", "zstd", "zstd-without-size"],
)
def test_a_huge_raw_length_allocates_nothing_of_its_size(
    codec: int, payload: bytes, raw_length: int
) -> None:
    frame = FRAME_HEADER.pack(codec, raw_length, len(payload), zlib.crc32(payload)) + payload
    with pytest.raises(CheckpointCorruptedError, match="chk-1/f"):
        list(decode_frames(frame, "chk-1/f"))
    assert peak_allocation(lambda: list(decode_frames(frame, "chk-1/f"))) < MEMORY_LIMIT
