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
  state) go through ``VerifiedReads``, which reads the file once, whole, into memory
  (small files, within a budget) or a local temporary file, checks its digest there and
  serves the ranges from that copy, so the bytes deserialized are the bytes checked (no
  window between check and read).

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
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from statebackend.checkpoint.filesystem import CheckpointFileSystem, is_transient
from statebackend.checksums import (
    SHA256,
    RunningChecksum,
    algorithm_of,
    checksum,
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
SMALL_FILE_BYTES = 4 << 20
"""A signed file of at most this size is read with one request into memory and served
from there (no request for its size, no temporary file: on file:// creating one costs
more than reading a small record); a larger one streams into a temporary file. The
streaming download holds a chunk of this size in memory anyway, and at a few MB a
request's latency is small beside its transfer."""
IN_MEMORY_BYTES = 64 << 20
"""At most this many bytes of checked copies are held in memory at once by all the
``VerifiedReads`` of a process (a restore holds every file it read until it closes its
reads: a rebuild, all of its records); past it, files go to temporary files."""


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
    document: dict[str, Any],
    encode: Encode,
    key: SigningKey | None,
    where: str,
    earlier: str,
    older_fields: Collection[str],
) -> None:
    """Check a parsed ``document`` written by ``document_bytes`` before anything in it is
    used, removing its signature and checksum fields: with ``key`` its signature
    (``check_signature``), then its checksum, so that a damaged version number is damage
    to fall back from, not a newer format; one without a checksum only if all its fields
    are among ``older_fields``, those of the releases that wrote none
    (``document_checksum_problem``). CheckpointCorruptedError naming ``where``, telling to
    restore from an earlier ``earlier`` (e.g. "checkpoint")."""
    signature = document.pop(SIGNATURE, None)
    if key is not None:
        check_signature(encode(document), signature, key, where)
    damage = document_checksum_problem(document, encode, older_fields)
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


class MemoryBudget:
    """The bytes of checked copies that ``VerifiedReads`` may hold in memory at once:
    a copy takes its size before its file is read and gives it back when it is dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        """The bytes taken and not given back."""
        return self._used

    def take(self, n: int) -> bool:
        """Take ``n`` bytes if that stays within the limit; whether it did."""
        with self._lock:
            if self._used + n > self.limit:
                return False
            self._used += n
            return True

    def give_back(self, n: int) -> None:
        with self._lock:
            self._used -= n


IN_MEMORY = MemoryBudget(IN_MEMORY_BYTES)
"""The budget all ``VerifiedReads`` of this process share (by default)."""


class _MemoryCopy:
    """A checked file's content, in memory; ``close`` (or its collection) gives its bytes
    back to the budget (a read still running keeps the bytes until it returns)."""

    def __init__(self, data: bytes, budget: MemoryBudget, taken: int) -> None:
        self._data = data
        self._budget = budget
        self._taken = taken

    def read(self, start: int, length: int | None) -> bytes:
        return self._data[start:] if length is None else self._data[start : start + length]

    def close(self) -> None:
        taken, self._taken = self._taken, 0
        self._budget.give_back(taken)

    def __del__(self) -> None:  # reads never closed (the statebackend command's)
        self.close()


class _FileCopy:
    """A checked file's content, in a local temporary file that ``close`` removes."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self._lock = threading.Lock()  # a read is a seek and a read

    def read(self, start: int, length: int | None) -> bytes:
        with self._lock:
            self._file.seek(start)
            return self._file.read(-1 if length is None else length)

    def close(self) -> None:
        with self._lock:
            self._file.close()


_Copy = _MemoryCopy | _FileCopy


class VerifiedReads(CheckpointFileSystem):
    """The file system of a signed checkpoint whose reads of the checkpoint's files
    return only bytes that match their signed SHA-256 (see the module docstring).

    ``files`` are the checkpoint's files, relative to ``directory``. Other paths are read
    as they are. Each file is read once, whole, and checked; its checked copy serves its
    reads until ``close`` drops it. A file of at most ``SMALL_FILE_BYTES`` is read with one
    request into memory while ``memory`` (by default the process's ``IN_MEMORY``) has room
    for it; any other into a local temporary file. Raises CheckpointCorruptedError naming
    the file when it is missing or does not match.
    """

    def __init__(
        self,
        fs: CheckpointFileSystem,
        directory: str,
        files: Iterable[StoredFile],
        memory: MemoryBudget | None = None,
    ) -> None:
        super().__init__(fs.fsspec, fs.checksum_algorithm, fs._retry)
        self._expected = {resolve_path(directory, f.path): f for f in files}
        self._memory = IN_MEMORY if memory is None else memory
        self._copies: dict[str, _Copy] = {}
        self._closed = False
        self._copies_lock = threading.Lock()  # not the byte counters' lock: reads count
        self._download_locks: dict[str, threading.Lock] = {}
        """One per file: its download runs once, other files' meanwhile."""

    def _read_copy(self, path: str, start: int, length: int | None) -> bytes | None:
        """``length`` bytes (None: all) from ``start`` of the checked copy of ``path``, or
        None if it is no file of the checkpoint. A copy made after ``close`` serves only
        the read that made it."""
        path = normalize_path(path)
        expected = self._expected.get(path)
        if expected is None:
            return None
        with self._copies_lock:
            copy = self._copies.get(path)
            if copy is None:
                download_lock = self._download_locks.setdefault(path, threading.Lock())
        if copy is not None:
            return copy.read(start, length)
        kept = True
        with download_lock:
            with self._copies_lock:
                copy = self._copies.get(path)
            if copy is None:
                copy = self._download(path, expected)
                with self._copies_lock:
                    kept = not self._closed
                    if kept:
                        self._copies[path] = copy
        try:
            return copy.read(start, length)
        finally:
            if not kept:
                copy.close()

    def _download(self, path: str, expected: StoredFile) -> _Copy:
        if 0 < expected.size <= SMALL_FILE_BYTES and self._memory.take(expected.size):
            try:
                data = self._read_whole(path, expected.size)
            except BaseException:
                self._memory.give_back(expected.size)
                raise
            if data is not None:
                copy = _MemoryCopy(data, self._memory, expected.size)
                try:
                    _check_copy(path, len(data), checksum(data, FILE_CHECKSUM), expected)
                except BaseException:
                    copy.close()
                    raise
                return copy
            self._memory.give_back(expected.size)
        # Kept open until close(): the ranges are served from it.
        file = tempfile.TemporaryFile(prefix="statebackend-verified-")  # noqa: SIM115
        running, size = RunningChecksum(FILE_CHECKSUM), 0
        try:
            with super().open_read(path) as stream:
                while size <= expected.size and (chunk := stream.read(_SPOOL_CHUNK)):
                    file.write(chunk)
                    running.update(chunk)
                    size += len(chunk)
            _check_copy(path, size, running.value(), expected)
        except BaseException:
            file.close()
            raise
        return _FileCopy(file)

    def _read_whole(self, path: str, size: int) -> bytes | None:
        """The content of ``path`` (a file of ``size`` bytes, if it is unchanged), one byte
        past ``size`` at most, with one request; None if that read failed other than
        transiently (those errors were retried and are raised): the streaming download
        then says what is wrong, as for any file (S3 refuses a range of an empty object)."""
        try:
            data = self._retrying(
                "read", path, lambda: bytes(self._fs.cat_file(path, start=0, end=size + 1))
            )
        except CheckpointError as exc:
            if is_transient(exc):
                raise
            return None
        self._count_read(len(data))
        return data

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``path`` from ``start``, from the checked copy."""
        if start < 0 or length < 0:
            raise ValueError(f"invalid range start={start} length={length} of {path}")
        data = self._read_copy(path, start, length)
        if data is None:
            return super().read_range(path, start, length)
        if len(data) != length:
            raise CheckpointCorruptedError(
                f"{path} is truncated: read {len(data)} of {length} bytes at offset {start}"
            )
        return data

    def read_file(self, path: str) -> bytes:
        """The whole content of ``path``, from the checked copy."""
        data = self._read_copy(path, 0, None)
        return super().read_file(path) if data is None else data

    def close(self) -> None:
        """Drop the checked copies (temporary files are removed, memory given back); a
        download still running then serves only its own read."""
        with self._copies_lock:
            copies, self._copies, self._closed = self._copies, {}, True
        for copy in copies.values():
            copy.close()

    def __enter__(self) -> VerifiedReads:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_copy(path: str, size: int, digest: str, expected: StoredFile) -> None:
    """CheckpointCorruptedError naming ``path`` unless the ``size`` and SHA-256 ``digest``
    of its copy are the signed ones (a copy longer than signed may have been cut short
    past the signed size: the file is at least that long)."""
    if size > expected.size:
        raise CheckpointCorruptedError(
            f"{path} does not match the signed checkpoint (it has more than its signed "
            f"{expected.size} bytes): it was changed after the checkpoint was written; do "
            f"not restore it"
        )
    if size != expected.size or digest != expected.checksum:
        raise CheckpointCorruptedError(
            f"{path} does not match the signed checkpoint (size {size}, "
            f"{digest}; signed: size {expected.size}, {expected.checksum}): "
            f"it was changed after the checkpoint was written; do not restore it"
        )


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
