"""Executor-local keyed state: one RocksDB per (job, operator, subtask), reused across
micro-batches when it is current, else rebuilt from checkpoint storage.

A Python worker may or may not be reused, and subtask i may run in another worker, or on
another executor of another host, next batch (Spark gives our tasks no locality). So the
DB directory is guarded by an exclusive ``fcntl.flock`` on a lock file next to it, and a
version marker (generation, last batch id, parallelism, max parallelism) says what the
directory holds. The driver tells each task what it expects (``LocalVersion``):

- the marker says (generation, ``previous_batch``): the DB is reopened as it is;
- anything else (no copy on this host, a copy behind or ahead after a failed batch, of
  another run or parallelism): the directory is wiped and exactly the subtask's key groups
  are rebuilt from batch manifest ``restore_manifest`` (base checkpoint + changelog
  records, any old parallelism), or else restored from checkpoint ``restore_dir``, or
  else start empty. The other subtasks are not affected.

The marker is removed before the batch changes the DB (before a rebuild wipes the
directory) and written again once the DB is closed, so a task that dies midway never
leaves a directory that looks current. A rebuild is all or nothing: if it fails, the
partly rebuilt DB is deleted and CheckpointUnreadableError names the checkpoint or
manifest, so that the driver can fall back to an older checkpoint.

If the local directory cannot be used (not writable, disk full), the task fails with one
LocalStateError naming it, instead of a RocksDB or OS error: a probe file is written to
tell a broken directory from other failures.

With the ``heap`` backend the state lives in the Python worker's memory instead: a
process-wide table maps (root, subtask) to (marker, backend). A worker that holds the
subtask at (generation, previous_batch) reuses it; any other worker rebuilds it as above.
Copies left behind in a worker that did not run the subtask's latest batch are disposed
of at its next batch.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.signing import verified_reads
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import (
    CheckpointError,
    CheckpointUnreadableError,
    LocalStateError,
    StateBackendError,
)
from statebackend.keygroups import compute_key_group_range_for_operator_index
from statebackend.serializers import Serializer


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


_PROBE_BYTES = 1 << 20
"""Bytes written to tell whether the local directory still takes writes."""
_Backend = TypeVar("_Backend", bound=KeyedStateBackend)
_HEAP_COPIES: dict[tuple[str, int], tuple[dict[str, Any], HeapKeyedStateBackend]] = {}
"""This process's heap state: (root, subtask) -> (version marker, backend)."""


class LocalKeyedState:
    """Context manager: the subtask's backend (``rocksdb``: locked, on local disk;
    ``heap``: in this process), current, ready for a batch.

    ``reused`` tells whether the local copy was current, ``rebuilt`` whether state was
    read from checkpoint storage instead, ``restored_bytes`` how many bytes.
    ``commit(batch_id)`` closes the DB and records its version; leaving the context
    without it disposes of the DB (the next batch rebuilds).
    """

    def __init__(
        self,
        root: Path,
        subtask: int,
        version: LocalVersion,
        storage: CheckpointStorage,
        operator_id: str,
        key_serializer: Serializer[Any],
        kind: str = "rocksdb",
    ) -> None:
        self._kind = kind
        self._heap_key = (str(root), subtask)
        self.directory = root / f"subtask-{subtask}"
        self._marker = root / f"subtask-{subtask}.version"
        self._lock_path = root / f"subtask-{subtask}.lock"
        self._subtask = subtask
        self._version = version
        self._storage = storage
        self._operator_id = operator_id
        self._key_serializer = key_serializer
        self._lock_fd: int | None = None
        self.backend: KeyedStateBackend | None = None
        self.restored_bytes = 0
        self.reused = False
        self.rebuilt = False

    def _expected_marker(self, batch_id: int | None) -> dict[str, Any]:
        return {
            "generation": self._version.generation,
            "batch": batch_id,
            "parallelism": self._version.parallelism,
            "max_parallelism": self._version.max_parallelism,
        }

    def _read_marker(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self._marker.read_text()))
        except (OSError, ValueError):
            return None

    def __enter__(self) -> LocalKeyedState:
        if self._kind == "heap":
            self.backend = self._open_heap()
            return self
        try:
            self.directory.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            self.backend = self._open()
            self._marker.unlink(missing_ok=True)
        except BaseException as exc:
            self._unlock()
            unusable = self._unusable_directory(exc)
            if unusable is not None:
                raise unusable from exc
            raise
        return self

    def _unusable_directory(self, exc: BaseException) -> LocalStateError | None:
        """A LocalStateError naming the local directory if ``exc`` (an OS or RocksDB
        error) came from it being unusable: it cannot be created, or a probe file cannot
        be written into it (read-only, full). None for any other failure."""
        if self._kind == "heap" or not isinstance(exc, Exception):
            return None
        if isinstance(exc, StateBackendError):
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

    def _options(self) -> dict[str, Any]:
        version = self._version
        return {
            "max_parallelism": version.max_parallelism,
            "key_group_range": compute_key_group_range_for_operator_index(
                version.max_parallelism, version.parallelism, self._subtask
            ),
            "key_serializer": self._key_serializer,
        }

    def _open_heap(self) -> HeapKeyedStateBackend:
        version = self._version
        current = self._expected_marker(version.previous_batch)
        reusable: HeapKeyedStateBackend | None = None
        for key in [key for key in _HEAP_COPIES if key[0] == self._heap_key[0]]:
            marker, copy = _HEAP_COPIES[key]
            if key == self._heap_key and version.previous_batch is not None and marker == current:
                reusable = _HEAP_COPIES.pop(key)[1]
            elif key == self._heap_key or marker != current:
                del _HEAP_COPIES[key]
                copy.dispose()
        if reusable is not None:
            self.reused = True
            return reusable
        return self._rebuild(HeapKeyedStateBackend(**self._options()))

    def _rebuild(self, backend: _Backend) -> _Backend:
        """Load the state at ``previous_batch`` into the fresh ``backend`` from manifest
        ``restore_manifest`` or else checkpoint ``restore_dir`` (neither: it stays empty);
        return the backend."""
        manifest_batch, restore_dir = self._version.restore_manifest, self._version.restore_dir
        if manifest_batch is None and restore_dir is None:
            return backend
        fs = self._storage.fs
        before, extra = fs.bytes_read, 0
        source = restore_dir
        try:
            if manifest_batch is not None:
                changelog = ChangelogStorage(self._storage)
                source = self._storage.layout.manifest_path(manifest_batch)
                manifest = changelog.load_manifest(manifest_batch)
                rebuild_keyed_state(backend, changelog, manifest, self._operator_id)
            else:
                assert restore_dir is not None
                metadata = self._storage.load(restore_dir)
                files, key = metadata.files(), self._storage.signing_key
                with verified_reads(fs, restore_dir, files, key) as reads:
                    restore_keyed_state(backend, reads, restore_dir, metadata, self._operator_id)
                extra = 0 if reads is fs else reads.bytes_read
        except CheckpointError as exc:
            backend.dispose()
            raise CheckpointUnreadableError(
                f"subtask {self._subtask} of {self._operator_id} cannot restore from "
                f"{source}: {exc}"
            ) from exc
        except BaseException:
            backend.dispose()
            raise
        self.rebuilt = True
        self.restored_bytes = fs.bytes_read - before + extra
        return backend

    def _open(self) -> RocksDBKeyedStateBackend:
        version = self._version
        options = self._options()
        current = self._expected_marker(version.previous_batch)
        if version.previous_batch is not None and self._read_marker() == current:
            self.reused = True
            return RocksDBKeyedStateBackend(self.directory, open_existing=True, **options)
        self._marker.unlink(missing_ok=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        return self._rebuild(RocksDBKeyedStateBackend(self.directory, **options))

    def commit(self, batch_id: int) -> None:
        """Keep the state and mark it as being at ``batch_id`` (RocksDB: close the DB,
        keeping it on disk; heap: keep it in this process)."""
        backend = self.backend
        if backend is None:
            raise StateBackendError("commit outside the local state's context")
        self.backend = None
        if isinstance(backend, HeapKeyedStateBackend):
            _HEAP_COPIES[self._heap_key] = (self._expected_marker(batch_id), backend)
            return
        assert isinstance(backend, RocksDBKeyedStateBackend)
        backend.close()
        temporary = self._marker.with_suffix(".tmp")
        temporary.write_text(json.dumps(self._expected_marker(batch_id)))
        temporary.replace(self._marker)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if self.backend is not None:
                self.backend.dispose()
                self.backend = None
        finally:
            self._unlock()
        unusable = None if exc is None else self._unusable_directory(exc)
        if unusable is not None:
            raise unusable from exc
