"""Signed checkpoints: a checkpoint nobody without the key can change unnoticed.

Why: state serialized with pickle runs code when it is read, and anyone who can write to
a shared checkpoint bucket could otherwise plant such state for every executor that
restores it and every person who inspects it. With a signing key
(``spark.statebackend.checkpoint.signing-key`` or ``signing-key-file``):

- every file a checkpoint writes is checksummed with SHA-256 instead of CRC-32 (a CRC is
  linear: anyone can make other bytes with the same CRC; no one can for SHA-256);
- ``_metadata`` carries an HMAC-SHA256, keyed with the signing key, over its own content
  (``CheckpointMetadata.to_bytes``), which holds every referenced file's path, size and
  SHA-256, and the small operator state inlined in it;
- a reader with the key checks the HMAC before it parses anything else, refuses an
  unsigned checkpoint, and checks each file against its signed SHA-256 before a byte of
  it is deserialized: whole-file reads (incremental restore, ``verify``, savepoint
  copies) check the digest as they read; ranged reads (full-format keyed state, operator
  state) go through ``VerifiedReads``, which downloads the file once to a local
  temporary file, checks its digest there and serves the ranges from that copy, so the
  bytes deserialized are the bytes checked (no window between check and read).

We chose one digest per file over digests per key group or element: it needs no change
to the snapshot formats and keeps the signature small; its cost is that a signed
restore reads each full-format file it needs whole (it reads only the key groups it
needs without signing). Savepoints copied with the key are signed with it as well.
"""

from __future__ import annotations

import hashlib
import hmac
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checksums import (
    SHA256,
    RunningChecksum,
    algorithm_of,
    document_checksum_problem,
    with_document_checksum,
)
from statebackend.errors import CheckpointCorruptedError, CheckpointError, ConfigurationError
from statebackend.snapshot.handles import StoredFile, normalize_path, resolve_path

ALGORITHM = "hmac-sha256"
SIGNATURE = "signature"
"""The field of a signed JSON document (``_metadata``, a batch manifest) holding its
signature (``{"algorithm", "value"}``)."""
FILE_CHECKSUM = SHA256
"""The checksum algorithm of the files of a signed checkpoint."""

MIN_KEY_BYTES = 16
"""The fewest bytes a signing key may have."""
_SPOOL_CHUNK = 4 << 20


@dataclass(frozen=True)
class SigningKey:
    """A secret that signs ``_metadata`` (HMAC-SHA256) and checks signatures."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise ConfigurationError(
                f"the checkpoint signing key has {len(self.secret)} bytes: give at least "
                f"{MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)"
            )

    def sign(self, payload: bytes) -> str:
        """The hex HMAC-SHA256 of ``payload``."""
        return hmac.new(self.secret, payload, hashlib.sha256).hexdigest()

    def matches(self, payload: bytes, signature: str) -> bool:
        """Whether ``signature`` is this key's signature of ``payload`` (constant time)."""
        return hmac.compare_digest(self.sign(payload), signature)


def check_signature(payload: bytes, signature: Any, key: SigningKey, where: str) -> None:
    """CheckpointCorruptedError naming ``where`` unless ``signature`` (the document's
    ``{"algorithm", "value"}`` field) is ``key``'s signature of ``payload`` (the
    document's canonical bytes without that field)."""
    if signature is None:
        raise CheckpointCorruptedError(
            f"{where} is not signed, but a signing key was given: only restore or read it "
            "without the key if you trust everyone who can write to its storage"
        )
    value = signature.get("value") if isinstance(signature, dict) else None
    algorithm = signature.get("algorithm") if isinstance(signature, dict) else None
    if algorithm != ALGORITHM or not isinstance(value, str) or not key.matches(payload, value):
        raise CheckpointCorruptedError(
            f"{where}: the signature does not match: the checkpoint was changed after it "
            "was written, or signed with another key; do not restore it"
        )


def check_signable(files: Iterable[StoredFile], what: str, remedy: str) -> None:
    """CheckpointError naming ``what`` (e.g. "checkpoint 7") unless every one of
    ``files`` has a ``FILE_CHECKSUM`` checksum, which a signature must cover; ``remedy``
    says how to write them so."""
    weak = [f.path for f in files if algorithm_of(f.checksum) != FILE_CHECKSUM]
    if weak:
        raise CheckpointError(
            f"cannot sign {what}: {', '.join(weak)} have no {FILE_CHECKSUM} checksum; {remedy}"
        )


Encode = Callable[[dict[str, Any]], bytes]
"""A JSON document's canonical bytes: the reader encodes what it parsed the same way."""


def document_bytes(document: dict[str, Any], encode: Encode, key: SigningKey | None) -> bytes:
    """The bytes (``encode``) of a checkpoint's or manifest's ``document`` with its checksum
    field and, with ``key``, its ``SIGNATURE`` field: the key's signature of the bytes
    without that field. The caller checks first that the files it names can be signed
    (``check_signable``)."""
    document = with_document_checksum(document, encode)
    if key is None:
        return encode(document)
    signature = {"algorithm": ALGORITHM, "value": key.sign(encode(document))}
    return encode({**document, SIGNATURE: signature})


def check_document(
    document: dict[str, Any], encode: Encode, key: SigningKey | None, where: str, earlier: str
) -> None:
    """Check a parsed ``document`` written by ``document_bytes`` before anything in it is
    used, removing its signature and checksum fields: with ``key`` its signature
    (``check_signature``), then its checksum, so that a damaged version number is damage
    to fall back from, not a newer format. CheckpointCorruptedError naming ``where``,
    telling to restore from an earlier ``earlier`` (e.g. "checkpoint")."""
    signature = document.pop(SIGNATURE, None)
    if key is not None:
        check_signature(encode(document), signature, key, where)
    damage = document_checksum_problem(document, encode)
    if damage is not None:
        raise CheckpointCorruptedError(
            f"{where} is damaged: {damage}; restore from an earlier {earlier}"
        )


def check_signed_files(files: Iterable[StoredFile], where: str) -> None:
    """CheckpointCorruptedError naming ``where`` (a document read with a signing key)
    unless every one of ``files`` it names has a ``FILE_CHECKSUM`` checksum: the
    signature covers a file's content only through that checksum."""
    weak = [f.path for f in files if algorithm_of(f.checksum) != FILE_CHECKSUM]
    if weak:
        raise CheckpointCorruptedError(
            f"{where} is signed but {', '.join(weak)} have no {FILE_CHECKSUM} checksum, "
            f"so their content is not protected: do not restore it"
        )


def load_signing_key(key: str | None = None, key_file: str | None = None) -> SigningKey | None:
    """The signing key given as text (``key``) or in a local file (``key_file``: its
    bytes, one trailing newline dropped), or None if neither is given.

    Raises ConfigurationError if both are given, ``key_file`` is empty or cannot be read,
    or the key is shorter than 16 bytes.
    """
    if key and key_file:
        raise ConfigurationError(
            "both a checkpoint signing key and a signing key file are set: give one"
        )
    if key:
        return SigningKey(key.encode("utf-8"))
    if key_file == "":  # asked for (an unset variable?): not "no key" silently
        raise ConfigurationError(
            "the checkpoint signing key file is empty: give the key's file, or leave the "
            "option out to read without checking signatures"
        )
    if key_file:
        try:
            secret = Path(key_file).read_bytes()
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read the checkpoint signing key file {key_file}: {exc}"
            ) from exc
        return SigningKey(secret.removesuffix(b"\n"))
    return None


class VerifiedReads(CheckpointFileSystem):
    """The file system of a signed checkpoint whose reads of the checkpoint's files
    return only bytes that match their signed SHA-256 (see the module docstring).

    ``files`` are the checkpoint's files, relative to ``directory``. Other paths are read
    as they are. Each file is downloaded once, into a temporary file that ``close``
    removes. Raises CheckpointCorruptedError naming the file when it does not match.
    """

    def __init__(
        self, fs: CheckpointFileSystem, directory: str, files: Iterable[StoredFile]
    ) -> None:
        super().__init__(fs.fsspec, fs.checksum_algorithm)
        self._expected = {resolve_path(directory, f.path): f for f in files}
        self._copies: dict[str, IO[bytes]] = {}
        self._closed = False
        self._copies_lock = threading.Lock()  # not the byte counters' lock: reads count
        self._download_locks: dict[str, threading.Lock] = {}
        """One per file: its download runs once, other files' meanwhile."""

    def _copy(self, path: str) -> tuple[IO[bytes], bool] | None:
        """The checked local copy of ``path`` and whether it is kept (one made after
        ``close`` serves only the read that made it, which closes it), or None if it is no
        file of the checkpoint."""
        path = normalize_path(path)
        expected = self._expected.get(path)
        if expected is None:
            return None
        with self._copies_lock:
            copy = self._copies.get(path)
            if copy is not None:
                return copy, True
            download_lock = self._download_locks.setdefault(path, threading.Lock())
        with download_lock:
            with self._copies_lock:
                copy = self._copies.get(path)
            if copy is not None:
                return copy, True
            copy = self._download(path, expected)
            with self._copies_lock:
                if self._closed:
                    return copy, False
                self._copies[path] = copy
        return copy, True

    def _download(self, path: str, expected: StoredFile) -> IO[bytes]:
        # Kept open until close(): the ranges are served from it.
        copy = tempfile.TemporaryFile(prefix="statebackend-verified-")  # noqa: SIM115
        running, size = RunningChecksum(FILE_CHECKSUM), 0
        try:
            with super().open_read(path) as stream:
                while chunk := stream.read(_SPOOL_CHUNK):
                    copy.write(chunk)
                    running.update(chunk)
                    size += len(chunk)
            if size != expected.size or running.value() != expected.checksum:
                raise CheckpointCorruptedError(
                    f"{path} does not match the signed checkpoint (size {size}, "
                    f"{running.value()}; signed: size {expected.size}, {expected.checksum}): "
                    f"it was changed after the checkpoint was written; do not restore it"
                )
        except BaseException:
            copy.close()
            raise
        return copy

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``path`` from ``start``, from the checked copy."""
        found = self._copy(path)
        if found is None:
            return super().read_range(path, start, length)
        copy, kept = found
        with self._copies_lock:
            copy.seek(start)
            data = copy.read(length)
        if not kept:
            copy.close()
        if len(data) != length:
            raise CheckpointCorruptedError(
                f"{path} is truncated: read {len(data)} of {length} bytes at offset {start}"
            )
        return data

    def read_file(self, path: str) -> bytes:
        """The whole content of ``path``, from the checked copy."""
        found = self._copy(path)
        if found is None:
            return super().read_file(path)
        copy, kept = found
        with self._copies_lock:
            copy.seek(0)
            data = copy.read()
        if not kept:
            copy.close()
        return data

    def close(self) -> None:
        """Remove the local copies; a download still running then serves only its own
        read."""
        with self._copies_lock:
            copies, self._copies, self._closed = self._copies, {}, True
        for copy in copies.values():
            copy.close()

    def __enter__(self) -> VerifiedReads:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextmanager
def verified_reads(
    fs: CheckpointFileSystem,
    directory: str,
    files: Iterable[StoredFile],
    signing_key: SigningKey | None,
) -> Iterator[CheckpointFileSystem]:
    """The file system to read the files of the checkpoint in ``directory`` through:
    ``fs`` itself without a signing key, else a ``VerifiedReads`` (closed on exit).
    ``files`` come from its ``_metadata``, loaded (and so checked) with the same key."""
    if signing_key is None:
        yield fs
        return
    reads = VerifiedReads(fs, directory, files)
    try:
        yield reads
    finally:
        reads.close()
