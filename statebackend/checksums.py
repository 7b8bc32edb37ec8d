"""The checksum every stored file and inlined blob carries: CRC-32, as ``crc32:<8 hex>``."""

from __future__ import annotations

import zlib


def format_crc(crc: int) -> str:
    """The checksum string of a CRC-32 value."""
    return f"crc32:{crc:08x}"


def checksum(data: bytes) -> str:
    """The checksum string of ``data``."""
    return format_crc(zlib.crc32(data))
