"""Frames: checksummed, optionally compressed blocks that snapshot files are made of.

A frame is ``[codec: 1 byte][raw length: 4][payload length: 4][crc32 of payload: 4]``
followed by the payload. Each frame can be read and checked on its own, so a restore
that reads a byte range of a file (some key groups, some list elements) verifies exactly
what it read.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from struct import Struct

from statebackend.errors import CheckpointCorruptedError, ConfigurationError

FRAME_HEADER = Struct(">BIII")

CODECS = ("none", "lz4", "zstd")
"""Compression codecs a snapshot may use, by name (their frame codes are their indices)."""
DEFAULT_CODEC = "lz4"
"""The codec of a job's checkpoints and of the savepoints the command line writes, unless
one is chosen (``compression``, ``--compression``)."""


def check_codec(name: str) -> int:
    """The frame code of codec ``name``; ConfigurationError naming it if unknown."""
    if name not in CODECS:
        raise ConfigurationError(
            f"unknown snapshot compression {name!r}: choose one of {', '.join(CODECS)}"
        )
    return CODECS.index(name)


def _compress(code: int, data: bytes) -> bytes:
    if code == 1:
        import lz4.block

        return bytes(lz4.block.compress(data, store_size=False))
    if code == 2:
        import zstandard

        return bytes(zstandard.ZstdCompressor(level=3).compress(data))
    return data


def _decompress(code: int, payload: bytes, raw_length: int) -> bytes:
    if code == 1:
        import lz4.block

        return bytes(lz4.block.decompress(payload, uncompressed_size=raw_length))
    if code == 2:
        import zstandard

        return bytes(zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_length))
    return payload


LZ4_MAX_RATIO = 255
"""An LZ4 block of n bytes decompresses to at most 255 n bytes (a byte of a match's
length adds at most 255 to it)."""


def _most_raw_bytes(code: int, payload: bytes) -> int:
    """The most bytes a frame's ``payload`` of codec ``code`` can decompress to: its
    length stored, 255 times it for LZ4, the content size a zstd frame declares (zstd
    frames this module writes always declare it; one that does not is no frame of ours)."""
    if code == 1:
        return LZ4_MAX_RATIO * len(payload)
    if code == 2:
        import zstandard

        try:
            declared = zstandard.frame_content_size(payload)
        except zstandard.ZstdError:
            return 0
        return max(declared, 0)
    return len(payload)


def encode_frame(data: bytes, codec: int) -> bytes:
    """One frame holding ``data``; falls back to no compression when it does not help."""
    payload = _compress(codec, data) if codec else data
    if len(payload) >= len(data):
        codec, payload = 0, data
    header = FRAME_HEADER.pack(codec, len(data), len(payload), zlib.crc32(payload))
    return header + payload


def decode_frames(data: bytes, where: str) -> Iterator[bytes]:
    """The payloads of the consecutive frames in ``data``, each checked against its crc32.

    Raises CheckpointCorruptedError naming ``where`` for a truncated or damaged frame.
    """
    view, position = memoryview(data), 0
    while position < len(view):
        if position + FRAME_HEADER.size > len(view):
            raise CheckpointCorruptedError(f"{where}: truncated frame header at byte {position}")
        codec, raw_length, length, crc = FRAME_HEADER.unpack_from(view, position)
        position += FRAME_HEADER.size
        payload = bytes(view[position : position + length])
        if len(payload) != length:
            raise CheckpointCorruptedError(f"{where}: truncated frame at byte {position}")
        if zlib.crc32(payload) != crc:
            raise CheckpointCorruptedError(
                f"{where}: checksum mismatch in the frame at byte {position - FRAME_HEADER.size}"
            )
        if codec >= len(CODECS):
            raise CheckpointCorruptedError(f"{where}: unknown frame codec {codec}")
        # The header is not covered by the crc: a damaged codec or raw length must still
        # come out as corruption, never as a codec's own error, as other bytes or as a
        # buffer of the raw length allocated before the payload is seen to hold it.
        start = position - FRAME_HEADER.size
        most = _most_raw_bytes(codec, payload)
        if raw_length > most:
            raise CheckpointCorruptedError(
                f"{where}: the frame at byte {start} says it holds {raw_length} bytes, but its "
                f"{length} {CODECS[codec]} bytes hold at most {most}"
            )
        try:
            raw = _decompress(codec, payload, raw_length)
        except Exception as exc:
            raise CheckpointCorruptedError(
                f"{where}: cannot decompress the frame at byte {start}: {exc}"
            ) from exc
        if len(raw) != raw_length:
            raise CheckpointCorruptedError(
                f"{where}: the frame at byte {start} holds {len(raw)} bytes, "
                f"its header says {raw_length}"
            )
        position += length
        yield raw
