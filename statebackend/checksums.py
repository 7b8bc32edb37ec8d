"""The checksum every stored file and inlined blob carries, as ``<algorithm>:<hex digest>``.

CRC-32 (``crc32:<8 hex>``) is the default: it detects accidental damage cheaply. SHA-256
(``sha256:<64 hex>``) is written when checkpoints are signed (``checkpoint/signing.py``):
unlike a CRC, nobody can make other bytes with the same digest, so a signature over the
digests protects the files' content too. A checksum string names its algorithm, so a
reader always checks with the algorithm the writer used.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Callable, Collection
from typing import Any

CRC32 = "crc32"
SHA256 = "sha256"
ALGORITHMS = (CRC32, SHA256)

_PATTERNS = {CRC32: re.compile(r"crc32:[0-9a-f]{8}"), SHA256: re.compile(r"sha256:[0-9a-f]{64}")}


def format_crc(crc: int) -> str:
    """The checksum string of a CRC-32 value."""
    return f"{CRC32}:{crc:08x}"


class RunningChecksum:
    """A checksum of ``algorithm`` over bytes fed chunk by chunk."""

    def __init__(self, algorithm: str = CRC32) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}: use one of {ALGORITHMS}")
        self.algorithm = algorithm
        self._crc = 0
        self._sha = hashlib.sha256() if algorithm == SHA256 else None

    def update(self, chunk: bytes) -> None:
        """Add the next bytes."""
        if self._sha is not None:
            self._sha.update(chunk)
        else:
            self._crc = zlib.crc32(chunk, self._crc)

    def value(self) -> str:
        """The checksum string of all bytes added so far."""
        if self._sha is not None:
            return f"{SHA256}:{self._sha.hexdigest()}"
        return format_crc(self._crc)


def checksum(data: bytes, algorithm: str = CRC32) -> str:
    """The checksum string of ``data``."""
    running = RunningChecksum(algorithm)
    running.update(data)
    return running.value()


def algorithm_of(value: str) -> str | None:
    """The algorithm of a well-formed checksum string, or None if it is not one."""
    algorithm = value.split(":", 1)[0] if isinstance(value, str) else None
    pattern = _PATTERNS.get(algorithm or "")
    return algorithm if pattern is not None and pattern.fullmatch(value) else None


DOCUMENT_CHECKSUM = "checksum"
"""The field of a JSON document (``_metadata``, a batch manifest) that holds the CRC-32 of
its other fields as written (``with_document_checksum``)."""


def with_document_checksum(
    document: dict[str, Any], serialize: Callable[[dict[str, Any]], bytes]
) -> dict[str, Any]:
    """``document`` with a ``DOCUMENT_CHECKSUM`` field: the checksum of ``serialize(document)``
    (a canonical serialization: the reader serializes what it parsed the same way)."""
    return {**document, DOCUMENT_CHECKSUM: checksum(serialize(document))}


def document_checksum_problem(
    document: dict[str, Any],
    serialize: Callable[[dict[str, Any]], bytes],
    older_fields: Collection[str],
) -> str | None:
    """Remove ``DOCUMENT_CHECKSUM`` from a parsed ``document`` and say what is wrong if the
    rest does not match it (None if it does). A document without it is an older
    release's, whose top-level fields are among ``older_fields``: one with another field
    is damaged (the checksum field's name itself, most likely), else None."""
    expected = document.pop(DOCUMENT_CHECKSUM, None)
    if expected is None:
        unknown = sorted(str(name) for name in document if name not in older_fields)
        if unknown:
            return (
                f"it has no checksum and a field {unknown[0]!r} that no release without "
                f"checksums wrote (a damaged checksum field)"
            )
        return None
    algorithm = algorithm_of(expected)
    if algorithm is None:
        return f"its checksum {expected!r} is malformed"
    actual = checksum(serialize(document), algorithm)
    if actual != expected:
        return f"its content does not match its checksum ({actual} != {expected})"
    return None
