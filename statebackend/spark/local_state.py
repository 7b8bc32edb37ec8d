"""Executor-local keyed state: one RocksDB per (job, operator, subtask), reused across
micro-batches when it is current, else rebuilt from a checkpoint.

A Python worker may or may not be reused, and subtask i may run in another worker (or
executor on the same host) next batch. So the DB directory is guarded by an exclusive
``fcntl.flock`` on a lock file next to it, and a version marker (restore generation, last
batch id, parallelism, max parallelism) says what the directory holds. The driver tells
each task what it expects:

- ``previous_batch`` set: the marker must say (generation, previous_batch); the DB is
  reopened as it is. Anything else raises StaleLocalStateError: the job then fails and
  the driver restores every subtask from the latest completed checkpoint and replays.
- ``previous_batch`` None (first batch of a generation): the directory is wiped and the
  subtask's key groups are restored from ``restore_dir`` (or start empty).

The marker is removed before the batch changes the DB and written again once the DB is
closed, so a task that dies midway never leaves a directory that looks current.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata
from statebackend.errors import StateBackendError
from statebackend.keygroups import compute_key_group_range_for_operator_index
from statebackend.serializers import Serializer


class StaleLocalStateError(StateBackendError):
    """The local copy of a subtask's state is not the version the batch needs."""


@dataclass(frozen=True)
class LocalVersion:
    """What the driver expects of a subtask's local DB at the start of a batch."""

    generation: str
    previous_batch: int | None
    restore_dir: str | None
    parallelism: int
    max_parallelism: int


class LocalKeyedState:
    """Context manager: the subtask's RocksDB backend, locked, current, ready for a batch.

    ``restored_bytes`` tells how many bytes were read from checkpoint storage (0 when the
    local copy was reused). ``commit(batch_id)`` closes the DB and records its version;
    leaving the context without it disposes of the DB (the next batch restores).
    """

    def __init__(
        self,
        root: Path,
        subtask: int,
        version: LocalVersion,
        storage: CheckpointStorage,
        operator_id: str,
        key_serializer: Serializer[Any],
    ) -> None:
        self.directory = root / f"subtask-{subtask}"
        self._marker = root / f"subtask-{subtask}.version"
        self._lock_path = root / f"subtask-{subtask}.lock"
        self._subtask = subtask
        self._version = version
        self._storage = storage
        self._operator_id = operator_id
        self._key_serializer = key_serializer
        self._lock_fd: int | None = None
        self.backend: RocksDBKeyedStateBackend | None = None
        self.restored_bytes = 0
        self.reused = False

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
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            self.backend = self._open()
            self._marker.unlink(missing_ok=True)
        except BaseException:
            self._unlock()
            raise
        return self

    def _open(self) -> RocksDBKeyedStateBackend:
        version = self._version
        key_groups = compute_key_group_range_for_operator_index(
            version.max_parallelism, version.parallelism, self._subtask
        )
        options: dict[str, Any] = {
            "max_parallelism": version.max_parallelism,
            "key_group_range": key_groups,
            "key_serializer": self._key_serializer,
        }
        if version.previous_batch is not None:
            marker = self._read_marker()
            if marker != self._expected_marker(version.previous_batch):
                raise StaleLocalStateError(
                    f"local state of subtask {self._subtask} in {self.directory} is at "
                    f"{marker}, not at batch {version.previous_batch} of generation "
                    f"{version.generation}: restoring from the latest checkpoint"
                )
            self.reused = True
            return RocksDBKeyedStateBackend(self.directory, open_existing=True, **options)
        shutil.rmtree(self.directory, ignore_errors=True)
        backend = RocksDBKeyedStateBackend(self.directory, **options)
        if version.restore_dir is not None:
            fs = self._storage.fs
            before = fs.bytes_read
            try:
                metadata = load_metadata(fs, version.restore_dir)
                restore_keyed_state(backend, fs, version.restore_dir, metadata, self._operator_id)
            except BaseException:
                backend.dispose()
                raise
            self.restored_bytes = fs.bytes_read - before
        return backend

    def commit(self, batch_id: int) -> None:
        """Close the DB, keeping it on disk, and mark it as being at ``batch_id``."""
        if self.backend is None:
            raise StateBackendError("commit outside the local state's context")
        self.backend.close()
        self.backend = None
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
