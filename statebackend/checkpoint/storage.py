"""CheckpointStorage: a job's checkpoints and savepoints in one fsspec directory."""

from __future__ import annotations

import json
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from statebackend.checkpoint.filesystem import (
    CheckpointFileSystem,
    normalize_url,
    open_filesystem,
)
from statebackend.checkpoint.layout import (
    ACKS_DIR,
    METADATA_FILE,
    SHARED_DIR,
    JobLayout,
    checkpoint_ids,
    join,
    metadata_path,
    parse_ack_name,
)
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.signing import FILE_CHECKSUM, SigningKey
from statebackend.checksums import CRC32
from statebackend.errors import CheckpointError, CheckpointNotFoundError, ConfigurationError
from statebackend.snapshot.incremental import SharedLocation
from statebackend.snapshot.target import SnapshotDirectory

DEFAULT_TRANSFER_THREADS = 4


class CheckpointStorage:
    """Reads and writes the checkpoints of job ``job_id`` under ``checkpoint_dir``.

    ``checkpoint_dir`` is any fsspec URL or local path; ``storage_options`` go to the
    file system (e.g. ``endpoint_url``, ``key``, ``secret`` for S3). Snapshots are
    written on a pool of ``transfer_threads`` threads. With ``incremental=True`` keyed
    snapshots of RocksDB backends upload their native checkpoint's files, each SST file
    once, to the job's ``shared/`` directory (``snapshot/incremental.py``); heap backends
    and the default write the full format. With a ``signing_key`` files get SHA-256
    checksums, ``_metadata`` is signed and only checkpoints it signed load
    (``signing.py``). ``checkpoint_dir`` is normalized (``normalize_url``).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        job_id: str,
        *,
        storage_options: dict[str, Any] | None = None,
        transfer_threads: int = DEFAULT_TRANSFER_THREADS,
        compression: str = "none",
        incremental: bool = False,
        filesystem: CheckpointFileSystem | None = None,
        signing_key: SigningKey | None = None,
    ) -> None:
        if transfer_threads < 1:
            raise ConfigurationError(
                f"transfer threads {transfer_threads!r} is invalid: give at least 1"
            )
        self.layout = JobLayout(normalize_url(checkpoint_dir), job_id)
        self.job_id = job_id
        self.signing_key = signing_key
        self.fs = filesystem or open_filesystem(
            checkpoint_dir,
            storage_options,
            checksum_algorithm=CRC32 if signing_key is None else FILE_CHECKSUM,
        )
        self.compression = compression
        self.incremental = incremental
        self._transfer_threads = transfer_threads
        self._executor: Executor | None = None

    @property
    def executor(self) -> Executor:
        """The transfer thread pool (started on first use)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self._transfer_threads, thread_name_prefix="statebackend-transfer"
            )
        return self._executor

    def close(self) -> None:
        """Wait for running transfers and stop the thread pool."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- writing a checkpoint -------------------------------------------------------------

    def snapshot_target(
        self, checkpoint_id: int, operator_id: str, subtask: int
    ) -> SnapshotDirectory:
        """Where subtask ``subtask`` of ``operator_id`` writes its part of checkpoint N."""
        return SnapshotDirectory(
            self.fs,
            self.layout.checkpoint_path(checkpoint_id),
            f"{operator_id}-{subtask}",
            self.executor,
            self.compression,
            self.shared_location() if self.incremental else None,
            self._transfer_threads,
        )

    def shared_location(self) -> SharedLocation:
        """The job's ``shared/`` directory, for incremental snapshots."""
        return SharedLocation(self.layout.shared_dir, f"../{SHARED_DIR}", self.is_completed)

    def write_ack(self, checkpoint_id: int, ack: SubtaskAck) -> None:
        """Record a subtask's acknowledgement (its state handles) of checkpoint N."""
        path = self.layout.ack_path(checkpoint_id, ack.operator_id, ack.subtask)
        self.fs.write_atomic(path, json.dumps(ack.to_json()).encode("utf-8"))

    def read_acks(self, checkpoint_id: int) -> dict[tuple[str, int], SubtaskAck]:
        """The acknowledgements of checkpoint N so far, by (operator id, subtask)."""
        directory = self.layout.acks_dir(checkpoint_id)
        acks = {}
        for name in self.fs.list_dir(directory):
            if parse_ack_name(name) is not None:
                data = json.loads(self.fs.read_file(join(directory, name)))
                ack = SubtaskAck.from_json(data)
                acks[(ack.operator_id, ack.subtask)] = ack
        return acks

    def complete(self, metadata: CheckpointMetadata) -> str:
        """Make checkpoint N complete by writing its ``_metadata`` last, atomically.

        The acks directory is removed afterwards: ``_metadata`` holds all it said.
        Returns the checkpoint's directory.
        """
        directory = self.layout.checkpoint_path(metadata.checkpoint_id)
        self.fs.write_atomic(metadata_path(directory), metadata.to_bytes(self.signing_key))
        self.fs.delete(join(directory, ACKS_DIR), recursive=True)
        return directory

    def discard(self, checkpoint_id: int) -> None:
        """Delete checkpoint N and every file in its directory."""
        self.fs.delete(self.layout.checkpoint_path(checkpoint_id), recursive=True)

    # -- reading ---------------------------------------------------------------------------

    def checkpoint_ids(self) -> list[int]:
        """Ids of every checkpoint directory of the job (complete or not), ascending."""
        return checkpoint_ids(self.fs.list_dir(self.layout.job_dir))

    def is_completed(self, checkpoint_id: int) -> bool:
        """Whether checkpoint N is complete (has ``_metadata``)."""
        return self.fs.exists(self.layout.metadata_path(checkpoint_id))

    def completed_checkpoint_ids(self) -> list[int]:
        """Ids of the completed checkpoints (those with ``_metadata``), ascending."""
        return [n for n in self.checkpoint_ids() if self.is_completed(n)]

    def latest_completed(self) -> str | None:
        """The directory of the newest completed checkpoint, or None."""
        completed = self.completed_checkpoint_ids()
        return self.layout.checkpoint_path(completed[-1]) if completed else None

    def resolve(self, path_or_id: str | int) -> str:
        """The directory of a checkpoint given by id, by directory, or by ``_metadata``."""
        if isinstance(path_or_id, int):
            return self.layout.checkpoint_path(path_or_id)
        path = normalize_url(path_or_id)
        if path.endswith("/" + METADATA_FILE):
            path = path[: -len(METADATA_FILE) - 1]
        return path

    def load(self, path_or_id: str | int) -> CheckpointMetadata:
        """The metadata of a completed checkpoint or savepoint.

        Raises CheckpointNotFoundError if there is no ``_metadata`` (a pending or aborted
        checkpoint, or not a checkpoint at all).
        """
        return load_metadata(self.fs, self.resolve(path_or_id), self.signing_key)


def load_metadata(
    fs: CheckpointFileSystem, directory: str, signing_key: SigningKey | None = None
) -> CheckpointMetadata:
    """The ``_metadata`` of the checkpoint or savepoint in ``directory``, checked (and
    with ``signing_key``, its signature checked: ``CheckpointMetadata.from_bytes``)."""
    path = metadata_path(directory)
    if not fs.exists(path):
        raise CheckpointNotFoundError(
            f"{directory} is not a completed checkpoint or savepoint (no {METADATA_FILE}): "
            f"give the directory of a completed one, e.g. from `statebackend list`"
        )
    try:
        data = fs.read_file(path)
    except CheckpointError as exc:
        raise CheckpointNotFoundError(f"cannot read {path}: {exc}") from exc
    return CheckpointMetadata.from_bytes(data, path, signing_key)
