"""All checkpoint I/O, over fsspec: the rest of statebackend never touches fsspec itself.

Paths given to a ``CheckpointFileSystem`` are URLs of its protocol (``s3://bucket/x``,
``file:///tmp/x``) or paths inside it (``/tmp/x``, ``bucket/x``). Errors from the file
system come out as statebackend errors naming the path: a missing file is a
``CheckpointCorruptedError``, any other failure (a bucket that does not exist too) a
``CheckpointError`` with the cause chained.

Transient failures (a reset or refused connection, a timeout, a response cut short) of
idempotent operations (reads, sizes, listings, deletes, ``write_atomic``, ``copy``) are
retried here, with exponential backoff (``RetryPolicy``), on top of whatever the fsspec
implementation retries itself; whether an error is transient is a property of its type
(``is_transient``). Tools someone waits on (``FAIL_FAST_RETRY``) give up at once on a
refused connection, with the client's own retries off. A streaming ``write_file`` is not
retried: its chunks are consumed, so the snapshot (and with it the checkpoint) fails, and
the next checkpoint starts afresh.

Checksums are CRC-32 (``"crc32:<8 hex digits>"``) unless the file system was opened with
``checksum_algorithm="sha256"`` (signed checkpoints, ``signing.py``); a file is always
checked with the algorithm its recorded checksum names (``checksums.py``). A whole-file
checksum can only be checked against the whole file (``verify``, or ``checksum`` over
``read_file``); a ranged read is checked against the checksum of that range, which the
writer stores in the state handle next to the offsets (``checksum`` + ``verify_checksum``).

A checkpoint URL has one spelling (``normalize_url``): every place that takes one from a
user normalizes it before building paths, since files are written at the path as given
while handles resolve their relative paths through ``posixpath.normpath``.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

import fsspec
from fsspec.spec import AbstractBufferedFile
from fsspec.utils import get_protocol

from statebackend.checksums import CRC32, RunningChecksum, algorithm_of, checksum
from statebackend.errors import (
    CheckpointCancelledError,
    CheckpointCorruptedError,
    CheckpointError,
    ConfigurationError,
    StateBackendError,
    error_chain,
)
from statebackend.snapshot.handles import normalize_path

_READ_CHUNK = 1 << 20
_SIZE_CHECKED_READ = 64 << 20
"""Ranged reads longer than this first check the file holds them (one more request)."""
_log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Protocols whose rename is atomic, so write_atomic may write a temp file and rename it.
# On object stores a rename is a copy + delete, and a single PUT is the atomic write.
_ATOMIC_RENAME_PROTOCOLS = frozenset({"file", "local", "hdfs", "viewfs"})

# Protocols whose files are on this machine's disks, where fsync makes a write durable.
_LOCAL_PROTOCOLS = frozenset({"file", "local"})

# Options statebackend needs unless the user says otherwise, per protocol.
_DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    # Checkpoint files go into directories nobody created beforehand.
    "file": {"auto_mkdir": True},
    "local": {"auto_mkdir": True},
}

# Options that switch a client's own retries off, per protocol (see RetryPolicy): botocore
# retries a refused connection four times, with backoff, within each of our tries.
_CLIENT_RETRIES_OFF: dict[str, dict[str, Any]] = {
    "s3": {"config_kwargs": {"retries": {"total_max_attempts": 1}}},
    "s3a": {"config_kwargs": {"retries": {"total_max_attempts": 1}}},
}

# Keywords of a whole-file read, per protocol: s3fs first asks a file's size (a HEAD) to
# fetch a large one in concurrent ranges; the files read whole (``_metadata``, manifests,
# acknowledgements) are small, and one GET reads them.
_WHOLE_READ_OPTIONS: dict[str, dict[str, Any]] = {
    "s3": {"max_concurrency": 1},
    "s3a": {"max_concurrency": 1},
}

# Storage options that are text (credentials, an endpoint): given as text
# (--storage-option, spark.statebackend.storage.*), digits stay text.
_TEXT_OPTIONS = ("key", "secret", "token", "endpoint_url", "username", "password", "profile")

# Protocols whose client goes to a public cloud's endpoint unless given an endpoint_url.
_ENDPOINT_PROTOCOLS = frozenset({"s3", "s3a"})

_CHECK_ENDPOINT = (
    "check its endpoint_url (--storage-option, or a job's spark.statebackend.storage.endpoint_url)"
)
_NO_ENDPOINT = (
    "no endpoint_url is set, so the S3 client went to AWS (or AWS_ENDPOINT_URL): for other "
    "storage give --storage-option endpoint_url=URL (a job: "
    "spark.statebackend.storage.endpoint_url)"
)

_INSTALL_HINTS = {
    "s3": "pip install statebackend[s3]",
    "s3a": "pip install statebackend[s3]",
}


def verify_checksum(data: bytes, expected_checksum: str, where: str) -> None:
    """Raise CheckpointCorruptedError naming ``where`` unless ``data`` has that checksum.

    For callers that read a range of a file whose own checksum is in the state handle.
    """
    actual = checksum(data, algorithm_of(expected_checksum) or CRC32)
    _compare_checksums(actual, expected_checksum, where)


def _compare_checksums(actual: str, expected: str, where: str) -> None:
    if actual != expected:
        raise CheckpointCorruptedError(
            f"{where}: checksum mismatch ({actual} != expected {expected}); the file is corrupted"
        )


_CLIENT_TRANSIENT_ERRORS = {
    "asyncio": ("TimeoutError",),  # not a TimeoutError before Python 3.11
    # refused, closed, endpoint unreachable; read timeouts, connections closed midway
    "botocore.exceptions": ("ConnectionError", "HTTPClientError", "IncompleteReadError"),
    "aiohttp": ("ClientConnectionError", "ClientPayloadError"),
}
"""Per module of a client fsspec uses, its transient error types."""


def _transient_error_types() -> tuple[type[BaseException], ...]:
    """Connection failures, timeouts and short responses of the clients fsspec uses, of
    those already imported: an error of a client never imported cannot have been raised,
    and importing them all (aiohttp alone takes ~0.15 s) would slow the start of every
    Python worker that only writes to a local file system."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module_name, names in _CLIENT_TRANSIENT_ERRORS.items():
        module = sys.modules.get(module_name)
        # A module another thread is still importing may not define its errors yet.
        found = [getattr(module, name, None) for name in names] if module else []
        types += [error for error in found if isinstance(error, type)]
    return tuple(types)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is a transient I/O failure
    (a reset or refused connection, a timeout, a response cut short) worth retrying."""
    transient = _transient_error_types()
    return any(isinstance(error, transient) for error in error_chain(exc))


def is_refused(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is a refused connection: nothing
    listened at the storage endpoint's address."""
    return any(isinstance(error, ConnectionRefusedError) for error in error_chain(exc))


@dataclass(frozen=True)
class RetryPolicy:
    """How idempotent storage operations are retried after a transient error: up to
    ``attempts`` tries in all, waiting ``first_delay`` seconds after the first failure and
    twice as long after each further one, at most ``max_delay``.

    ``retry_refused=False`` gives up at once on a refused connection, where nothing
    listening means a wrong endpoint rather than one restarting (a person waiting at the
    ``statebackend`` command); the file system is then opened with the client's own retries
    off (``_CLIENT_RETRIES_OFF``), so that this policy alone retries the other errors.
    """

    attempts: int = 4
    first_delay: float = 0.2
    max_delay: float = 5.0
    retry_refused: bool = True

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failed try."""
        return float(min(self.first_delay * 2 ** (failures - 1), self.max_delay))

    def retries(self, exc: BaseException) -> bool:
        """Whether a try that failed with ``exc`` is worth another one."""
        return is_transient(exc) and (self.retry_refused or not is_refused(exc))


DEFAULT_RETRY = RetryPolicy()
FAIL_FAST_RETRY = RetryPolicy(retry_refused=False)
"""For tools a person waits on: a refused connection fails at once, other transient
errors are retried."""


@dataclass(frozen=True)
class WrittenFile:
    """A file ``write_file`` completed: its path, size in bytes and checksum."""

    path: str
    size: int
    checksum: str


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")
"""A URL's scheme and colon: two characters at least, so that ``C:`` is a drive."""


def absolute_location(location: str) -> str:
    """A URL (``s3://...``, ``file:///...``, also ``file:/...`` as Hadoop writes it) as it
    is; a local path made absolute from the working directory, for processes that have
    another one (Spark's executors), and ``~`` expanded to the home directory as fsspec
    does for a local path (a driver or executor may run as another user)."""
    if not location or _SCHEME.match(location):
        return location
    return os.path.abspath(os.path.expanduser(location))


def normalize_url(url: str) -> str:
    """The one spelling of a checkpoint URL or path: ``//``, ``.`` and ``..`` in its path
    resolved as ``posixpath.normpath`` does, no trailing ``/`` (``s3://b/team//ckpts/``
    becomes ``s3://b/team/ckpts``), so that files are written where handles resolve to."""
    normalized = normalize_path(url)
    scheme, sep, rest = normalized.rpartition("://")
    if rest.startswith("//"):  # normpath keeps a leading "//" (POSIX allows it a meaning)
        normalized = f"{scheme}{sep}/{rest.lstrip('/')}"
    return normalized


def storage_option_value(name: str, text: str) -> Any:
    """The value of storage option ``name`` given as text (``--storage-option KEY=VALUE``,
    ``spark.statebackend.storage.KEY``): JSON if it parses (``false``, ``5242880``,
    ``{"region_name": "eu-west-1"}``), else the text itself (a URL, a name). The options
    that are text (credentials, an endpoint) stay the text given, digits too, unless it is
    a JSON string or object."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if name in _TEXT_OPTIONS and not isinstance(value, (str, dict)):
        return text
    return value


_ONE_SLASH = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")
_FILE_HOST = re.compile(r"file://([^/]+)", re.IGNORECASE)


def _check_url(url: str) -> None:
    """ConfigurationError for a URL that fsspec would read as a local path relative to the
    working directory, which differs between a Spark driver and its executors:
    ``hdfs:/ckpt`` or ``s3:/bucket`` (one '/', as Hadoop may write a URI; ``file:/path``
    is a local absolute path to fsspec too, and fine) and ``file://tmp/x`` (host ``tmp``)."""
    one_slash = _ONE_SLASH.match(url)
    if one_slash and one_slash[1].lower() != "file":
        scheme = one_slash[1]
        raise ConfigurationError(
            f"checkpoint storage {url!r} has one '/' after '{scheme}:', which fsspec reads "
            f"as a local path relative to the working directory: write "
            f"{scheme}://<bucket or host>/<path>"
        )
    host = _FILE_HOST.match(url)
    if host:
        path = url[host.end() :]
        local = path if host[1].lower() == "localhost" else f"/{host[1]}{path}"
        raise ConfigurationError(
            f"checkpoint storage {url!r} names the host {host[1]!r}, which fsspec reads as a "
            f"local path relative to the working directory: write file://{local}"
        )


def open_filesystem(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    checksum_algorithm: str = CRC32,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> CheckpointFileSystem:
    """Open the file system of ``url`` (any fsspec protocol; a plain path is local).

    ``storage_options`` go to the fsspec implementation, e.g. for s3 ``endpoint_url``,
    ``key``, ``secret``, ``client_kwargs`` or ``default_block_size`` (the multipart part
    size); without credentials s3fs uses the usual AWS chain. Files written get checksums
    of ``checksum_algorithm``. Transient errors are retried as ``retry`` says. Raises
    ConfigurationError naming the URL if the protocol is unknown or its implementation is
    not installed.
    """
    _check_url(url)
    protocol = get_protocol(url)
    options = {**_DEFAULT_OPTIONS.get(protocol, {}), **(storage_options or {})}
    for name in _TEXT_OPTIONS:
        value = options.get(name)
        if isinstance(value, (int, float)):  # never a credential (gcsfs takes a dict token)
            raise ConfigurationError(
                f"storage option {name} of {url} is the number {value!r}, not text: give it "
                f"as a string"
            )
    if not retry.retry_refused:
        options = _with_defaults(options, _CLIENT_RETRIES_OFF.get(protocol, {}))
    try:
        fs_class = fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        hint = _INSTALL_HINTS.get(protocol, f"install the fsspec implementation for {protocol!r}")
        raise ConfigurationError(
            f"checkpoint storage {url!r} needs a package that is not installed: {hint}"
        ) from exc
    except ValueError as exc:
        raise ConfigurationError(
            f"checkpoint storage {url!r} has an unknown protocol {protocol!r}: {exc}"
        ) from exc
    return CheckpointFileSystem(fs_class(**options), checksum_algorithm, retry)


def _fsync(local_path: str) -> None:
    """Flush the local file or directory ``local_path`` to disk."""
    fd = os.open(local_path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bucket_missing(exc: BaseException) -> bool:
    """Whether ``exc`` came from an object store saying the bucket does not exist (s3fs
    raises FileNotFoundError from botocore's NoSuchBucket, for a read or listing as well
    as a write: a missing file inside a bucket has no such cause)."""
    return any(type(error).__name__ == "NoSuchBucket" for error in error_chain(exc))


def _endpoint_given(options: dict[str, Any]) -> bool:
    """Whether a file system's ``options`` name an ``endpoint_url`` (s3fs takes it also
    inside ``client_kwargs``)."""
    client_kwargs = options.get("client_kwargs")
    inner = client_kwargs.get("endpoint_url") if isinstance(client_kwargs, dict) else None
    return bool(options.get("endpoint_url") or inner)


def _with_defaults(options: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``defaults`` filled in, also inside options that are dicts
    (``config_kwargs``): what the user gave wins. The defaults are copied: a client may
    change the options it is given (s3fs adds to ``retries``)."""
    merged = {**copy.deepcopy(defaults), **options}
    for name, default in defaults.items():
        given = options.get(name)
        if isinstance(default, dict) and isinstance(given, dict):
            merged[name] = _with_defaults(given, default)
    return merged


@contextmanager
def _io_errors(action: str, path: str, no_endpoint: bool = False) -> Iterator[None]:
    """Turn file system errors into statebackend errors naming ``path``; ``no_endpoint``:
    the storage's client was given no endpoint_url, which a failing connection then says."""
    try:
        yield
    except StateBackendError:
        raise
    except FileNotFoundError as exc:
        bucket_missing = _bucket_missing(exc)
        if action == "write" or bucket_missing:
            what = "bucket" if bucket_missing else "bucket or directory"
            raise CheckpointError(
                f"could not {action} {path}: its {what} does not exist ({exc}): create it "
                f"or correct the location"
            ) from exc
        raise CheckpointCorruptedError(f"{path} is missing (could not {action} it)") from exc
    except TypeError as exc:
        if "unexpected keyword argument" not in str(exc):
            raise CheckpointError(f"could not {action} {path}: {exc}") from exc
        # fsspec passes the storage options on as keywords, to the client it creates.
        raise ConfigurationError(
            f"a storage option is not one the file system of {path} takes ({exc}): check "
            f"the names given by --storage-option or spark.statebackend.storage.*"
        ) from exc
    except Exception as exc:
        if type(exc).__name__ == "NoCredentialsError":  # botocore's, for s3://
            raise ConfigurationError(
                f"could not {action} {path}: {exc}: give credentials with --storage-option "
                f"key=... --storage-option secret=... (a job: spark.statebackend.storage.key "
                f"and .secret), or the AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY variables"
            ) from exc
        endpoint = _NO_ENDPOINT if no_endpoint else _CHECK_ENDPOINT
        if is_refused(exc):
            raise CheckpointError(
                f"could not {action} {path}: nothing listens at the storage endpoint ({exc}): "
                f"{endpoint}"
            ) from exc
        if no_endpoint and is_transient(exc):
            raise CheckpointError(f"could not {action} {path}: {exc}: {endpoint}") from exc
        raise CheckpointError(f"could not {action} {path}: {exc}") from exc


class CheckpointFileSystem:
    """The file operations checkpoints need, on one fsspec file system.

    Transient errors of idempotent operations are retried as ``retry`` says.
    Thread-safe as far as the fsspec implementation is (local, s3fs and memory are).
    ``bytes_read`` and ``bytes_written`` count the bytes this object moved between this
    process and storage; server-side copies (``copy`` on object stores) count nothing.
    Pickling gives a new object on the same storage with its counters at zero.
    Files written get checksums of ``checksum_algorithm`` (``checksums.py``).
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        checksum_algorithm: str = CRC32,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        RunningChecksum(checksum_algorithm)  # raises on an unknown algorithm
        self._fs = fs
        self.checksum_algorithm = checksum_algorithm
        self._retry = retry
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        self._atomic_rename = bool(protocols & _ATOMIC_RENAME_PROTOCOLS)
        self._local = bool(protocols & _LOCAL_PROTOCOLS)
        self._whole_read = next(
            (_WHOLE_READ_OPTIONS[p] for p in sorted(protocols) if p in _WHOLE_READ_OPTIONS), {}
        )
        self._no_endpoint = bool(protocols & _ENDPOINT_PROTOCOLS) and not _endpoint_given(
            fs.storage_options
        )
        self._lock = threading.Lock()
        self._bytes_read = 0
        self._bytes_written = 0

    def __reduce__(self) -> tuple[Any, ...]:
        return (CheckpointFileSystem, (self._fs, self.checksum_algorithm, self._retry))

    @property
    def fsspec(self) -> fsspec.AbstractFileSystem:
        """The fsspec file system underneath."""
        return self._fs

    @property
    def is_local(self) -> bool:
        """Whether its files are on this machine's disks (a read has no latency to hide)."""
        return self._local

    @property
    def bytes_read(self) -> int:
        """Bytes read from storage through this object so far."""
        return self._bytes_read

    @property
    def bytes_written(self) -> int:
        """Bytes written to storage through this object so far."""
        return self._bytes_written

    def _retrying(self, action: str, path: str, operation: Callable[[], _T]) -> _T:
        """``operation()``, its errors translated as by ``_io_errors``, retried after
        transient ones as the retry policy says; the last error is raised."""
        failures = 0
        while True:
            try:
                with _io_errors(action, path, self._no_endpoint):
                    return operation()
            except CheckpointError as exc:
                failures += 1
                if failures >= self._retry.attempts or not self._retry.retries(exc):
                    raise
                delay = self._retry.delay(failures)
                _log.warning(
                    "could not %s %s (try %d of %d), retrying in %.1f s: %s",
                    action,
                    path,
                    failures,
                    self._retry.attempts,
                    delay,
                    exc,
                )
                time.sleep(delay)

    def _count_read(self, n: int) -> None:
        with self._lock:
            self._bytes_read += n

    def _count_written(self, n: int) -> None:
        with self._lock:
            self._bytes_written += n

    def write_file(
        self,
        path: str,
        chunks: Iterable[bytes],
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> WrittenFile:
        """Stream ``chunks`` into a new file at ``path`` and return its size and checksum.

        Holds at most one chunk plus the store's write buffer in memory (object stores
        upload parts of ``default_block_size`` as a multipart upload). ``should_stop`` is
        asked before each chunk and before the file is committed; if it returns True the
        write is abandoned and CheckpointCancelledError raised. Whenever the write does not
        complete, nothing is left at ``path`` (an object store's multipart upload is
        aborted) and the error is raised: CheckpointErrors as they are, anything else
        wrapped in a CheckpointError naming the path. A write that fails once
        ``should_stop`` says stop (an abort deletes the checkpoint's directory while its
        uploads may still write into it) raises CheckpointCancelledError: it was cancelled,
        not broken.
        """

        def stopped() -> bool:
            return should_stop is not None and should_stop()

        def check_stop() -> None:
            if stopped():
                raise CheckpointCancelledError(f"writing {path} was cancelled")

        def cancelled(exc: Exception) -> CheckpointCancelledError:
            return CheckpointCancelledError(f"writing {path} was cancelled: {exc}")

        size = 0
        running = RunningChecksum(self.checksum_algorithm)
        try:
            f = self._fs.open(path, "wb")
        except Exception as exc:
            # Not _io_errors: a file being written is not "missing" when its directory is.
            if stopped():
                raise cancelled(exc) from exc
            raise CheckpointError(f"could not open for writing {path}: {exc}") from exc
        try:
            for chunk in chunks:
                check_stop()
                f.write(chunk)
                self._count_written(len(chunk))
                size += len(chunk)
                running.update(chunk)
            check_stop()
            f.close()
        except BaseException as exc:
            self._abandon(f, path)
            if isinstance(exc, CheckpointCancelledError) or not isinstance(exc, Exception):
                raise
            if stopped():
                raise cancelled(exc) from exc
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"could not write {path}: {exc}") from exc
        return WrittenFile(path=path, size=size, checksum=running.value())

    def _abandon(self, f: Any, path: str) -> None:
        """Drop an unfinished write so that nothing remains at ``path``."""
        with suppress(Exception):
            if isinstance(f, AbstractBufferedFile):
                # Object stores upload on close(): abort the multipart upload instead, and
                # mark the file closed so that garbage collection does not upload it either.
                f.discard()
                f.closed = True
            else:
                f.close()
        with suppress(Exception):
            self.delete(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` so that readers see either nothing or all of it.

        Where renames are atomic (local, HDFS) this writes a temp file next to ``path`` and
        renames it over ``path`` (``_rename``); on object stores (s3, memory) it is a single
        PUT.
        """
        target = f"{path}.{uuid.uuid4().hex}.tmp" if self._atomic_rename else path

        def write() -> None:
            try:
                self._fs.pipe_file(target, data)
                if target != path:
                    self._rename(target, path)
            except BaseException:
                if target != path:
                    with suppress(Exception):
                        self._fs.rm_file(target)
                raise

        self._retrying("write", path, write)
        self._count_written(len(data))

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Write ``data`` to ``path`` unless a file is there: True if it was written, False
        if ``path`` existed. Readers see nothing or all of it.

        Of writers racing for one path exactly one gets True where the storage decides:
        on a local disk (a hard link of a complete temp file) and on S3 (a conditional
        PUT); other storages check, then write. After a retried try False can also mean
        that an earlier try of this call wrote it: read the file to know whose it is.
        """

        def create() -> bool:
            try:
                if self._local:
                    self._link_new(path, data)
                else:
                    self._fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            return True

        created = self._retrying("create", path, create)
        if created:
            self._count_written(len(data))
        return created

    def _link_new(self, path: str, data: bytes) -> None:
        """Create the local file ``path`` holding ``data`` by hard-linking a flushed temp
        file to it, which fails with FileExistsError if ``path`` exists."""
        target = self._fs._strip_protocol(path)
        temp = f"{target}.{uuid.uuid4().hex}.tmp"
        self._fs.pipe_file(temp, data)
        try:
            _fsync(temp)
            os.link(temp, target)
        finally:
            with suppress(OSError):
                os.remove(temp)
        _fsync(os.path.dirname(target))

    def _rename(self, source: str, target: str) -> None:
        """Rename ``source`` over ``target``; on a local disk with the file flushed before
        (fsync) and its directory after, so that a power loss leaves ``target`` with its old
        content or the new, never empty or missing."""
        if not self._local:
            self._fs.mv(source, target)
            return
        _fsync(self._fs._strip_protocol(source))
        self._fs.mv(source, target)
        _fsync(os.path.dirname(self._fs._strip_protocol(target)))

    def same_storage(self, other: CheckpointFileSystem) -> bool:
        """Whether ``other`` is opened on the same storage with the same options (so that
        ``copy`` reaches both): the same fsspec class and storage options."""
        return other is self or (
            type(other._fs) is type(self._fs)
            and other._fs.storage_options == self._fs.storage_options
        )

    def same_path(self, first: str, second: str) -> bool:
        """Whether ``first`` and ``second`` name the same file or directory of this file
        system, however spelled (with or without its scheme, ``//``, ``.``, a trailing
        ``/``: ``file:///ck/job`` and ``/ck/job``)."""
        strip = self._fs._strip_protocol
        return normalize_path(strip(first)) == normalize_path(strip(second))

    def is_within(self, path: str, directory: str) -> bool:
        """Whether ``path`` is ``directory`` or below it on this file system, however
        spelled (as ``same_path``)."""
        strip = self._fs._strip_protocol
        inner, outer = normalize_path(strip(path)), normalize_path(strip(directory))
        return inner == outer or inner.startswith(outer.rstrip("/") + "/")

    def read_file(self, path: str) -> bytes:
        """The whole content of the file at ``path``."""
        data = self._retrying(
            "read", path, lambda: bytes(self._fs.cat_file(path, **self._whole_read))
        )
        self._count_read(len(data))
        return data

    def read_files(self, paths: Sequence[str]) -> list[bytes | CheckpointError]:
        """The whole content of each of ``paths``, or the error reading it raised as
        ``read_file`` would (a missing file: CheckpointCorruptedError), in order. Several
        reads are in flight at once where the file system can (s3: fsspec's ``cat``); a
        file whose read failed there is read again alone, with retries."""
        found: dict[str, Any] = {}
        if len(paths) > 1:
            with suppress(Exception):  # each failed read is tried again below
                found = self._fs.cat(list(paths), on_error="return", **self._whole_read)
        results: list[bytes | CheckpointError] = []
        for path in paths:
            data = found.get(self._fs._strip_protocol(path))
            if isinstance(data, (bytes, bytearray)):
                self._count_read(len(data))
                results.append(bytes(data))
                continue
            try:
                results.append(self.read_file(path))
            except CheckpointError as exc:
                results.append(exc)
        return results

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``path`` from offset ``start`` (an HTTP range request on s3).

        Raises CheckpointCorruptedError if the file ends before ``start + length``.
        """
        if start < 0 or length < 0:
            raise ValueError(f"invalid range start={start} length={length} of {path}")
        if length == 0:
            return b""  # fsspec implementations read an empty range as the whole file
        if length > _SIZE_CHECKED_READ and start + length > (size := self.size(path)):
            # a local read allocates ``length`` first: a corrupted index must not ask for 1 PB
            raise CheckpointCorruptedError(
                f"{path} is truncated: it has {size} bytes, not {length} at offset {start}"
            )
        data = self._retrying(
            "read", path, lambda: bytes(self._fs.cat_file(path, start=start, end=start + length))
        )
        self._count_read(len(data))
        if len(data) != length:
            raise CheckpointCorruptedError(
                f"{path} is truncated: read {len(data)} of {length} bytes at offset {start}"
            )
        return data

    def open_read(self, path: str) -> io.RawIOBase:
        """A seekable binary stream of ``path`` that reads as it goes; close it after use."""
        f = self._retrying("open", path, lambda: self._fs.open(path, "rb"))
        return _CountingReader(f, path, self._count_read)

    def size(self, path: str) -> int:
        """The size in bytes of the file at ``path``."""
        self._fs.invalidate_cache(path)
        return self._retrying("get the size of", path, lambda: int(self._fs.size(path)))

    def modified(self, path: str) -> float:
        """When the file at ``path`` was last written, as a POSIX timestamp of the storage's
        clock (on s3 the ``LastModified`` of the object, in whole seconds)."""
        self._fs.invalidate_cache(path)
        with _io_errors("get the modification time of", path, self._no_endpoint):
            return float(self._fs.modified(path).timestamp())

    def exists(self, path: str) -> bool:
        """Whether a file or directory (on object stores: any key under it) is at ``path``."""
        self._fs.invalidate_cache(path)
        return self._retrying("check", path, lambda: bool(self._fs.exists(path)))

    def is_file(self, path: str) -> bool:
        """Whether a file is at ``path`` (fsspec lists a file as an entry of itself)."""
        self._fs.invalidate_cache(path)
        return self._retrying("check", path, lambda: bool(self._fs.isfile(path)))

    def list_dir(self, path: str) -> list[str]:
        """The sorted names (not paths) of the entries in directory ``path``; [] if none.

        Always asks the storage, never a listing cache, since other processes write
        checkpoints.
        """
        self._fs.invalidate_cache(path)
        try:
            entries = self._retrying("list", path, lambda: self._fs.ls(path, detail=False))
        except CheckpointCorruptedError:
            return []
        return sorted({str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries})

    def list_files(self, directory: str) -> dict[str, tuple[int, float]]:
        """Every file below ``directory``, at any depth: its path relative to
        ``directory`` -> (size in bytes, modification time as ``modified`` gives it); {} if
        there is none. One listing, never a cache (on s3: pages of 1,000 keys that carry
        the sizes and times, where ``size`` and ``modified`` are a request each)."""
        self._fs.invalidate_cache(directory)
        root = self._fs._strip_protocol(directory).rstrip("/") + "/"
        try:
            found = self._retrying("list", directory, lambda: self._fs.find(directory, detail=True))
        except CheckpointCorruptedError:
            return {}
        files = {}
        for name, info in found.items():
            if info.get("type") == "file" and name.startswith(root):
                when = info.get("LastModified", info.get("mtime"))  # s3's, a local file's
                if isinstance(when, datetime):
                    modified = when.timestamp()
                elif isinstance(when, (int, float)):
                    # as ``modified`` gives it: through a datetime, to whole microseconds
                    modified = datetime.fromtimestamp(when, tz=timezone.utc).timestamp()
                else:  # a file system whose listing has no time
                    modified = self.modified(name)
                files[name[len(root) :]] = (int(info["size"]), modified)
        return files

    def delete(self, path: str, recursive: bool = False) -> None:
        """Delete the file at ``path`` (a directory and all below it if ``recursive``).

        Deleting something that does not exist is not an error (in a bucket that does not
        exist it is). A file the storage refuses to delete raises CheckpointError. A
        recursive delete may leave files behind without saying so: object stores delete
        many keys in one request that answers refusals per key, and s3fs drops that answer;
        so deletes that must not fail silently name their files one by one.
        """

        def remove() -> None:
            if recursive:
                self._fs.rm(path, recursive=True)
            else:  # a request of its own, whose refusal raises
                self._fs.rm_file(path)

        with suppress(CheckpointCorruptedError):
            self._retrying("delete", path, remove)

    def copy(self, src: str, dst: str) -> None:
        """Copy the file ``src`` to ``dst`` on this file system.

        Object stores copy server-side; a local copy streams. Parent directories of ``dst``
        are created as needed.
        """
        self._retrying(f"copy to {dst}", src, lambda: self._fs.cp_file(src, dst))

    def verify(self, path: str, expected_size: int, expected_checksum: str) -> None:
        """Raise CheckpointCorruptedError naming ``path`` unless the file exists with that
        size and checksum. Reads the whole file, streaming; its size is the opened
        stream's (on s3 opening asks it: no request of its own)."""
        self._fs.invalidate_cache(path)
        running = RunningChecksum(algorithm_of(expected_checksum) or CRC32)
        with self.open_read(path) as f:
            actual_size = f.seek(0, io.SEEK_END)
            if actual_size != expected_size:
                raise CheckpointCorruptedError(
                    f"{path}: size {actual_size} != expected {expected_size}; "
                    "the file is truncated or corrupted"
                )
            f.seek(0)
            while chunk := f.read(_READ_CHUNK):
                running.update(chunk)
        _compare_checksums(running.value(), expected_checksum, path)


class _CountingReader(io.RawIOBase):
    """A binary stream over an fsspec file that counts the bytes it returns."""

    def __init__(self, f: Any, path: str, count: Callable[[int], None]) -> None:
        super().__init__()
        self._f = f
        self._path = path
        self._count = count

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1, /) -> bytes:
        with _io_errors("read", self._path):
            data = bytes(self._f.read(size))
        self._count(len(data))
        return data

    def readall(self) -> bytes:
        return self.read()

    def readinto(self, buffer: Any, /) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET, /) -> int:
        with _io_errors("seek in", self._path):
            return int(self._f.seek(offset, whence))

    def tell(self) -> int:
        return int(self._f.tell())

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()
