"""StatefulJob: the driver loop of micro-batches, per-batch changelog, checkpoints, rescale.

Each micro-batch is one Spark job: ``parallelize(range(P), P)`` runs the source subtasks,
``partitionBy(P, identity)`` shuffles records to the keyed subtask of their key group, the
keyed subtasks run the user's function over their executor-local RocksDB, and ``collect()``
brings back small per-subtask results (new source offsets, counts, changelog handles).
A batch of at most ``batch.single-stage-bytes`` of input runs as one stage instead: the
driver fixes where the batch ends in each partition, and each keyed subtask reads all of
it, keeping the records of its key groups (no source stage and no shuffle, whose fixed
cost dominates a small batch); keyed subtask i reports source subtask i's new offsets, so
what a batch commits is the same either way.

Every batch N is committed by a batch manifest (``ChangelogStorage``): each keyed
subtask writes its batch's state changes as a changelog record; the driver accepts one
attempt's record per subtask (the result Spark collected: retried and speculative
attempts are absorbed, their records deleted) and writes manifest N with the source
offsets after N and ``next_batch`` in its properties. The state of batch N is then base
checkpoint + records, whatever dies afterwards: a restart with ``restore="latest"``
resumes from the newest manifest if it is newer than the newest completed checkpoint.

The driver holds the source operator state (the offsets, tiny) and writes it into each
checkpoint as operator-state snapshots of operator ``source``. Checkpoints, every
``checkpoint_every`` batches, are the changelog's materializations (``CheckpointTracker``):
triggered before their batch, cut by the keyed subtasks at its end and uploaded in the
background; once one completes, later manifests build on it and the records at or below
it are deleted. No batch waits for an upload: a checkpoint that falls due while the
previous one still uploads is taken at the first batch after that one completed (as
Flink postpones a trigger while a checkpoint is in progress). Only a run's final
checkpoint and a savepoint request wait for the one before.

A keyed subtask whose local copy is not at batch N-1 (Spark ran it on another host, or a
failed attempt left it behind or ahead), or was left by another attempt than the one
manifest N-1 accepted (the driver sends those with the batch), rebuilds exactly its key
groups from manifest N-1 while the others go on (see ``local_state``). A failed batch is
retried as the same batch from the newest manifest; there is no job-wide rollback.
Deterministic errors (a malformed input line, incompatible state, an unusable local
directory) stop the run at once instead; other failures are retried up to
``max_retries`` times in a row.

A restore point that cannot be read (its ``_metadata``, a state file or changelog record
missing, corrupted, or unreadable after the file system's retries), at the start or when
a batch fails rebuilding from it, is replaced by the previous completed checkpoint of
the run's lineage (the job's retained checkpoints with ``restore="latest"``, and those
this run completed), as Flink does: this is the only job-wide rollback (counted in the
summary). Restarting from a checkpoint older than the newest manifest deletes the
manifests, the output and the completed checkpoints of the later batches: they belong to
the history that is abandoned. Only when no older checkpoint can be read does the run
fail, leaving the checkpoints as they are.

One driver per job directory: each run's coordinator claims a new leader epoch, so a
second driver started on the same directory fences the first, whose next checkpoint
raises CheckpointFencedError and ends its run (see ``checkpoint/coordinator.py``). A
checkpoint whose ``_metadata`` was written counts as completed even if the savepoint copy
after it failed (the savepoint request is answered with the error).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from statebackend import errors
from statebackend.backends.operator import OperatorStateBackend
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import absolute_location
from statebackend.checkpoint.layout import validate_id
from statebackend.checkpoint.manifest import (
    FOLDED_FROM_PROPERTY,
    SOURCE_OFFSETS_PROPERTY,
    SOURCE_OPERATOR,
    BatchManifest,
    source_offsets,
)
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.metrics import (
    FailureMetrics,
    MetricsHistory,
    RestoreMetrics,
    combine_batches,
    with_job_seconds,
)
from statebackend.checkpoint.requests import SavepointRequest
from statebackend.checkpoint.restore import (
    check_max_parallelism,
    check_operators,
    restore_operator_state,
)
from statebackend.checkpoint.signing import verified_reads
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointUnreadableError,
    ConfigurationError,
    IncompatibleStateError,
    JobFailedError,
    StateBackendError,
)
from statebackend.keygroups import (
    check_parallelism,
    compute_default_max_parallelism,
    require_parallelism,
)
from statebackend.serializers import Serializer, StrSerializer
from statebackend.snapshot.changelog_format import ChangelogHandle
from statebackend.spark.api import KeyedFunction
from statebackend.spark.checkpoint_tracker import CheckpointTracker, TrackedCheckpoint
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.job_groups import job_group
from statebackend.spark.local_state import LocalVersion, accepted_attempts
from statebackend.spark.source import (
    LogSource,
    Offsets,
    assign_partitions,
    iter_owned,
    key_selector,
    offsets_state,
    split_offsets,
)
from statebackend.spark.streaming_restore import restore_location
from statebackend.spark.tasks import (
    KeyedPlan,
    KeyedResult,
    SourcePlan,
    StorageSpec,
    keyed_subtask,
    keyed_task,
    output_batches,
    output_directory,
    single_stage_input,
    source_task,
)

_log = logging.getLogger(__name__)

_TASK_ERROR = re.compile(r"statebackend\.errors\.(\w+): ([^\n]*)")


@dataclass
class RunSummary:
    """What one ``StatefulJob.run()`` did."""

    job_id: str
    parallelism: int
    max_parallelism: int
    restored_from: str | None
    batches: int = 0
    records: int = 0
    outputs: int = 0
    skipped: int = 0
    failures: int = 0
    """Failed batches that were retried."""
    rollbacks: int = 0
    """Job-wide rollbacks to an older checkpoint (only when a restore point cannot be read)."""
    aborted: int = 0
    """Checkpoints aborted (timed out, or an upload stalled) while the job went on."""
    fallbacks: list[str] = field(default_factory=list)
    """Unreadable restore points replaced by an older checkpoint: "<from> -> <to> (<why>)"."""
    checkpoints: list[str] = field(default_factory=list)
    savepoints: list[str] = field(default_factory=list)
    checkpoint_waits: list[float] = field(default_factory=list)
    """Seconds the driver waited for a checkpoint before going on (per checkpoint)."""
    sync_seconds: list[float] = field(default_factory=list)
    """Longest synchronous cut of a keyed subtask, per checkpoint."""
    restored_bytes: list[int] = field(default_factory=list)
    """Bytes keyed subtasks read from checkpoint storage, per batch."""
    reused_subtasks: list[int] = field(default_factory=list)
    """Keyed subtasks that reused their local state, per batch."""
    rebuilt_subtasks: list[int] = field(default_factory=list)
    """Keyed subtasks that rebuilt their state from checkpoint storage, per batch."""
    seconds: float = 0.0

    @property
    def last_checkpoint(self) -> str | None:
        """The run's final completed checkpoint."""
        return self.checkpoints[-1] if self.checkpoints else None

    def describe(self) -> str:
        """A short human-readable summary."""
        waits = self.checkpoint_waits or [0.0]
        return (
            f"job {self.job_id}: {self.batches} batches, {self.records} records, "
            f"{self.outputs} output rows, {self.skipped} skipped lines at parallelism "
            f"{self.parallelism} (max {self.max_parallelism}) in {self.seconds:.1f} s; "
            f"restored from {self.restored_from or 'nothing'}; {len(self.checkpoints)} "
            f"checkpoints (wait max {max(waits) * 1000:.0f} ms), {self.failures} failures "
            f"recovered, {self.rollbacks} rollbacks; last checkpoint {self.last_checkpoint}"
            + "".join(f"; fell back from unreadable {fallback}" for fallback in self.fallbacks)
        )


def _describe_key_by(key_by: Any) -> str:
    return key_by if isinstance(key_by, str) else getattr(key_by, "__qualname__", repr(key_by))


def task_errors(exc: BaseException) -> list[StateBackendError]:
    """The statebackend errors a Spark job failed with, rebuilt from its error text (a
    task's Python traceback crosses the JVM as text), in the order they appear."""
    found = []
    for name, message in _TASK_ERROR.findall(str(exc)):
        cls = getattr(errors, name, None)
        if isinstance(cls, type) and issubclass(cls, StateBackendError):
            error = cls.__new__(cls)  # some take other arguments: the message is all we have
            StateBackendError.__init__(error, message)
            found.append(error)
    return found


def error_line(exc: BaseException) -> str:
    """One line saying why a batch failed: the first statebackend error of its tasks, else
    the exception's first line, or the last for a Python worker's traceback (whose first
    line only says that a worker raised)."""
    ours = task_errors(exc)
    if ours:
        return " ".join(str(ours[0]).split())
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return repr(exc)
    return lines[-1] if "Traceback (most recent call last)" in str(exc) else lines[0]


def task_error(exc: BaseException) -> StateBackendError | None:
    """The first statebackend error a Spark job failed with that retrying cannot fix
    (``recoverable`` False), if any."""
    return next((e for e in task_errors(exc) if not e.recoverable), None)


def _same_directory(recorded: str, current: str) -> bool:
    """Whether the input directory a checkpoint or manifest ``recorded`` is ``current``
    (the same path, or both existing and the same directory, e.g. through a symlink)."""
    if recorded == current:
        return True
    try:
        return os.path.samefile(recorded, current)
    except (OSError, ValueError):
        return False


def _count(value: Any, what: str) -> int:
    """``value`` if it is an int >= 1 (not a bool), else ConfigurationError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{what} {value!r} is invalid: give an integer >= 1")
    return value


class StatefulJob:
    """A keyed stateful job over a partitioned log source, run as Spark micro-batches.

    ``key_by`` is a record field name or a function record -> key. ``restore`` is
    ``"latest"`` (the job's newest batch manifest or completed checkpoint, whichever is
    newer; nothing if there is neither), a checkpoint or savepoint directory, or None
    (start empty). A run that restores anything but what ``"latest"`` would resume from
    ends with a checkpoint of its own even when it finds no input, so that the next
    ``"latest"`` resumes from that state.
    ``checkpoint_every`` defaults to the conf's ``checkpoint.interval``: a checkpoint falls
    due that many batches after the last one and is taken at the first batch, from then
    on, that finds no checkpoint still uploading; ``conf`` defaults to the session's
    ``spark.statebackend.*`` settings (its SparkConf's and those ``spark.conf.set`` changed
    since), as ``transform_with_state`` reads them.
    """

    def __init__(
        self,
        spark: Any,
        job_id: str,
        source: LogSource,
        operator_id: str,
        key_by: Any,
        function: KeyedFunction,
        parallelism: int,
        batch_size: int = 1000,
        checkpoint_every: int | None = None,
        restore: str | None = "latest",
        output_dir: str | None = None,
        conf: StateBackendConf | None = None,
        key_serializer: Serializer[Any] | None = None,
    ) -> None:
        self.spark = spark
        self.job_id = validate_id(job_id, "job id")
        self.operator_id = validate_id(operator_id, "operator id")
        if self.operator_id == SOURCE_OPERATOR:
            raise ConfigurationError(f"operator id {SOURCE_OPERATOR!r} is the source's: rename")
        if not isinstance(source, LogSource):
            raise ConfigurationError(
                f"source {source!r} is a {type(source).__name__}: give a LogSource"
            )
        # Local paths made absolute here: executors read and write them from another
        # working directory.
        self.source = dataclasses.replace(source, directory=absolute_location(source.directory))
        self.key_by = key_by
        if not isinstance(function, KeyedFunction):
            raise ConfigurationError(
                f"function {function!r} is a {type(function).__name__}: give an instance of "
                f"a KeyedFunction subclass (e.g. RecordFunction)"
            )
        self.function = function
        self.parallelism = require_parallelism(parallelism)
        self.batch_size = _count(batch_size, "batch size")
        self.conf = conf or StateBackendConf.from_session(spark)
        self.checkpoint_every = (
            self.conf.checkpoint_interval
            if checkpoint_every is None
            else _count(checkpoint_every, "checkpoint_every")
        )
        self.restore = restore
        self.output_dir = None if output_dir is None else absolute_location(output_dir)
        self.key_serializer = key_serializer or StrSerializer()
        reuse = spark.sparkContext.getConf().get("spark.python.worker.reuse", "true")
        self._wait_for_uploads = reuse.lower() != "true"
        self._lineage: list[str] = []
        """Completed checkpoints the run may restore from, oldest first."""
        self._fallen_back_from: set[str] = set()
        """The checkpoints the run could not restore and fell back from."""
        self._manifest_batch: int | None = None
        """The newest committed batch (its manifest holds the state a subtask rebuilds)."""
        self._accepted: tuple[str, ...] | None = None
        """The subtask attempts manifest ``_manifest_batch`` accepted: a local copy is
        reused only if one of them left it (``LocalVersion.accepted``)."""

    # -- set-up -----------------------------------------------------------------------------

    def _initial_lineage(self, storage: CheckpointStorage, completed: list[str]) -> list[str]:
        """The checkpoints the run may restore from, oldest first; the last is the one
        asked for: with ``latest`` the job's ``completed`` checkpoints, else the given one."""
        if self.restore is None or self.restore == "none":
            return []
        if self.restore == "latest":
            return completed
        return [restore_location(storage, self.restore, "restore")]  # executors read it

    def _restart_from(self, directory: str | None) -> CheckpointMetadata | None:
        """Make ``directory`` (None: nothing) the restore point and reset the driver's
        state to it; while it cannot be read, fall back to the previous checkpoint of the
        lineage. Returns the restore point's metadata."""
        while directory is not None:
            try:
                metadata = self._storage.load(directory)
                self._check_metadata(metadata, directory)
                self._restore_point: str | None = directory
                self._reset(metadata)
                batch_id = self._next_batch - 1
                self._changelog.restart(batch_id, metadata.checkpoint_id, directory)
            except CheckpointError as exc:
                directory = self._fall_back(directory, exc)
                continue
            self._discard_later_checkpoints()
            return metadata
        self._restore_point = None
        self._reset(None)
        self._changelog.restart(None)
        self._discard_later_checkpoints()
        return None

    def _discard_later_checkpoints(self) -> None:
        """Delete the job's completed checkpoints that hold batches after the restore
        point: like the later manifests, they belong to the abandoned history, and
        ``restore="latest"`` would resume from one of them (it holds a later batch than
        this run's manifests) if the run stopped before its first checkpoint completed.
        Those the run fell back from are deleted even if their ``_metadata`` cannot be
        read (it might be readable again next run); any other such one is left to the
        fallback of a later run."""
        storage = self._storage
        for checkpoint_id in storage.completed_checkpoint_ids():
            directory = storage.layout.checkpoint_path(checkpoint_id)
            if directory not in self._fallen_back_from:
                try:
                    metadata = storage.load(directory)
                except CheckpointError:
                    continue
                if int(metadata.properties.get("next_batch", 0)) <= self._next_batch:
                    continue
            _log.warning(
                "deleting checkpoint %s: it holds batches after the restore point %s",
                directory,
                self._restore_point or "(none)",
            )
            storage.discard(checkpoint_id)

    def _newest_manifest(self, checkpoints: list[str]) -> BatchManifest | None:
        """The newest batch manifest if it is newer than the newest of the job's completed
        ``checkpoints`` (one whose ``_metadata`` cannot be read is left to the fallback of
        ``_restart_from``), else None."""
        manifest = self._changelog.latest_manifest()
        if manifest is None:
            return None
        if checkpoints:
            try:
                metadata = self._storage.load(checkpoints[-1])
            except CheckpointError:
                return None
            if int(metadata.properties.get("next_batch", 0)) > manifest.batch_id:
                return None
        return manifest

    def _restart_from_manifest(self, manifest: BatchManifest) -> None:
        """Make ``manifest`` the restore point and reset the driver's state to it."""
        where = self._changelog.layout.manifest_path(manifest.batch_id)
        self._check_state(where, manifest.properties, set(manifest.operators), manifest.job_id)
        self._check_source(where, manifest.properties)
        self._restore_point = where
        self._reset(None)
        self._source_states = self._committed_offsets(manifest.properties)
        self._next_batch = manifest.batch_id + 1
        self._manifest_batch = manifest.batch_id
        self._accepted = accepted_attempts(manifest, self.operator_id)

    def _fall_back(self, unreadable: str, exc: BaseException) -> str:
        """The checkpoint before ``unreadable`` in the lineage (the newest one if
        ``unreadable`` is a batch manifest), which forgets ``unreadable`` and anything
        newer; raises ``exc`` (JobFailedError after an earlier fallback) if there is none."""
        lineage = self._lineage
        older = lineage[: lineage.index(unreadable) if unreadable in lineage else len(lineage)]
        self._fallen_back_from.update(lineage[len(older) :])
        self._lineage = older
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        if not older:
            if not self._summary.fallbacks:
                raise exc
            raise JobFailedError(
                f"job {self.job_id}: no retained checkpoint can be restored; the last one "
                f"tried, {unreadable}, failed: {reason}. The checkpoints are left as they "
                f"are: fix access to the storage and rerun with --restore latest"
            ) from exc
        _log.warning(
            "checkpoint %s cannot be restored (%s): falling back to %s",
            unreadable,
            reason,
            older[-1],
        )
        self._summary.fallbacks.append(f"{unreadable} -> {older[-1]} ({reason})")
        if self._summary.restored_from == unreadable:
            self._summary.restored_from = older[-1]
        return older[-1]

    def _check_metadata(self, metadata: CheckpointMetadata, where: str) -> None:
        if metadata.job_id != self.job_id and not metadata.is_savepoint:
            raise ConfigurationError(
                f"{where} is a checkpoint of job {metadata.job_id!r}, not of {self.job_id!r}: "
                f"use that job id, or restore from a savepoint"
            )
        # Its own operator first: state of another job is named as such, not as extra state.
        self._check_state(where, metadata.properties, set(metadata.operators), self.job_id)
        if not metadata.is_savepoint:
            self._check_source(where, metadata.properties)
        check_operators(metadata, {SOURCE_OPERATOR, self.operator_id}, False, where)

    def _check_state(
        self, where: str, properties: dict[str, Any], operators: set[str], job_id: str
    ) -> None:
        """IncompatibleStateError unless the state at ``where`` (a checkpoint or a batch
        manifest) is this job's: its operator, keyed the same way."""
        if job_id != self.job_id or self.operator_id not in operators:
            raise IncompatibleStateError(
                f"{where} has no state of operator {self.operator_id!r} of job "
                f"{self.job_id!r} (it has {sorted(operators)} of job {job_id!r}): it belongs "
                f"to another job"
            )
        recorded = properties.get("key_by")
        if recorded is not None and recorded != _describe_key_by(self.key_by):
            raise IncompatibleStateError(
                f"{where} was keyed by {recorded!r}, but this job keys by "
                f"{_describe_key_by(self.key_by)!r}: its key groups would not match"
            )

    def _check_source(self, where: str, properties: dict[str, Any]) -> None:
        """ConfigurationError unless the checkpoint or batch manifest at ``where`` read
        the input directory this run reads: its source offsets are positions in that
        directory's files. (A savepoint may be restored over other input, e.g. a copy.)"""
        source = properties.get("source")
        if source is not None and not _same_directory(source, self.source.directory):
            raise ConfigurationError(
                f"{where} read the input directory {source}, but this run reads "
                f"{self.source.directory}: rerun with that input; to go on over other "
                f"input, take a savepoint (statebackend savepoint create) and restore it, "
                f"or start afresh (restore none, or another job id)"
            )

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Consume what is in the input, checkpoint, and return a summary.

        Ends when the source has nothing new and the final checkpoint is complete.
        Raises a StateBackendError with a clear message on bad input, an unusable
        checkpoint, or after ``max_retries`` failed recoveries; checkpoints stay intact.
        """
        started = time.perf_counter()
        self.source.check()
        if not self.source.partitions():  # a wrong directory, most likely
            _log.warning(
                "source directory %s holds no partition-<n>.jsonl files: the run has no input",
                self.source.directory,
            )
        conf = self.conf
        storage = CheckpointStorage(
            conf.require_checkpoint_dir(),
            self.job_id,
            storage_options=conf.storage_options,
            transfer_threads=conf.transfer_threads,
            compression=conf.compression,
            signing_key=conf.checkpoint_signing_key(),
        )
        try:
            storage.check_job_id_case()
            binding = storage.layout.spark_binding_path
            if storage.fs.exists(binding):  # before a restore deletes its manifests
                raise ConfigurationError(
                    f"job {self.job_id!r} in {storage.layout.checkpoint_dir} is the state of "
                    f"a streaming query ({binding}): a StatefulJob run would replace its "
                    f"batches; run with another job id"
                )
            return self._run(storage, started)
        finally:
            storage.close()

    def _run(self, storage: CheckpointStorage, started: float) -> RunSummary:
        self._storage = storage
        self._summary = RunSummary(self.job_id, self.parallelism, 0, None)
        own = [storage.layout.checkpoint_path(n) for n in storage.completed_checkpoint_ids()]
        self._lineage = self._initial_lineage(storage, own)
        self._fallen_back_from = set()
        self._run_id = uuid.uuid4().hex[:12]
        self.metrics = MetricsHistory(storage.fs, storage.layout.job_dir, self._run_id)
        """This run's metrics history: a record per batch, checkpoint, restore, failure."""
        self._changelog = ChangelogStorage(storage)
        newest_manifest = self._newest_manifest(own)
        self._latest = (
            self._changelog.layout.manifest_path(newest_manifest.batch_id)
            if newest_manifest is not None
            else (own[-1] if own else None)
        )
        """Where ``restore="latest"`` resumes the job now: its newest batch manifest or
        completed checkpoint, whichever is newer (None: neither)."""
        manifest = newest_manifest if self.restore == "latest" else None
        restored: CheckpointMetadata | BatchManifest | None = manifest
        if manifest is not None:
            self._restart_from_manifest(manifest)
        else:
            restored = self._restart_from(self._lineage[-1] if self._lineage else None)
        if restored is not None:
            max_parallelism = check_max_parallelism(restored, self.conf.max_parallelism)
        else:
            max_parallelism = self.conf.max_parallelism or compute_default_max_parallelism(
                self.parallelism
            )
        check_parallelism(self.parallelism, max_parallelism)
        self._max_parallelism = max_parallelism
        self._drop_output_from(self._next_batch)
        # Claims the job's next leader epoch: a driver still running the job is fenced.
        self._coordinator = CheckpointCoordinator(
            storage,
            max_parallelism=max_parallelism,
            retained=self.conf.retained,
            timeout_seconds=self.conf.timeout_seconds,
            run_id=self._run_id,
            pinned=self._changelog.referenced_checkpoints,
        )
        self._tracker = CheckpointTracker(
            storage,
            self._coordinator,
            self.operator_id,
            self.conf.upload_stall_seconds,
            self._completed,
        )
        self._summary.max_parallelism = max_parallelism
        self._summary.restored_from = self._restore_point
        retries = 0
        since_checkpoint = 0
        while True:
            self._discover_partitions()
            more = self._has_input()
            if not more:
                self._tracker.wait()
            request = self._tracker.savepoint_request()
            if not more and request is None and self._covered():
                break
            try:
                idle = self._tracker.idle()  # polled every batch, never waited for
                if request is not None:  # a savepoint this poll completed answered it
                    request = self._tracker.savepoint_request()
                ends = self._single_stage_ends() if more else None
                checkpoint = (
                    not more
                    or request is not None
                    or (idle and since_checkpoint + 1 >= self.checkpoint_every)
                    or self._reads_all_input(ends)  # reads the source's files: asked last
                )
                self._batch(more, checkpoint, request, ends)
                completed = self._tracker.wait() if not more else True
                if not more and not completed:
                    raise JobFailedError(
                        f"job {self.job_id}: its final checkpoint did not complete within "
                        f"{self.conf.timeout_seconds:g} s"
                    )
            except StateBackendError as exc:
                self._tracker.abort(f"the job failed: {exc}")
                raise
            except Exception as exc:
                retries = self._recover(exc, retries)
                continue
            since_checkpoint = 0 if checkpoint else since_checkpoint + 1
            if checkpoint and self._tracker.poll():
                retries = 0
        self._summary.aborted = self._tracker.aborted
        self._summary.checkpoint_waits = self._tracker.waits
        self._summary.savepoints = self._tracker.savepoints
        self._summary.seconds = time.perf_counter() - started
        return self._summary

    def _covered(self) -> bool:
        """Whether a completed checkpoint holds everything the run did so far."""
        return self._tracker.pending is None and self._covered_batch == self._next_batch - 1

    # -- state of the driver ----------------------------------------------------------------

    def _reset(self, metadata: CheckpointMetadata | None) -> None:
        """Source state and batch counter from the restore point (or fresh)."""
        p = self.parallelism
        if metadata is None or self._restore_point is None:
            shares = assign_partitions(self.source.partitions(), p)
            self._source_states = [OperatorStateBackend() for _ in range(p)]
            for backend, share in zip(self._source_states, shares, strict=True):
                offsets_state(backend).update(share)
            self._next_batch = 0
        elif FOLDED_FROM_PROPERTY in metadata.properties:
            self._source_states = self._committed_offsets(metadata.properties)
            self._next_batch = int(metadata.properties.get("next_batch", 0))
        else:
            key, where = self._storage.signing_key, self._restore_point
            with verified_reads(self._storage.fs, where, metadata.files(), key) as reads:
                self._source_states = [
                    restore_operator_state(reads, where, metadata, SOURCE_OPERATOR, i, p)
                    for i in range(p)
                ]
            self._next_batch = int(metadata.properties.get("next_batch", 0))
        self._manifest_batch = None
        # Only what "latest" resumes from covers the restored state: a run that restores
        # anything else (a savepoint, an older checkpoint) checkpoints it even without
        # input, or the next "latest" would resume from something else.
        covered = metadata is not None and self._restore_point == self._latest
        self._covered_batch: int | None = self._next_batch - 1 if covered else None

    def _drop_output_from(self, batch_id: int) -> None:
        """Delete the output of batches ``batch_id`` and later: no manifest of the history
        the run continues commits them (attempts that failed or were killed, or batches of
        a history a restore abandoned), and the batches the run writes may not reach them."""
        if self.output_dir is not None:
            for batch, directory in output_batches(self.output_dir).items():
                if batch >= batch_id:
                    shutil.rmtree(directory, ignore_errors=True)

    def _committed_offsets(self, properties: Mapping[str, Any]) -> list[OperatorStateBackend]:
        """The source subtasks' states from the offsets a batch manifest committed (or a
        savepoint folded from one carries), split anew if the parallelism changed."""
        committed = source_offsets(properties, str(self._restore_point))
        if committed is None:
            raise CheckpointCorruptedError(
                f"{self._restore_point} names no source offsets: it was not written by a "
                f"StatefulJob; restore from one of this job's checkpoints or manifests"
            )
        shares = committed
        if len(shares) != self.parallelism:
            shares = split_offsets([pair for share in shares for pair in share], self.parallelism)
        states = [OperatorStateBackend() for _ in shares]
        for backend, share in zip(states, shares, strict=True):
            offsets_state(backend).update(share)
        return states

    def _offsets(self) -> list[Offsets]:
        return [list(offsets_state(backend).get()) for backend in self._source_states]

    def _discover_partitions(self) -> None:
        offsets = self._offsets()
        owned = {partition for partition, _ in iter_owned(offsets)}
        for partition in self.source.partitions():
            if partition not in owned:
                offsets_state(self._source_states[partition % self.parallelism]).add((partition, 0))

    def _has_input(self) -> bool:
        return any(
            self.source.has_complete_line(partition, offset)
            for partition, offset in iter_owned(self._offsets())
        )

    def _recover(self, exc: Exception, retries: int) -> int:
        """After a failed batch: raise a deterministic error; fall back to an older
        checkpoint if the restore point cannot be read; else count the retry (the batch
        runs again from the newest manifest). Returns the retries in a row."""
        fatal = task_error(exc)
        unreadable = next(
            (e for e in task_errors(exc) if isinstance(e, CheckpointUnreadableError)), None
        )
        pending = self._tracker.pending
        if (
            fatal is not None
            or unreadable is not None
            or pending is None
            or pending.batch_id >= self._next_batch
        ):
            # The failed batch's own checkpoint (its cut may be partial), and any when the
            # run stops or falls back; one that cut an earlier, committed batch uploads on.
            self._tracker.abort(f"the job failed: {exc}")
        error = error_line(exc)
        if fatal is not None:
            self._failed(error, "none: a deterministic error stops the run")
            raise fatal from None
        self._summary.failures += 1
        failed = self._restore_point
        if unreadable is not None and failed is not None:
            # A subtask could not restore from it (after the file system's retries).
            self._restart_from(self._fall_back(failed, unreadable))
            self._drop_output_from(self._next_batch)
            self._summary.rollbacks += 1
            self._failed(error, f"fell back from unreadable {failed} to {self._restore_point}")
            return retries
        retries += 1
        self._failed(error, f"batch {self._next_batch} runs again (retry {retries})")
        if retries > self.conf.max_retries:
            raise JobFailedError(
                f"job {self.job_id} failed {retries} times in a row, giving up; the last "
                f"error: {error}. "
                f"Its completed checkpoints are intact: fix the cause and rerun with "
                f"--restore latest"
            ) from exc
        return retries

    def _failed(self, error: str, recovery: str) -> None:
        self.metrics.record(FailureMetrics(self._next_batch, error, recovery))

    # -- checkpoints ------------------------------------------------------------------------

    def _trigger(self, request: SavepointRequest | None) -> int:
        return self._tracker.trigger(
            {SOURCE_OPERATOR: self.parallelism, self.operator_id: self.parallelism},
            self._next_batch,
            request,
            {
                "next_batch": self._next_batch + 1,
                "key_by": _describe_key_by(self.key_by),
                "operator": self.operator_id,
                "source": self.source.directory,
            },
        )

    def _completed(self, pending: TrackedCheckpoint, metadata: CheckpointMetadata) -> None:
        """Make the completed checkpoint of ``pending`` (its ``_metadata``: ``metadata``)
        the base of the next manifests."""
        self._covered_batch = pending.batch_id
        checkpoint_dir = self._storage.layout.checkpoint_path(pending.checkpoint_id)
        self._summary.checkpoints.append(checkpoint_dir)
        self._lineage.append(checkpoint_dir)
        self._changelog.materialized(pending.checkpoint_id, pending.batch_id)
        self.metrics.record(self._tracker.metrics(pending, metadata))

    def _acknowledge_source(self, checkpoint_id: int) -> None:
        run = self._coordinator.run_id
        for subtask, backend in enumerate(self._source_states):
            target = self._storage.snapshot_target(checkpoint_id, SOURCE_OPERATOR, subtask, run)
            handle = target.write_operator_snapshot(checkpoint_id, backend.sync_cut()).result()
            self._storage.write_ack(
                checkpoint_id,
                SubtaskAck(SOURCE_OPERATOR, subtask, self.parallelism, None, handle, run),
            )

    # -- one batch --------------------------------------------------------------------------

    def _reads_all_input(self, ends: dict[int, int] | None) -> bool:
        """Whether a single-stage batch ending at ``ends`` reads all the input there is,
        after a batch of this run succeeded: it then takes the run's final checkpoint
        itself, instead of an empty batch after it. (A batch of source tasks and a shuffle
        cannot tell before it ran; a run's first batch does not trigger early, so that a
        driver failing on bad input fences nobody: it has not triggered a checkpoint.)"""
        return (
            ends is not None
            and self._summary.batches > 0
            and not any(
                self.source.has_complete_line(partition, end) for partition, end in ends.items()
            )
        )

    def _batch(
        self,
        read_source: bool,
        checkpoint: bool,
        request: SavepointRequest | None,
        ends: dict[int, int] | None,
    ) -> None:
        """Run batch ``_next_batch``: the source's next lines if ``read_source`` (in one
        stage up to ``ends``, the result of ``_single_stage_ends``, else with a
        shuffle), or none; a checkpoint (or ``request``'s savepoint) if ``checkpoint``."""
        batch_id = self._next_batch
        waits = len(self._tracker.waits)
        checkpoint_id = self._trigger(request) if checkpoint else None
        waited = sum(self._tracker.waits[waits:])
        conf, p = self.conf, self.parallelism
        plan = KeyedPlan(
            operator_id=self.operator_id,
            backend=conf.backend,
            function=self.function,
            key_serializer=self.key_serializer,
            batch_id=batch_id,
            version=LocalVersion(
                self._run_id,
                batch_id - 1 if batch_id > 0 else None,
                self._restore_point if self._manifest_batch is None else None,
                p,
                self._max_parallelism,
                self._manifest_batch,
                self._accepted if self._manifest_batch is not None else None,
            ),
            storage=StorageSpec(
                conf.require_checkpoint_dir(),
                self.job_id,
                conf.storage_options,
                conf.transfer_threads,
                conf.compression,
                conf.incremental,
                self._storage.signing_key,
                conf.rocksdb_memory,
            ),
            local_dir=conf.local_dir,
            output_dir=self.output_dir if read_source else None,
            checkpoint_id=checkpoint_id,
            wait_for_upload=self._wait_for_uploads or not read_source,
            run_id=self._coordinator.run_id,
        )
        sc = self.spark.sparkContext
        stages = "keyed"
        if read_source:
            if self.output_dir is not None:
                # Output of an attempt whose batch was not committed (a failed attempt,
                # a killed driver's), maybe at another parallelism: rewritten whole.
                shutil.rmtree(output_directory(self.output_dir, batch_id), ignore_errors=True)
            source_plan = SourcePlan(
                self.source,
                self._offsets(),
                self.batch_size,
                key_selector(self.key_by),
                self.key_serializer,
                p,
                self._max_parallelism,
                ends,
            )
            if ends is None:
                stages = "source, shuffle, keyed"
                keyed = (
                    sc.parallelize(range(p), p)
                    .mapPartitionsWithIndex(lambda index, _: source_task(source_plan, index))
                    .partitionBy(p, lambda subtask: subtask)
                    .mapPartitionsWithIndex(lambda index, items: keyed_task(plan, index, items))
                )
            else:
                stages = "source and keyed, one stage"
                keyed = sc.parallelize(range(p), p).mapPartitionsWithIndex(
                    lambda index, _: keyed_subtask(
                        plan, index, single_stage_input(source_plan, index)
                    )
                )
        else:
            keyed = sc.parallelize([], p).mapPartitionsWithIndex(
                lambda index, items: keyed_task(plan, index, items)
            )
        started = time.perf_counter()
        with job_group(sc, self.job_id, self.operator_id, stages, batch_id):
            results: list[KeyedResult] = keyed.collect()
        seconds = time.perf_counter() - started
        offsets = self._offsets()
        for result in results:
            for subtask, share in result.source_offsets.items():
                offsets[subtask] = share
        restored_from = self._restore_point  # the commit makes the new manifest the next one
        committing = time.perf_counter()
        self._commit(results, batch_id, offsets)
        committed = time.perf_counter() - committing
        self._record_batch(
            batch_id, results, seconds, waited, committed, checkpoint_id, restored_from
        )
        self._apply(results, batch_id, offsets)
        if checkpoint_id is not None:
            self._tracker.uploads_started(self._accepted)
            self._acknowledge_source(checkpoint_id)

    def _single_stage_ends(self) -> dict[int, int] | None:
        """Per partition, the byte offset where this batch ends if it runs as one stage:
        None if its input is more than ``batch.single-stage-bytes`` (it then runs as
        source tasks and a shuffle)."""
        budget = self.conf.single_stage_bytes
        if budget <= 0:
            return None
        ends: dict[int, int] = {}
        for partition, offset in iter_owned(self._offsets()):
            end = self.source.batch_end(partition, offset, self.batch_size, budget)
            if end is None:
                return None
            ends[partition] = end
            budget -= end - offset
        return ends

    def _record_batch(
        self,
        batch_id: int,
        results: list[KeyedResult],
        seconds: float,
        waited: float,
        committed: float,
        checkpoint_id: int | None,
        restored_from: str | None,
    ) -> None:
        """Record the batch's metrics (and a restore from ``restored_from``, if subtasks
        restored): the Spark
        job's time beyond its slowest keyed subtask counts as source and shuffle, the
        wait for the previous checkpoint before the batch as waiting, ``committed`` the
        manifest's commit."""
        parts = [r.metrics(batch_id) for r in results]
        metrics = combine_batches(batch_id, parts, waited, committed)
        restores = [r.restore_seconds for r in results]
        self.metrics.record(with_job_seconds(metrics, seconds, zip(parts, restores, strict=True)))
        restored = [r for r in results if r.restored_bytes]
        if restored:
            self.metrics.record(
                RestoreMetrics(
                    restored_from or "",
                    sum(r.restored_bytes for r in restored),
                    max(r.restore_seconds for r in restored),
                    len(restored),
                )
            )
        if checkpoint_id is not None:
            self._tracker.cut_taken(
                checkpoint_id,
                max((r.sync_seconds for r in results), default=0.0),
                {
                    (self.operator_id, r.subtask): r.entries
                    for r in results
                    if r.entries is not None
                },
            )

    def _commit(self, results: list[KeyedResult], batch_id: int, offsets: list[Offsets]) -> None:
        """Write manifest ``batch_id``: the record of the attempt of each keyed subtask
        whose result was collected, and the source offsets after the batch."""
        by_subtask = {result.subtask: result.changelog for result in results}
        handles = [ChangelogHandle.from_json(by_subtask[i]) for i in range(self.parallelism)]
        manifest = self._changelog.commit(
            batch_id,
            {self.operator_id: handles},
            max_parallelism=self._max_parallelism,
            properties={
                "next_batch": batch_id + 1,
                SOURCE_OFFSETS_PROPERTY: [[list(pair) for pair in share] for share in offsets],
                "key_by": _describe_key_by(self.key_by),
                "operator": self.operator_id,
                "source": self.source.directory,
            },
            cleanup=False,
        )
        self._manifest_batch = manifest.batch_id
        self._accepted = accepted_attempts(manifest, self.operator_id)
        self._restore_point = self._changelog.layout.manifest_path(manifest.batch_id)
        try:  # off the batch's result: a failure leaves files that a later cleanup deletes
            self._changelog.cleanup()
        except CheckpointError as exc:
            _log.warning("deleting changelog records below batch %s failed: %s", batch_id, exc)

    def _apply(self, results: list[KeyedResult], batch_id: int, offsets: list[Offsets]) -> None:
        summary = self._summary
        for backend, share in zip(self._source_states, offsets, strict=True):
            offsets_state(backend).update(share)
        for result in results:
            summary.records += result.records
            summary.outputs += result.outputs
            summary.skipped += result.skipped
        summary.batches += 1
        summary.restored_bytes.append(sum(r.restored_bytes for r in results))
        summary.reused_subtasks.append(sum(r.reused for r in results))
        summary.rebuilt_subtasks.append(sum(r.rebuilt for r in results))
        if any(r.sync_seconds for r in results):
            summary.sync_seconds.append(max(r.sync_seconds for r in results))
        self._next_batch = batch_id + 1
