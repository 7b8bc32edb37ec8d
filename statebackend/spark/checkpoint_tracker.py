"""The driver's side of a job's checkpoints while its batches run: trigger, poll, complete.

A job triggers checkpoint N before the batch whose end it cuts; the keyed subtasks take
their cut at the end of the batch and upload in the background; the driver polls the
acks between batches (``poll``) and the coordinator completes N when all are in. At most
one checkpoint is pending, as in Flink by default: before triggering one that is due, a
job asks ``idle`` (which polls, never waits) and, while the previous one still uploads,
postpones the new one to a later batch, so that no batch waits for an upload. A trigger
waits for a pending checkpoint (``wait``: polling after 2 ms, then ever less often) only
when the job must checkpoint now (its last batch, a savepoint request), and that wait is
measured. A keyed subtask's upload that neither acks nor beats its heartbeat for
``stall_seconds`` aborts the checkpoint early (``heartbeat.StallWatch``); a checkpoint
that times out, stalls or fails is aborted and the job goes on. Savepoint requests
(``statebackend savepoint trigger``) are taken by a trigger and answered when their
checkpoint completes or fails.

Completion is reported to the job through ``on_completed`` with the ``_metadata`` the
coordinator wrote (e.g. to make it the restore point, or the base of the next batch
manifests, and to record its metrics without reading it back).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.metrics import CheckpointMetrics, checkpoint_metrics
from statebackend.checkpoint.requests import (
    SavepointRequest,
    answer_savepoint_request,
    is_answered,
    pending_savepoint_requests,
)
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointError, CheckpointFencedError
from statebackend.spark.heartbeat import StallWatch
from statebackend.spark.tasks import attempt_name

_POLL_FIRST_SECONDS = 0.002
_POLL_MAX_SECONDS = 0.05
"""Waiting for a checkpoint, the driver polls its acks after 2 ms, then ever less often
(doubling, up to every 50 ms): a small upload is usually done within a few ms."""


@dataclass
class TrackedCheckpoint:
    """A pending checkpoint: its id, the batch whose end it cuts, the savepoint request
    it answers (if any), and the watch over its background uploads."""

    checkpoint_id: int
    batch_id: int
    savepoint_request: SavepointRequest | None
    watch: StallWatch = field(default_factory=StallWatch)
    sync_seconds: float = 0.0
    """The longest synchronous cut of its keyed subtasks (``cut_taken``)."""
    entries: dict[tuple[str, int], int] = field(default_factory=dict)
    """The entries each keyed subtask, by (operator, subtask), held at the cut."""


class CheckpointTracker:
    """Tracks the checkpoints ``coordinator`` triggers for one job (see the module
    docstring). ``watched_operator`` is the operator whose background uploads are
    watched for stalls."""

    def __init__(
        self,
        storage: CheckpointStorage,
        coordinator: CheckpointCoordinator,
        watched_operator: str,
        stall_seconds: float,
        on_completed: Callable[[TrackedCheckpoint, CheckpointMetadata], None],
    ) -> None:
        self.storage = storage
        self.coordinator = coordinator
        self.watched_operator = watched_operator
        self.stall_seconds = stall_seconds
        self.on_completed = on_completed
        self.pending: TrackedCheckpoint | None = None
        self.aborted = 0
        """Checkpoints aborted (timed out, stalled or failed) while the job went on."""
        self.waits: list[float] = []
        """Seconds the job waited for a pending checkpoint (per wait)."""
        self.savepoints: list[str] = []
        """Savepoints written on request."""
        self._previous: CheckpointMetadata | None = None

    # -- savepoint requests ---------------------------------------------------------------

    def savepoint_request(self) -> SavepointRequest | None:
        """The oldest unanswered savepoint request of the job, if any."""
        requests = pending_savepoint_requests(
            self.storage.fs, self.storage.layout.job_dir, self.storage.signing_key
        )
        return requests[0] if requests else None

    def _answer(self, request: SavepointRequest, path: str | None, error: str | None) -> None:
        answer_savepoint_request(self.storage.fs, self.storage.layout.job_dir, request, path, error)

    # -- the lifecycle --------------------------------------------------------------------

    def trigger(
        self,
        expected: Mapping[str, int],
        batch_id: int,
        request: SavepointRequest | None,
        properties: Mapping[str, Any],
    ) -> int:
        """Wait for the pending checkpoint, then trigger one that cuts the end of batch
        ``batch_id`` (a savepoint if ``request`` is still unanswered: the pending one may
        have been its savepoint); its id."""
        self.wait()
        job_dir = self.storage.layout.job_dir
        if request is not None and is_answered(self.storage.fs, job_dir, request):
            request = None
        savepoint_dir = None
        if request is not None:
            savepoint_dir = request.savepoint_dir(job_dir)
        checkpoint_id = self.coordinator.trigger(
            expected, savepoint_dir=savepoint_dir, properties=properties
        )
        self.pending = TrackedCheckpoint(checkpoint_id, batch_id, request)
        return checkpoint_id

    def uploads_started(self, attempts: Sequence[str] | None) -> None:
        """The batch of the pending checkpoint returned: its uploads run in the background.
        Of the watched operator's acks only those of ``attempts`` (``attempt_name`` per
        subtask: the attempts whose results the batch kept) are taken; None: the first
        one of each subtask. Another attempt of the batch (a speculative copy, a retry)
        need not have cut the same state as the one whose changelog record and output
        were kept."""
        pending = self.pending
        if pending is None:
            return
        pending.watch.uploads_since = time.monotonic()
        if attempts is not None:
            operator, kept = self.watched_operator, tuple(attempts)

            def accepts(ack: SubtaskAck) -> bool:
                return ack.operator_id != operator or (
                    ack.subtask < len(kept)
                    and attempt_name(ack.run, ack.attempt) == kept[ack.subtask]
                )

            self.coordinator.take_only(pending.checkpoint_id, accepts)

    def idle(self) -> bool:
        """Whether no checkpoint is pending, after polling the pending one (never waiting
        for it): a job triggers a due checkpoint only then, else at a later batch."""
        self.poll()
        return self.pending is None

    def poll(self) -> bool:
        """Poll the pending checkpoint; True if it completed now. A checkpoint that timed
        out, stalled or failed is aborted (the job goes on); CheckpointFencedError is
        raised (another driver took over the job)."""
        pending = self.pending
        if pending is None:
            return False
        try:
            result = self.coordinator.poll(pending.checkpoint_id)
            if result is None:
                self._check_uploads(pending)
        except CheckpointError as exc:  # timed out, stalled or failed: the job goes on
            self.pending = None
            if pending.checkpoint_id in self.coordinator.pending:
                # e.g. writing _metadata failed: abort it, or no checkpoint could follow.
                self.coordinator.abort(pending.checkpoint_id)
            if isinstance(exc, CheckpointFencedError):
                raise
            if pending.savepoint_request is not None:
                self._answer(pending.savepoint_request, None, str(exc))
            completed = self.coordinator.last_completed
            if completed is not None and completed.checkpoint_id == pending.checkpoint_id:
                # Only the savepoint copy failed: the checkpoint itself is complete.
                self.on_completed(pending, completed)
                return True
            self.aborted += 1
            return False
        if result is None:
            return False
        self.pending = None
        assert self.coordinator.last_completed is not None  # the checkpoint it just completed
        self.on_completed(pending, self.coordinator.last_completed)
        if pending.savepoint_request is not None:
            self.savepoints.append(result)
            self._answer(pending.savepoint_request, result, None)
        return True

    def cut_taken(
        self, checkpoint_id: int, sync_seconds: float, entries: Mapping[tuple[str, int], int]
    ) -> None:
        """The keyed subtasks took checkpoint ``checkpoint_id``'s cut: the longest took
        ``sync_seconds``, and each (operator, subtask) held ``entries``. Kept with the
        pending checkpoint for its metrics (nothing if it is no longer pending)."""
        pending = self.pending
        if pending is not None and pending.checkpoint_id == checkpoint_id:
            pending.sync_seconds = sync_seconds
            pending.entries = dict(entries)

    def metrics(
        self, pending: TrackedCheckpoint, metadata: CheckpointMetadata
    ) -> CheckpointMetrics:
        """The metrics of the completed checkpoint of ``pending`` (``metadata``, as given
        to ``on_completed``), with the cut ``cut_taken`` recorded; its incremental bytes
        are those the previous one this tracker measured does not reference, its upload
        time counts from ``uploads_started``."""
        since = pending.watch.uploads_since
        measured = checkpoint_metrics(
            metadata,
            batch_id=pending.batch_id,
            sync_seconds=pending.sync_seconds,
            upload_seconds=0.0 if since is None else time.monotonic() - since,
            previous=self._previous,
            entries=pending.entries,
        )
        self._previous = metadata
        return measured

    def _check_uploads(self, pending: TrackedCheckpoint) -> None:
        """Abort the pending checkpoint (CheckpointError) if a watched upload stalled."""
        checkpoint_id = pending.checkpoint_id
        stalled = pending.watch.stalled(
            self.storage,
            checkpoint_id,
            self.coordinator.pending[checkpoint_id].missing(),
            self.watched_operator,
            self.stall_seconds,
        )
        if stalled is not None:
            self.coordinator.abort(checkpoint_id)
            raise CheckpointError(f"checkpoint {checkpoint_id}: {stalled}; it was aborted")

    def wait(self) -> bool:
        """Wait until no checkpoint is pending; record the wait. True unless the pending
        checkpoint was aborted."""
        if self.pending is None:
            return True
        started = time.perf_counter()
        completed = False
        interval = _POLL_FIRST_SECONDS
        while self.pending is not None:
            completed = self.poll()
            if not completed and self.pending is not None:
                time.sleep(interval)
                interval = min(2 * interval, _POLL_MAX_SECONDS)
        self.waits.append(time.perf_counter() - started)
        return completed

    def abort(self, reason: str) -> None:
        """Abort every pending checkpoint (the job failed: ``reason``); answer its
        savepoint request with the reason."""
        self.coordinator.abort_all()
        if self.pending is not None and self.pending.savepoint_request is not None:
            self._answer(self.pending.savepoint_request, None, reason)
        self.pending = None
