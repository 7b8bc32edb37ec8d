"""CheckpointStorage: a job's checkpoints and savepoints in one fsspec directory."""

from __future__ import annotations

import json
import logging
import posixpath
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from statebackend.checkpoint.filesystem import (
    CheckpointFileSystem,
    normalize_url,
    open_filesystem,
)
from statebackend.checkpoint.layout import (
    METADATA_FILE,
    SHARED_DIR,
    JobLayout,
    checkpoint_ids,
    epoch_of,
    join,
    metadata_path,
    parse_ack_name,
)
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck, ack_problem
from statebackend.checkpoint.signing import FILE_CHECKSUM, SigningKey
from statebackend.checksums import CRC32
from statebackend.errors import (
    MALFORMED_DOCUMENT,
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointUnreadableError,
    ConfigurationError,
)
from statebackend.snapshot.handles import resolve_path
from statebackend.snapshot.incremental import SharedLocation
from statebackend.snapshot.target import AbortSignal, SnapshotDirectory

DEFAULT_TRANSFER_THREADS = 4
_log = logging.getLogger(__name__)
_HELD_FILES_CACHED = 4
_MAX_ID_DIGITS = 19
"""The most digits a checkpoint id has (a signed 64-bit integer's)."""


def snapshot_name(
    operator_id: str, subtask: int, run: str | None, attempt: str | None, checkpoint_id: int
) -> str:
    """The prefix of the names of the files one subtask's task attempt writes for
    checkpoint N (``<operator>-<subtask>[-<run>][-<attempt>]-c<N>``). N is part of it: the
    shared files the same subtask, run and attempt uploaded for earlier checkpoints (which
    later snapshots reuse) must not look like this snapshot's own (``written_by``); without
    a task attempt (``attempt=None``) they did."""
    parts = [operator_id, str(subtask), *(part for part in (run, attempt) if part)]
    return "-".join([*parts, f"c{checkpoint_id}"])


def written_by(ack: SubtaskAck, path: str, checkpoint_id: int) -> bool:
    """Whether ``ack``'s own snapshot of checkpoint N wrote the file at ``path`` (its name
    starts with the snapshot's name), not an earlier snapshot whose shared file it reuses."""
    own = snapshot_name(ack.operator_id, ack.subtask, ack.run, ack.attempt, checkpoint_id) + "-"
    return posixpath.basename(path).startswith(own)


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
        self._held_files: dict[int, frozenset[str]] = {}
        """``completed_files`` of the newest completed checkpoints asked for: a
        ``_metadata`` never changes, and every incremental snapshot of this process asks
        for the previous checkpoint's. Without a lock (the storage is pickled): threads
        that ask at once read it once each."""

    @property
    def transfer_threads(self) -> int:
        """How many transfers to or from the storage run at once."""
        return self._transfer_threads

    @property
    def executor(self) -> Executor:
        """The transfer thread pool (started on first use)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self._transfer_threads, thread_name_prefix="statebackend-transfer"
            )
        return self._executor

    def close(self, wait: bool = True) -> None:
        """Stop the thread pool: its transfers already started or queued still run to
        the end; ``wait`` waits for them, else its threads end after them on their own.
        A later transfer starts a new pool."""
        if self._executor is not None:
            self._executor.shutdown(wait=wait)
            self._executor = None

    # -- writing a checkpoint -------------------------------------------------------------

    def snapshot_target(
        self,
        checkpoint_id: int,
        operator_id: str,
        subtask: int,
        run: str | None = None,
        attempt: str | None = None,
    ) -> SnapshotDirectory:
        """Where subtask ``subtask`` of ``operator_id`` (in coordinator run ``run``, task
        attempt ``attempt``, both named in its files' names) writes its part of
        checkpoint N. In a run (a coordinator triggered N), its uploads stop, and delete
        what they wrote, once N is aborted."""
        return SnapshotDirectory(
            self.fs,
            self.layout.checkpoint_path(checkpoint_id),
            snapshot_name(operator_id, subtask, run, attempt, checkpoint_id),
            self.executor,
            self.compression,
            self.shared_location() if self.incremental else None,
            self._transfer_threads,
            None if run is None else self.abort_signal(checkpoint_id),
        )

    def abort_signal(self, checkpoint_id: int) -> AbortSignal:
        """Tells an upload of checkpoint N that N was aborted (its pending marker is gone)."""
        return AbortSignal(lambda: self.is_pending(checkpoint_id))

    def shared_location(self) -> SharedLocation:
        """The job's ``shared/`` directory, for incremental snapshots."""
        return SharedLocation(self.layout.shared_dir, f"../{SHARED_DIR}", self.completed_files)

    def mark_pending(self, checkpoint_id: int, run: str, epoch: int) -> None:
        """Write checkpoint N's pending marker (naming the coordinator's run and epoch):
        subtasks acknowledge N, and keep uploading for it, only while it exists."""
        document = {"checkpoint_id": checkpoint_id, "run": run, "epoch": epoch}
        self.fs.write_atomic(
            self.layout.pending_marker_path(checkpoint_id), json.dumps(document).encode()
        )

    def is_pending(self, checkpoint_id: int) -> bool:
        """Whether checkpoint N still takes acknowledgements (its pending marker exists)."""
        return self.fs.exists(self.layout.pending_marker_path(checkpoint_id))

    def write_ack(self, checkpoint_id: int, ack: SubtaskAck) -> bool:
        """Record a subtask's acknowledgement (its state handles) of checkpoint N, in one
        file per task attempt, written atomically.

        Writes nothing and returns False if N is no longer pending (aborted, or completed
        and cleaned up), so that a late ack does not recreate its directory; the files its
        snapshot wrote itself (named after it: ``snapshot_name``), which nothing can
        reference now, are deleted then (the shared files it reuses are not its own).
        """
        if not self.is_pending(checkpoint_id):
            self._discard_own_files(checkpoint_id, ack)
            return False
        path = self.layout.ack_path(checkpoint_id, ack.operator_id, ack.subtask, ack.attempt)
        self.fs.write_atomic(path, json.dumps(ack.to_json()).encode("utf-8"))
        return True

    def _discard_own_files(self, checkpoint_id: int, ack: SubtaskAck) -> None:
        directory = self.layout.checkpoint_path(checkpoint_id)
        for stored in ack.files():
            path = resolve_path(directory, stored.path)
            if written_by(ack, path, checkpoint_id):
                try:
                    self.fs.delete(path)
                except CheckpointError:  # left to statebackend gc
                    _log.warning("could not delete %s of a late ack", path, exc_info=True)

    def read_acks(self, checkpoint_id: int) -> list[SubtaskAck]:
        """Every well-formed acknowledgement of checkpoint N so far (of every run and task
        attempt), in the order of their file names. A malformed one (not an ack, or naming
        a file outside the checkpoint) is left out with a warning: it never becomes part
        of a checkpoint, and none of the files it names is deleted."""
        directory = self.layout.acks_dir(checkpoint_id)
        acks = []
        for name in self.fs.list_dir(directory):
            if parse_ack_name(name) is None:
                continue
            path = join(directory, name)
            data = self.fs.read_file(path)
            try:
                ack = SubtaskAck.from_json(json.loads(data))
                problem = ack_problem(ack)
            except MALFORMED_DOCUMENT as exc:
                problem = f"it is no acknowledgement ({type(exc).__name__}: {exc})"
            if problem is None:
                acks.append(ack)
            else:
                _log.warning("ignoring %s: %s", path, problem)
        return acks

    def complete(self, metadata: CheckpointMetadata) -> str:
        """Make checkpoint N complete by writing its ``_metadata`` last, atomically.

        Raises CheckpointError, writing nothing, if N already has a ``_metadata``: it is
        never overwritten. Returns the checkpoint's directory. The pending marker and
        the acks stay until ``end_pending`` and ``delete_acks``.
        """
        directory = self.layout.checkpoint_path(metadata.checkpoint_id)
        path = metadata_path(directory)
        if self.fs.exists(path):
            raise CheckpointError(
                f"{path} exists already: checkpoint {metadata.checkpoint_id} was completed "
                "by another coordinator; check that only one driver runs the job"
            )
        self.fs.write_atomic(path, metadata.to_bytes(self.signing_key))
        return directory

    def end_pending(self, checkpoint_id: int) -> None:
        """Remove checkpoint N's pending marker: its running uploads stop and delete what
        they wrote, and no acknowledgement of N is written any more."""
        self.fs.delete(self.layout.pending_marker_path(checkpoint_id))

    def delete_acks(self, checkpoint_id: int) -> None:
        """Remove checkpoint N's acknowledgements (once ``_metadata`` holds what they said)."""
        self.fs.delete(self.layout.acks_dir(checkpoint_id), recursive=True)

    def discard(self, checkpoint_id: int) -> None:
        """Delete checkpoint N and every file in its directory; its pending marker first,
        so that its running uploads stop, then its ``_metadata`` (CheckpointError if that
        fails), so that a discard cut short never leaves a completed checkpoint without
        its files (the rest left behind is not a checkpoint; ``statebackend gc`` removes
        it)."""
        self.end_pending(checkpoint_id)
        self.fs.delete(self.layout.metadata_path(checkpoint_id))
        self.fs.delete(self.layout.checkpoint_path(checkpoint_id), recursive=True)

    # -- checkpoint ids and leader epochs ------------------------------------------------------

    def checkpoint_id_mark(self) -> int:
        """The highest checkpoint id ever triggered in the job directory (0 if none)."""
        path = self.layout.checkpoint_id_path
        if not self.fs.exists(path):
            return 0
        text = self.fs.read_file(path)
        if not text.strip().isdigit() or len(text.strip()) > _MAX_ID_DIGITS:
            raise CheckpointCorruptedError(
                f"{path} holds {text[:40]!r}, not a checkpoint id (cut short by a crash?): "
                f"write into it an id above every chk-<N> the job ever had, e.g. the highest "
                f"in {self.layout.job_dir} plus 100"
            )
        return int(text)

    def set_checkpoint_id_mark(self, checkpoint_id: int) -> None:
        """Record that checkpoint ``checkpoint_id`` was triggered."""
        self.fs.write_atomic(self.layout.checkpoint_id_path, str(checkpoint_id).encode())

    def check_job_id_case(self) -> None:
        """ConfigurationError if the checkpoint directory holds a job whose id differs
        from this job's only in case, and none of this id (for a driver starting the job):
        on a case-insensitive file system (macOS, Windows shares) both ids name one
        directory, where this job would fence the other's driver and discard its
        checkpoints. Two such jobs that both exist (on S3, say) go on."""
        names = self.fs.list_dir(self.layout.checkpoint_dir)
        if self.job_id in names:
            return
        for name in names:
            if name.casefold() == self.job_id.casefold():
                raise ConfigurationError(
                    f"job id {self.job_id!r} differs only in case from the job {name!r} in "
                    f"{self.layout.checkpoint_dir}, and a case-insensitive file system "
                    f"(macOS, Windows) takes both for one directory: to run that job give "
                    f"its id {name!r}, for a new one an id that differs in more than case"
                )

    def leader_epochs(self) -> list[int]:
        """The leader epochs claimed in the job directory, ascending."""
        names = self.fs.list_dir(self.layout.leader_dir)
        return sorted(e for e in map(epoch_of, names) if e is not None)

    def read_leader(self, epoch: int) -> dict[str, Any]:
        """The claim of leader epoch E: ``{"epoch", "run", "claimed_at"}``;
        CheckpointCorruptedError naming it if it is no such document."""
        path = self.layout.leader_path(epoch)
        data = self.fs.read_file(path)
        try:
            claim = json.loads(data)
            if not isinstance(claim, dict):
                raise TypeError(f"{type(claim).__name__}, not an object")
        except MALFORMED_DOCUMENT as exc:
            raise CheckpointCorruptedError(
                f"{path} is no leader claim ({type(exc).__name__}: {exc}): if no other "
                f"driver runs job {self.job_id}, delete it"
            ) from exc
        return claim

    def write_leader(self, epoch: int, run: str, claimed_at: float) -> None:
        """Claim leader epoch E for coordinator run ``run``."""
        document = {"epoch": epoch, "run": run, "claimed_at": claimed_at}
        self.fs.write_atomic(self.layout.leader_path(epoch), json.dumps(document).encode())

    def delete_leader(self, epoch: int) -> None:
        """Remove the claim of a superseded leader epoch."""
        self.fs.delete(self.layout.leader_path(epoch))

    # -- reading ---------------------------------------------------------------------------

    def checkpoint_ids(self) -> list[int]:
        """Ids of every checkpoint directory of the job (complete or not), ascending."""
        return checkpoint_ids(self.fs.list_dir(self.layout.job_dir))

    def is_completed(self, checkpoint_id: int) -> bool:
        """Whether checkpoint N is complete (has ``_metadata``)."""
        return self.fs.exists(self.layout.metadata_path(checkpoint_id))

    def completed_files(self, checkpoint_id: int) -> frozenset[str] | None:
        """The paths (relative to its directory) of the files completed checkpoint N's
        ``_metadata`` references; None if N is not complete, no files if its
        ``_metadata`` cannot be read (nothing of it may be reused). Read once per
        instance for the newest few checkpoints."""
        held = self._held_files.get(checkpoint_id)
        if held is not None:
            return held
        try:
            metadata = self.load(checkpoint_id)
        except CheckpointNotFoundError:
            return None
        except CheckpointError:
            return frozenset()
        held = frozenset(f.path for f in metadata.files())
        self._held_files[checkpoint_id] = held
        for older in sorted(self._held_files)[:-_HELD_FILES_CACHED]:
            self._held_files.pop(older, None)
        return held

    def completed_checkpoint_ids(self) -> list[int]:
        """Ids of the completed checkpoints (those with ``_metadata``), ascending."""
        return [n for n in self.checkpoint_ids() if self.is_completed(n)]

    def latest_completed(self) -> str | None:
        """The directory of the newest completed checkpoint, or None. Looks at the
        newest checkpoints first, down to the first completed one."""
        for checkpoint_id in reversed(self.checkpoint_ids()):
            if self.is_completed(checkpoint_id):
                return self.layout.checkpoint_path(checkpoint_id)
        return None

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
        checkpoint, or not a checkpoint at all), CheckpointUnreadableError if it cannot be
        read.
        """
        return load_metadata(self.fs, self.resolve(path_or_id), self.signing_key)


def load_metadata(
    fs: CheckpointFileSystem, directory: str, signing_key: SigningKey | None = None
) -> CheckpointMetadata:
    """The ``_metadata`` of the checkpoint or savepoint in ``directory``, checked (and
    with ``signing_key``, its signature checked: ``CheckpointMetadata.from_bytes``).
    CheckpointNotFoundError if there is none, CheckpointUnreadableError if it cannot be
    read (after the file system's retries)."""
    path = metadata_path(directory)
    if not fs.exists(path):
        raise _no_metadata(directory)
    try:
        data = fs.read_file(path)
    except CheckpointError as exc:
        raise _unreadable(path, exc) from exc
    return CheckpointMetadata.from_bytes(data, path, signing_key)


def load_metadata_files(
    fs: CheckpointFileSystem, directories: list[str], signing_key: SigningKey | None = None
) -> list[CheckpointMetadata | CheckpointError]:
    """``load_metadata`` of each of ``directories``, the ``_metadata`` files read several
    at once (``CheckpointFileSystem.read_files``) without an existence check each: per
    directory its metadata, or the error ``load_metadata`` would raise."""
    paths = [metadata_path(directory) for directory in directories]
    loaded: list[CheckpointMetadata | CheckpointError] = []
    for directory, path, data in zip(directories, paths, fs.read_files(paths), strict=True):
        if isinstance(data, CheckpointCorruptedError):  # what a read of a missing file raises
            loaded.append(_no_metadata(directory))
        elif isinstance(data, CheckpointError):
            loaded.append(_unreadable(path, data))
        else:
            try:
                loaded.append(CheckpointMetadata.from_bytes(data, path, signing_key))
            except CheckpointError as exc:
                loaded.append(exc)
    return loaded


def _no_metadata(directory: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"{directory} is not a completed checkpoint or savepoint (no {METADATA_FILE}): "
        f"give the directory of a completed one, e.g. from `statebackend list`"
    )


def _unreadable(path: str, exc: CheckpointError) -> CheckpointUnreadableError:
    # Not "not found": what an existing _metadata references must never count as
    # unreferenced (the registry, gc), nor the checkpoint as pending (list).
    return CheckpointUnreadableError(f"cannot read {path}: {exc}")
