"""Executor-local keyed state: one RocksDB per (job, operator, subtask), reused across
micro-batches when it is current, else rebuilt from checkpoint storage.

A Python worker may or may not be reused, and subtask i may run in another worker, or on
another executor of another host, next batch (Spark gives our tasks no locality). So the
DB directory is guarded by an exclusive ``fcntl.flock`` on a lock file next to it, and a
version marker (generation, last batch id, the task attempt that ran it, parallelism,
max parallelism: ``LocalVersion.marker``) says what the directory holds. The driver
tells each task what it expects (``LocalVersion``): the batch before this one
(``previous_batch``) and, per subtask, the attempt whose changelog record manifest
``previous_batch`` accepted (``accepted``, from ``accepted_attempts``):

- the marker says (generation, ``previous_batch``, the accepted attempt of this
  subtask): the DB is reopened as it is;
- anything else (no copy on this host, a copy behind or ahead after a failed batch, of
  another run or parallelism, or of an attempt the manifest did not accept): the
  directory is wiped and exactly the subtask's key groups are rebuilt from batch manifest
  ``restore_manifest`` (base checkpoint + changelog records, any old parallelism), or
  else restored from checkpoint ``restore_dir``, or else start empty. The other subtasks
  are not affected.

The attempt is what makes a copy trustworthy: an attempt can mark its copy at batch N
and the batch then fail elsewhere (another subtask raised, the driver died) before
manifest N is written; the batch runs again (a retry, or a restarted query of the same
binding), subtask i on another host, and manifest N accepts that attempt. Back on the
first host at batch N+1, the copy says batch N too, but holds another attempt's state:
reusing it would make every later changelog record a delta on the wrong state. Where no
manifest holds ``previous_batch`` (``accepted`` None: the state comes from a checkpoint
or from nothing) no copy is reused.

The marker is removed before the batch changes the DB (before a rebuild wipes the
directory) and written again once the DB is closed, so a task that dies midway never
leaves a directory that looks current. A task whose Python worker outlives it leaves the
close (RocksDB flushes its memtables) and the marker to the process's closer thread, which
holds the lock until both are done: the batch is already durable by its changelog record,
and the next opener of the subtask, in this worker or another, waits for the lock.

A rebuild is all or nothing: if it fails, the partly rebuilt DB is deleted and
CheckpointUnreadableError names the checkpoint or manifest, so that the driver can fall
back to an older checkpoint.

If the local directory cannot be used (not writable, disk full), the task fails with one
LocalStateError naming it, instead of a RocksDB or OS error: a probe file is written to
tell a broken directory from other failures.

A subtask that opens its RocksDB also removes the copies of subtasks beyond the current
parallelism (left by a run at a higher one) that no task holds.

With the ``heap`` backend the state lives in the Python worker's memory instead: a
process-wide table maps (root, subtask) to (marker, backend). A worker that holds the
subtask at (generation, previous_batch, accepted attempt) reuses it; any other worker
rebuilds it as above, downloading into a ``cut-restore-<i>-*`` directory of ``root`` that
it holds while it rebuilds (``local_cuts``): a rebuild removes those of dead workers.
Copies left behind in a worker that did not run the subtask's latest batch are disposed
of at its next batch.

``LocalKeyedState`` holds what both share (the marker, the rebuild, the context);
``LocalRocksDBState`` and ``LocalHeapState`` where each keeps its copy;
``local_keyed_state`` picks one by the backend's name (``LOCAL_STATES``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, TypeVar

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.local_cuts import LocalCut, sweep_cuts
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.signing import verified_reads
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import (
    CheckpointError,
    CheckpointUnreadableError,
    ConfigurationError,
    LocalStateError,
    StateBackendError,
)
from statebackend.keygroups import compute_key_group_range_for_operator_index
from statebackend.serializers import Serializer
from statebackend.tools.local_copies import (
    LocalCopy,
    acquire_lock,
    copies_under,
    release_lock,
    remove_if_idle,
)


@dataclass(frozen=True)
class LocalVersion:
    """What the driver expects of a subtask's local DB at the start of a batch."""

    generation: str
    previous_batch: int | None
    """The batch the local copy must be at to be reused (None: never reuse)."""
    restore_dir: str | None
    """The checkpoint holding the state at ``previous_batch`` (if no manifest does)."""
    parallelism: int
    max_parallelism: int
    restore_manifest: int | None = None
    """The committed batch whose manifest holds the state at ``previous_batch``; it is
    preferred to ``restore_dir``."""
    accepted: tuple[str, ...] | None = None
    """Per subtask index, the task attempt whose changelog record manifest
    ``previous_batch`` accepted (``accepted_attempts``): only a copy that attempt left is
    reused. None (no manifest holds ``previous_batch``): no copy is reused."""

    def marker(self, batch_id: int, attempt: str) -> dict[str, Any]:
        """The version marker of a copy at the end of batch ``batch_id`` that task
        attempt ``attempt`` (the one named in its changelog record) left."""
        return {
            "generation": self.generation,
            "batch": batch_id,
            "attempt": attempt,
            "parallelism": self.parallelism,
            "max_parallelism": self.max_parallelism,
        }

    def is_current(self, marker: object, subtask: int) -> bool:
        """Whether a copy of subtask ``subtask`` marked ``marker`` holds the state at
        ``previous_batch``: it was left at that batch, in this generation and at this
        parallelism, by the attempt that manifest ``previous_batch`` accepted."""
        previous, accepted = self.previous_batch, self.accepted
        if previous is None or accepted is None or not 0 <= subtask < len(accepted):
            return False
        return marker == self.marker(previous, accepted[subtask])

    def to_json(self) -> dict[str, Any]:
        """A small JSON-able dict (sent with every batch): the accepted attempts as their
        common prefix and the rest of each (``from_json`` inverts it)."""
        data = asdict(self)
        accepted = self.accepted
        if accepted is not None:
            prefix = os.path.commonprefix(list(accepted))
            data["accepted"] = [prefix, [attempt[len(prefix) :] for attempt in accepted]]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LocalVersion:
        """The inverse of ``to_json``."""
        fields = dict(data)
        packed = fields.pop("accepted", None)
        accepted = None
        if packed is not None:
            prefix, rests = packed
            accepted = tuple(prefix + rest for rest in rests)
        return cls(**fields, accepted=accepted)


def accepted_attempts(manifest: BatchManifest, operator_id: str) -> tuple[str, ...] | None:
    """The task attempt of each subtask of ``operator_id`` (by index) whose changelog
    record ``manifest`` accepted in its own batch (``LocalVersion.accepted``); None if it
    holds no records of that batch for the operator."""
    batches = manifest.operators.get(operator_id, ())
    if not batches or batches[-1].batch_id != manifest.batch_id:
        return None
    return tuple(handle.attempt for handle in batches[-1].subtasks)


_log = logging.getLogger(__name__)
_closer_pool: ThreadPoolExecutor | None = None
_closer_lock = threading.Lock()


def _closer() -> ThreadPoolExecutor:
    """This process's closer thread (``LocalKeyedState.commit(in_background=True)``):
    one, so that closes run one after another; interpreter exit waits for them."""
    global _closer_pool
    with _closer_lock:
        if _closer_pool is None:
            _closer_pool = ThreadPoolExecutor(1, thread_name_prefix="statebackend-close")
        return _closer_pool


def _forget_closer() -> None:
    """In a forked child: the parent's closer thread does not exist there."""
    global _closer_pool, _closer_lock
    _closer_pool, _closer_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_closer)


_PROBE_BYTES = 1 << 20
"""Bytes written to tell whether the local directory still takes writes."""
_Backend = TypeVar("_Backend", bound=KeyedStateBackend)
_Restored = TypeVar("_Restored")


def restore_version(
    storage: CheckpointStorage,
    version: LocalVersion,
    what: str,
    from_manifest: Callable[[ChangelogStorage, BatchManifest], _Restored],
    from_checkpoint: Callable[[CheckpointFileSystem, str, CheckpointMetadata], _Restored],
) -> _Restored | None:
    """Read the state a subtask must be at by ``version``: ``from_manifest`` of manifest
    ``restore_manifest`` if there is one, else ``from_checkpoint`` of checkpoint
    ``restore_dir`` (its files read through ``verified_reads``), else nothing (None).

    Raises CheckpointUnreadableError saying that ``what`` cannot restore from the manifest
    or checkpoint (so that the driver falls back to an older checkpoint).
    """
    manifest_batch, restore_dir = version.restore_manifest, version.restore_dir
    source = restore_dir
    try:
        if manifest_batch is not None:
            changelog = ChangelogStorage(storage)
            source = storage.layout.manifest_path(manifest_batch)
            return from_manifest(changelog, changelog.load_manifest(manifest_batch))
        if restore_dir is not None:
            metadata = storage.load(restore_dir)
            files, key = metadata.files(), storage.signing_key
            with verified_reads(storage.fs, restore_dir, files, key) as reads:
                return from_checkpoint(reads, restore_dir, metadata)
    except CheckpointError as exc:
        advice = ""
        if manifest_batch is not None:  # a query's state: no older checkpoint to fall back to
            advice = (
                f"; the state of batch {manifest_batch} is built from it: put the file back if "
                f"you have a copy, else start a new query from a readable savepoint or "
                f"completed checkpoint of the job (`statebackend list "
                f"{storage.layout.job_dir}`) with restore_from=, a new job_id and a new "
                f"checkpointLocation"
            )
        raise CheckpointUnreadableError(
            f"{what} cannot restore from {source}: {exc}{advice}"
        ) from exc
    return None


class LocalKeyedState(ABC):
    """Context manager: the subtask's backend, current, ready for a batch.

    ``reused`` tells whether the local copy was current, ``rebuilt`` whether state was
    read from checkpoint storage instead, ``restored_bytes`` how many bytes.
    ``commit(batch_id, attempt)`` keeps the state and records its version; leaving the context
    without it disposes of the backend (the next batch rebuilds). Each backend's class
    says where the copy is kept between batches (``_open``, ``_keep``).
    """

    _keeps_in_background: ClassVar[bool] = False
    """Whether ``commit(in_background=True)`` hands keeping to the closer thread."""
    _handed_over = False
    """Set once the closer thread owns the backend and the lock."""

    def __init__(
        self,
        root: Path,
        subtask: int,
        version: LocalVersion,
        storage: CheckpointStorage,
        operator_id: str,
        key_serializer: Serializer[Any],
    ) -> None:
        self._root = root
        self._subtask = subtask
        self._version = version
        self._storage = storage
        self._operator_id = operator_id
        self._key_serializer = key_serializer
        self.backend: KeyedStateBackend | None = None
        self.restored_bytes = 0
        self.reused = False
        self.rebuilt = False

    @abstractmethod
    def _open(self) -> KeyedStateBackend:
        """The backend for the batch: the local copy if it is current (``reused``), else
        a fresh one ``_rebuild`` loaded."""

    @abstractmethod
    def _keep(self, backend: KeyedStateBackend, marker: dict[str, Any]) -> None:
        """Keep ``backend``'s state for the next batch, marked with ``marker``."""

    @abstractmethod
    def _release(self) -> None:
        """Free what ``_open`` holds besides the backend; safe to call more than once."""

    def _unusable_directory(self, exc: BaseException) -> LocalStateError | None:
        """A LocalStateError if ``exc`` came from the local directory being unusable
        (None: this kind keeps nothing on disk)."""
        return None

    def _is_current(self, marker: dict[str, Any] | None) -> bool:
        """Whether this subtask's copy marked ``marker`` is the state at
        ``previous_batch`` (``LocalVersion.is_current``)."""
        return self._version.is_current(marker, self._subtask)

    def __enter__(self) -> LocalKeyedState:
        try:
            self.backend = self._open()
        except BaseException as exc:
            self._release()
            unusable = self._unusable_directory(exc)
            if unusable is not None:
                raise unusable from exc
            raise
        return self

    def _options(self) -> dict[str, Any]:
        version = self._version
        return {
            "max_parallelism": version.max_parallelism,
            "key_group_range": compute_key_group_range_for_operator_index(
                version.max_parallelism, version.parallelism, self._subtask
            ),
            "key_serializer": self._key_serializer,
        }

    def _rebuild(self, backend: _Backend) -> _Backend:
        """Load the state at ``previous_batch`` into the fresh ``backend`` from manifest
        ``restore_manifest`` or else checkpoint ``restore_dir`` (neither: it stays empty);
        return the backend."""
        if self._version.restore_manifest is None and self._version.restore_dir is None:
            return backend
        fs = self._storage.fs
        before, extra = fs.bytes_read, 0
        operator_id = self._operator_id

        def from_manifest(changelog: ChangelogStorage, manifest: BatchManifest) -> None:
            rebuild_keyed_state(backend, changelog, manifest, operator_id)

        def from_checkpoint(
            reads: CheckpointFileSystem, restore_dir: str, metadata: CheckpointMetadata
        ) -> None:
            nonlocal extra
            restore_keyed_state(backend, reads, restore_dir, metadata, operator_id)
            extra = 0 if reads is fs else reads.bytes_read

        try:
            restore_version(
                self._storage,
                self._version,
                f"subtask {self._subtask} of {operator_id}",
                from_manifest,
                from_checkpoint,
            )
        except BaseException:
            backend.dispose()
            raise
        self.rebuilt = True
        self.restored_bytes = fs.bytes_read - before + extra
        return backend

    def commit(self, batch_id: int, attempt: str, in_background: bool = False) -> None:
        """Keep the state and mark it as being at ``batch_id``, left by task attempt
        ``attempt`` (the attempt its changelog record names: a later batch reuses the copy
        only if manifest ``batch_id`` accepted that record) (RocksDB: close the DB,
        keeping it on disk; heap: keep it in this process).

        ``in_background`` (for a task whose Python worker outlives it): where keeping takes
        time (RocksDB's close flushes the memtables), this process's closer thread does it
        after the task, holding the lock until the marker is written, so that whoever
        opens the subtask next, in this process or another, waits for it. The batch is
        durable before (its changelog record); a failure there is logged and leaves no
        marker, so the next batch rebuilds."""
        backend = self.backend
        if backend is None:
            raise StateBackendError("commit outside the local state's context")
        self.backend = None
        marker = self._version.marker(batch_id, attempt)
        if in_background and self._keeps_in_background:
            self._handed_over = True
            _closer().submit(self._keep_and_release, backend, marker)
        else:
            self._keep(backend, marker)

    def _keep_and_release(self, backend: KeyedStateBackend, marker: dict[str, Any]) -> None:
        """``_keep`` on the closer thread, then release what the context held."""
        try:
            self._keep(backend, marker)
        except Exception:
            _log.exception(
                "closing the local state of subtask %s of %s failed: its next batch rebuilds it",
                self._subtask,
                self._operator_id,
            )
            with suppress(Exception):
                backend.dispose()
        finally:
            self._release()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._handed_over:  # else the closer thread releases it
            try:
                if self.backend is not None:
                    self.backend.dispose()
                    self.backend = None
            finally:
                self._release()
        unusable = None if exc is None else self._unusable_directory(exc)
        if unusable is not None:
            raise unusable from exc


class LocalRocksDBState(LocalKeyedState):
    """The subtask's RocksDB on local disk (``tools.local_copies``: ``<root>/subtask-<i>``),
    locked with ``flock`` while in use, its version in a marker file beside it."""

    _keeps_in_background = True
    _lock_fd: int | None = None

    @property
    def _copy(self) -> LocalCopy:
        return LocalCopy(self._root, self._subtask)

    @property
    def directory(self) -> Path:
        """The subtask's RocksDB directory."""
        return self._copy.directory

    @property
    def _marker(self) -> Path:
        return self._copy.marker

    def _read_marker(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self._marker.read_text()))
        except (OSError, ValueError):
            return None

    def _open(self) -> RocksDBKeyedStateBackend:
        self._lock_fd = acquire_lock(self._copy)
        # Copies of subtasks the job no longer has (left by a run at a higher
        # parallelism): nothing would ever reuse or remove them.
        for copy in copies_under(self._root):
            if copy.subtask >= self._version.parallelism:
                remove_if_idle(copy)
        options = self._options()
        if self._is_current(self._read_marker()):
            self.reused = True
            backend = RocksDBKeyedStateBackend(self.directory, open_existing=True, **options)
        else:
            self._marker.unlink(missing_ok=True)
            shutil.rmtree(self.directory, ignore_errors=True)
            backend = self._rebuild(RocksDBKeyedStateBackend(self.directory, **options))
        self._marker.unlink(missing_ok=True)
        return backend

    def _keep(self, backend: KeyedStateBackend, marker: dict[str, Any]) -> None:
        assert isinstance(backend, RocksDBKeyedStateBackend)
        backend.close()
        temporary = self._marker.with_suffix(".tmp")
        temporary.write_text(json.dumps(marker))
        temporary.replace(self._marker)

    def _release(self) -> None:
        if self._lock_fd is not None:
            release_lock(self._lock_fd)
            self._lock_fd = None

    def _unusable_directory(self, exc: BaseException) -> LocalStateError | None:
        """A LocalStateError naming the local directory if ``exc`` (an OS or RocksDB
        error) came from it being unusable: it cannot be created, or a probe file cannot
        be written into it (read-only, full). None for any other failure."""
        if not isinstance(exc, Exception) or isinstance(exc, StateBackendError):
            return None
        root = self.directory.parent
        probe = root / f".probe-{os.getpid()}-{threading.get_ident()}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            with probe.open("wb") as f:
                f.write(bytes(_PROBE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            return LocalStateError(
                f"the local state directory {root} on this executor is unusable "
                f"({error.strerror or error}): free space there, or set "
                f"spark.statebackend.local.dir to a writable directory with room; the "
                f"job's checkpoints are intact"
            )
        finally:
            with suppress(OSError):
                probe.unlink(missing_ok=True)
        return None


class LocalHeapState(LocalKeyedState):
    """The subtask's heap backend in this Python worker, kept between batches in the
    process table ``_copies``; a worker's copies of other subtasks of the same root that
    are not current (``LocalVersion.is_current`` for their own subtask index) are
    disposed of when it opens one."""

    _copies: ClassVar[dict[tuple[str, int], tuple[dict[str, Any], HeapKeyedStateBackend]]] = {}
    """This process's heap state: (root, subtask) -> (version marker, backend)."""

    def _open(self) -> HeapKeyedStateBackend:
        own = (str(self._root), self._subtask)
        reusable: HeapKeyedStateBackend | None = None
        for key in [key for key in self._copies if key[0] == own[0]]:
            marker, copy = self._copies[key]
            if key == own and self._is_current(marker):
                reusable = self._copies.pop(key)[1]
            elif key == own or not self._version.is_current(marker, key[1]):
                del self._copies[key]
                copy.dispose()
        if reusable is not None:
            self.reused = True
            return reusable
        if self._version.restore_manifest is None and self._version.restore_dir is None:
            return HeapKeyedStateBackend(**self._options())  # nothing to download
        # Downloads go into a directory this process holds, in the local directory, so
        # that a rebuild there removes those of workers killed midway.
        self._root.mkdir(parents=True, exist_ok=True)
        sweep_cuts(self._root)
        scratch = LocalCut(self._root, f"restore-{self._subtask}")
        try:
            return self._rebuild(HeapKeyedStateBackend(scratch_dir=scratch.path, **self._options()))
        finally:
            scratch.release()

    def _keep(self, backend: KeyedStateBackend, marker: dict[str, Any]) -> None:
        assert isinstance(backend, HeapKeyedStateBackend)
        self._copies[(str(self._root), self._subtask)] = (marker, backend)

    def _release(self) -> None:
        """Nothing: a heap copy holds no lock or file."""


LOCAL_STATES: dict[str, type[LocalKeyedState]] = {
    "rocksdb": LocalRocksDBState,
    "heap": LocalHeapState,
}
"""The local-state owner of each backend name (``spark.statebackend.backend``)."""


def local_keyed_state(
    root: Path,
    subtask: int,
    version: LocalVersion,
    storage: CheckpointStorage,
    operator_id: str,
    key_serializer: Serializer[Any],
    kind: str = "rocksdb",
) -> LocalKeyedState:
    """The subtask's local state under ``root`` for backend ``kind`` (``LOCAL_STATES``),
    to be entered as a context manager."""
    owner = LOCAL_STATES.get(kind)
    if owner is None:
        raise ConfigurationError(
            f"unknown state backend {kind!r}: use one of {sorted(LOCAL_STATES)}"
        )
    return owner(root, subtask, version, storage, operator_id, key_serializer)
