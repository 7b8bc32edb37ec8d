"""The checkpoint coordinator: trigger, collect acknowledgements, complete or abort, retain.

It runs where the job is driven (the Spark driver). A checkpoint is complete only when
every expected (operator, subtask) acknowledged and ``_metadata`` was written; anything
else is pending or aborted and never restored from. After each completion the coordinator
keeps the newest ``retained`` checkpoints and deletes the older ones, except those that
are ``pinned`` (e.g. the bases of the job's retained batch manifests). Savepoints live in
their own self-contained directories, which retention never touches.

Shared files (``shared/``, written by incremental snapshots) are deleted by retention and
abort only once no retained completed checkpoint and no pending checkpoint's
acknowledgement references them (``registry.py``). A snapshot reuses only shared files
that a completed checkpoint's ``_metadata`` references (``snapshot/incremental.py``). A
pending checkpoint whose snapshots reference a shared file that was deleted (one deleted
meanwhile, possible with concurrent checkpoints, or one reused from elsewhere than a
retained checkpoint) fails on completion instead of completing with a missing file; only
files that no retained checkpoint holds and that the acks did not upload themselves are
looked up.

Lifecycle rules (what makes a checkpoint's files belong to exactly one checkpoint):

- **Ids are never reused** in a job directory: every trigger records its id in
  ``_checkpoint_id`` (a durable high-water mark) before anything of it is written, and a
  new coordinator starts above both that mark and every ``chk-<N>`` it lists.
- **Acks name their run.** A coordinator has a ``run_id``; triggering N writes
  ``chk-<N>/_pending`` naming it, every acknowledgement names the run (and the task
  attempt) it belongs to, and the coordinator ignores acknowledgements of other runs. Of
  several attempts of one subtask the first acknowledgement read is taken, or only the
  one ``take_only`` accepts (the attempt whose batch result the job kept); the files of
  the others are deleted once N completed (so a later snapshot from the local copy of an
  attempt not taken must not reuse them: it checks N's ``_metadata``).
- **Abort reaches the uploads.** Aborting N removes its pending marker first: uploads
  poll it between chunks, stop, and a snapshot that finishes anyway deletes its own
  files; ``write_ack`` writes nothing once the marker is gone. Retention also reads the
  acknowledgements left in incomplete directories, so the shared files of an ack that
  raced the abort are deleted with them.
- **``_metadata`` written = complete.** ``_metadata`` is never overwritten. Whatever fails
  after it was written (removing the marker and acks, discarding older checkpoints,
  copying a savepoint) is logged and retried at the next trigger or poll; it never turns
  the checkpoint into an aborted one. ``last_completed`` (the ``_metadata`` it wrote)
  tells a caller that caught a savepoint-copy error that the checkpoint itself did
  complete, and spares it reading ``_metadata`` back.
- **Fencing.** Each coordinator claims a new leader epoch, ``_leader/epoch-<E>.json``
  (one more than the newest there, naming its run), when it triggers its first
  checkpoint; a driver that fails before that (e.g. on bad input) fences nobody. Before
  it triggers, after it marked a checkpoint pending (a new driver that read the same id
  mark claimed its epoch first) and before it writes ``_metadata`` it checks that the
  newest claim is still its own; otherwise it raises CheckpointFencedError: another
  driver took over the job, this one must stop. A fenced coordinator's abort deletes
  nothing. Two drivers that claim at the same moment both write ``epoch-<E>``; the claim
  read back afterwards decides, so at most one of them goes on. Check and write are not
  one atomic step (object stores offer no conditional write here): a takeover in between
  lets the old driver complete the one checkpoint it had pending, under an id the new
  driver never uses, never a checkpoint of the new driver.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from statebackend.checkpoint.metadata import CheckpointMetadata, OperatorSnapshot, SubtaskAck
from statebackend.checkpoint.registry import SharedFileRegistry
from statebackend.checkpoint.savepoints import copy_checkpoint
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointError, CheckpointFencedError, ConfigurationError
from statebackend.state.ttl import Clock

_log = logging.getLogger(__name__)

DEFAULT_RETAINED = 3
DEFAULT_TIMEOUT_SECONDS = 600.0


@dataclass
class PendingCheckpoint:
    """A triggered checkpoint waiting for its acknowledgements."""

    checkpoint_id: int
    triggered_at: float
    expected: dict[str, int]
    savepoint_dir: str | None = None
    properties: dict[str, Any] = field(default_factory=dict)
    acks: dict[tuple[str, int], SubtaskAck] = field(default_factory=dict)
    shared_deletions: int = 0
    """The registry's deletion count when the checkpoint was triggered."""
    accepts: Callable[[SubtaskAck], bool] | None = None
    """Which acknowledgements may be taken (``CheckpointCoordinator.take_only``)."""

    def takes(self, ack: SubtaskAck, run_id: str) -> bool:
        """Whether ``ack`` is one to take: of run ``run_id``, of a subtask that has not
        acknowledged yet, and accepted."""
        return (
            ack.run == run_id
            and (ack.operator_id, ack.subtask) not in self.acks
            and (self.accepts is None or self.accepts(ack))
        )

    def missing(self) -> list[tuple[str, int]]:
        """The (operator, subtask) pairs that have not acknowledged yet."""
        return [
            (operator, subtask)
            for operator, parallelism in sorted(self.expected.items())
            for subtask in range(parallelism)
            if (operator, subtask) not in self.acks
        ]


class CheckpointCoordinator:
    """Coordinates the checkpoints of one job in one ``CheckpointStorage``.

    Its first trigger claims the job's next leader epoch for run ``run_id`` (a new random
    id by default), which fences every coordinator that claimed one before on the same
    job directory (see the module docstring). Retention keeps the checkpoints ``pinned``
    names (asked at each retention) besides the newest ``retained``.
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        *,
        max_parallelism: int,
        retained: int = DEFAULT_RETAINED,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        max_concurrent: int = 1,
        clock: Clock = time.time,
        run_id: str | None = None,
        pinned: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        if retained < 1:
            raise ConfigurationError(f"retained checkpoints {retained!r} is invalid: keep >= 1")
        if max_concurrent < 1:
            raise ConfigurationError(
                f"max concurrent checkpoints {max_concurrent!r} is invalid: allow >= 1"
            )
        self.storage = storage
        self.max_parallelism = max_parallelism
        self.retained = retained
        self.timeout_seconds = timeout_seconds
        self.max_concurrent = max_concurrent
        self.clock = clock
        self.pinned = pinned
        self.pending: dict[int, PendingCheckpoint] = {}
        self.registry = SharedFileRegistry(storage)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.epoch: int | None = None
        """The leader epoch this coordinator claimed (None before its first trigger)."""
        self.last_completed: CheckpointMetadata | None = None
        """The ``_metadata`` of the newest checkpoint this coordinator completed."""
        self._unfinished: dict[int, frozenset[str]] = {}
        """Completed checkpoints whose marker and acks are still to be removed, with the
        files their ``_metadata`` references."""
        self._discard_due = False
        # Directories written before the high-water mark existed count too.
        self._next_id = max(storage.checkpoint_ids(), default=0) + 1

    @property
    def last_completed_id(self) -> int | None:
        """The id of the newest checkpoint this coordinator completed, or None."""
        return None if self.last_completed is None else self.last_completed.checkpoint_id

    def claim_leadership(self) -> int:
        """Claim the job's next leader epoch (once; later calls return it), fencing every
        coordinator that claimed an earlier one."""
        if self.epoch is not None:
            return self.epoch
        epochs = self.storage.leader_epochs()
        epoch = (epochs[-1] if epochs else 0) + 1
        self.storage.write_leader(epoch, self.run_id, self.clock())
        self.epoch = epoch
        for older in epochs:
            try:
                self.storage.delete_leader(older)
            except CheckpointError:  # a stale claim left behind fences nobody new
                _log.warning("could not delete the superseded leader epoch %s", older)
        return epoch

    def check_leader(self) -> int:
        """This coordinator's leader epoch (claimed first if it has none); raises
        CheckpointFencedError unless its claim is still the newest in the job directory."""
        epoch = self.claim_leadership()
        epochs = self.storage.leader_epochs()
        newest = epochs[-1] if epochs else None
        claim = {} if newest is None else self.storage.read_leader(newest)
        if newest == epoch and claim.get("run") == self.run_id:
            return epoch
        raise CheckpointFencedError(
            f"another driver (run {claim.get('run')}, leader epoch {newest}) took over the "
            f"checkpoints of job {self.storage.job_id} in {self.storage.layout.job_dir}; "
            f"this driver (run {self.run_id}, epoch {self.epoch}) must stop: run one "
            f"driver per job"
        )

    def trigger(
        self,
        expected: Mapping[str, int],
        *,
        savepoint_dir: str | None = None,
        properties: Mapping[str, Any] | None = None,
    ) -> int:
        """Start checkpoint N expecting ``expected[operator]`` subtasks of each operator.

        With ``savepoint_dir`` the completed checkpoint is also copied there as a
        self-contained savepoint. ``properties`` (JSON-able) go into ``_metadata``.
        Raises CheckpointError if as many checkpoints as allowed are pending already,
        CheckpointFencedError if another coordinator took over the job.
        """
        epoch = self.check_leader()  # first: a fenced coordinator discards nothing
        self._finish_completed()
        if len(self.pending) >= self.max_concurrent:
            raise CheckpointError(
                f"checkpoint {min(self.pending)} is still pending: wait for it to complete "
                f"or abort it before triggering another"
            )
        if not expected or any(p < 1 for p in expected.values()):
            raise ConfigurationError(f"a checkpoint needs operators with subtasks, not {expected}")
        # Above every id ever triggered in the job directory, by any driver.
        checkpoint_id = max(self._next_id, self.storage.checkpoint_id_mark() + 1)
        self.storage.set_checkpoint_id_mark(checkpoint_id)
        self._next_id = checkpoint_id + 1
        self.storage.mark_pending(checkpoint_id, self.run_id, epoch)
        # A driver that took over meanwhile may have read the same id mark; it claimed its
        # epoch before it read it, so this check fences this coordinator before N runs.
        self.check_leader()
        self.pending[checkpoint_id] = PendingCheckpoint(
            checkpoint_id,
            self.clock(),
            dict(expected),
            savepoint_dir,
            dict(properties or {}),
            shared_deletions=self.registry.deletions,
        )
        return checkpoint_id

    def acknowledge(self, checkpoint_id: int, ack: SubtaskAck) -> str | None:
        """Record one subtask's acknowledgement; completes the checkpoint with the last one.

        Returns the directory of the completed checkpoint (or savepoint, if one was
        asked for) when this acknowledgement completed it, else None. Ignores (returns
        None for) an acknowledgement of another run, one of a subtask that has
        acknowledged already (another task attempt's) and one ``take_only`` refuses.
        """
        pending = self._pending(checkpoint_id)
        if not pending.takes(ack, self.run_id):
            _log.info(
                "checkpoint %s: ignored the ack of %s subtask %s (run %s, attempt %s)",
                checkpoint_id,
                ack.operator_id,
                ack.subtask,
                ack.run,
                ack.attempt,
            )
            return None
        if pending.expected.get(ack.operator_id) != ack.parallelism:
            raise CheckpointError(
                f"checkpoint {checkpoint_id} got an acknowledgement from {ack.operator_id} "
                f"subtask {ack.subtask} of {ack.parallelism}, which it does not expect"
            )
        pending.acks[(ack.operator_id, ack.subtask)] = ack
        return None if pending.missing() else self._complete(pending)

    def poll(self, checkpoint_id: int) -> str | None:
        """Take in the acknowledgements subtasks wrote to storage; complete if all are in.

        Returns what ``acknowledge`` returns. Aborts the checkpoint (and raises
        CheckpointError) when it has timed out.
        """
        self._finish_completed()
        pending = self._pending(checkpoint_id)
        for ack in self.storage.read_acks(checkpoint_id):
            if pending.takes(ack, self.run_id):
                result = self.acknowledge(checkpoint_id, ack)
                if result is not None:
                    return result
        if self.clock() - pending.triggered_at > self.timeout_seconds:
            missing = pending.missing()
            self.abort(checkpoint_id)
            raise CheckpointError(
                f"checkpoint {checkpoint_id} timed out after {self.timeout_seconds:g} s "
                f"waiting for {missing}; it was aborted and its files deleted"
            )
        return None

    def take_only(self, checkpoint_id: int, accepts: Callable[[SubtaskAck], bool]) -> None:
        """From now on take only the acknowledgements of pending checkpoint N for which
        ``accepts`` holds, and drop those taken already for which it does not: e.g. only
        the task attempts whose results a batch kept, since another attempt of the same
        batch (a speculative copy, a retry) need not have cut the same state. The files
        of the acks dropped or refused are deleted once N completed, as other attempts'."""
        pending = self._pending(checkpoint_id)
        pending.accepts = accepts
        pending.acks = {key: ack for key, ack in pending.acks.items() if accepts(ack)}

    def abort(self, checkpoint_id: int) -> None:
        """Abandon a pending checkpoint and delete its files (its shared files too, unless
        another checkpoint references them). A fenced coordinator deletes nothing: N's
        directory may be the new driver's (``statebackend gc`` removes what is left)."""
        pending = self.pending.pop(checkpoint_id, None)
        try:
            self.check_leader()
        except CheckpointFencedError:
            _log.warning(
                "checkpoint %s was abandoned without deleting anything: another driver "
                "took over the job",
                checkpoint_id,
            )
            return
        self.storage.end_pending(checkpoint_id)
        acks = [
            *(pending.acks.values() if pending else ()),
            *self.storage.read_acks(checkpoint_id),
        ]
        uploaded = self.registry.of_acks(checkpoint_id, acks)
        try:
            self.storage.discard(checkpoint_id)
        except CheckpointError as exc:
            # An upload still writing (it stops at its next chunk, without the pending
            # marker, and deletes its own files) can make a recursive delete fail; what is
            # left is an incomplete checkpoint that retention deletes at the next completion.
            _log.warning(
                "checkpoint %s was aborted; deleting its files failed: %s", checkpoint_id, exc
            )
        self._delete_unreferenced(uploaded)

    def abort_all(self) -> None:
        """Abort every pending checkpoint (e.g. after a failure)."""
        for checkpoint_id in list(self.pending):
            self.abort(checkpoint_id)

    def latest_completed(self) -> str | None:
        """The directory of the newest completed checkpoint, or None."""
        return self.storage.latest_completed()

    def _pending(self, checkpoint_id: int) -> PendingCheckpoint:
        pending = self.pending.get(checkpoint_id)
        if pending is None:
            raise CheckpointError(f"checkpoint {checkpoint_id} is not pending")
        return pending

    def _check_shared_files(self, pending: PendingCheckpoint) -> None:
        """CheckpointError (the checkpoint aborted) if shared files its acknowledgements
        reference are missing. Looked up are the files no retained completed checkpoint
        holds that an ack reuses (another snapshot's, e.g. of a task attempt an earlier
        checkpoint did not take), and, if the registry deleted any shared file since the
        checkpoint was triggered, also those the acks uploaded. The files of the newest
        completed checkpoint are never looked up: a checkpoint that reuses only those
        and uploads the rest costs no look-up."""
        checkpoint_id = pending.checkpoint_id
        acks = pending.acks.values()
        if pending.shared_deletions == self.registry.deletions:
            unheld = self.registry.reused_by(checkpoint_id, acks)
        else:
            unheld = self.registry.of_acks(checkpoint_id, acks)
        try:
            if self.last_completed_id is not None:
                unheld -= self.registry.of_checkpoint(self.last_completed_id)
            if unheld:
                unheld -= self.registry.retained()
        except CheckpointError:
            _log.warning("cannot read the retained checkpoints: looking up every shared file")
        missing = [path for path in sorted(unheld) if not self.storage.fs.exists(path)]
        if missing:
            self.abort(checkpoint_id)
            raise CheckpointError(
                f"checkpoint {checkpoint_id} references shared files that were deleted as "
                f"unreferenced ({', '.join(missing)}: of a discarded checkpoint, or of a task "
                f"attempt an earlier checkpoint did not take); it was aborted"
            )

    def _complete(self, pending: PendingCheckpoint) -> str:
        self._check_shared_files(pending)
        self.check_leader()
        operators = {
            operator: OperatorSnapshot(
                operator,
                parallelism,
                tuple(pending.acks[(operator, i)] for i in range(parallelism)),
            )
            for operator, parallelism in pending.expected.items()
        }
        metadata = CheckpointMetadata(
            job_id=self.storage.job_id,
            checkpoint_id=pending.checkpoint_id,
            max_parallelism=self.max_parallelism,
            operators=operators,
            triggered_at=pending.triggered_at,
            completed_at=self.clock(),
            properties=pending.properties,
        )
        problem = metadata.problem()  # what every load of it would refuse
        if problem is not None:
            self.abort(pending.checkpoint_id)
            raise CheckpointError(
                f"checkpoint {pending.checkpoint_id} was aborted: its acknowledgements make "
                f"an invalid checkpoint ({problem}); check that every executor runs this "
                f"job's code and settings"
            )
        directory = self.storage.complete(metadata)
        # From here on the checkpoint is complete, whatever fails afterwards.
        del self.pending[pending.checkpoint_id]
        self.last_completed = metadata
        self._unfinished[pending.checkpoint_id] = self.registry.paths_of(
            pending.checkpoint_id, pending.acks.values()
        )
        self._discard_due = True
        self._finish_completed()
        if pending.savepoint_dir is not None:
            try:
                return copy_checkpoint(
                    self.storage.fs,
                    directory,
                    self.storage.fs,
                    pending.savepoint_dir,
                    signing_key=self.storage.signing_key,
                )
            except Exception as exc:  # whatever it is, the checkpoint stays complete
                raise CheckpointError(
                    f"checkpoint {pending.checkpoint_id} completed in {directory}, but "
                    f"copying it to the savepoint {pending.savepoint_dir} failed: {exc}; "
                    f"ask for the savepoint again"
                ) from exc
        return directory

    def _finish_completed(self) -> None:
        """The work after completions: remove the completed checkpoints' pending markers
        and acks (deleting the files of acknowledgements that were not taken), and
        discard older checkpoints. A failure is logged, and the work retried at the next
        trigger or poll; completed checkpoints stay complete."""
        try:
            for checkpoint_id in sorted(self._unfinished):
                self._finish(checkpoint_id, self._unfinished[checkpoint_id])
                del self._unfinished[checkpoint_id]
            if self._discard_due:
                self._discard_older()
                self._discard_due = False
        except Exception:  # any failure: the checkpoint stays complete, the work is retried
            _log.warning(
                "cleaning up after completed checkpoints failed; will retry", exc_info=True
            )

    def _finish(self, checkpoint_id: int, kept: frozenset[str]) -> None:
        """Remove checkpoint N's marker, the files of acks it did not take (other task
        attempts', other runs'), then its acks."""
        self.storage.end_pending(checkpoint_id)
        acks = self.storage.read_acks(checkpoint_id)
        unused = self.registry.paths_of(checkpoint_id, acks) - kept
        shared = self.registry.of_acks(checkpoint_id, acks) & unused
        for path in sorted(unused - shared):
            self.storage.fs.delete(path)
        self._delete_unreferenced(shared)
        self.storage.delete_acks(checkpoint_id)

    def _discard_older(self) -> None:
        completed = self.storage.completed_checkpoint_ids()
        keep = set(completed[-self.retained :]) | set(self.pending)
        if self.pinned is not None:
            keep |= set(self.pinned())
        newest = completed[-1] if completed else 0
        # Older incomplete directories are leftovers of aborted or crashed attempts.
        discarded = [n for n in self.storage.checkpoint_ids() if n not in keep and n < newest]
        try:
            # An incomplete directory's acks may reference shared files (e.g. a late ack).
            used = frozenset().union(
                *(self.registry.of_checkpoint(n) for n in discarded),
                *(self.registry.of_acks(n, self.storage.read_acks(n)) for n in discarded),
            )
        except CheckpointError:
            _log.warning("cannot read what %s reference: their shared files stay", discarded)
            used = frozenset()
        for checkpoint_id in discarded:
            self.storage.discard(checkpoint_id)
            self._unfinished.pop(checkpoint_id, None)
        self.registry.forget(discarded)
        self._delete_unreferenced(used)

    def _delete_unreferenced(self, candidates: frozenset[str]) -> None:
        """Delete those of ``candidates`` that no retained completed checkpoint and no
        pending checkpoint's acknowledgement references. If a retained checkpoint's
        ``_metadata`` cannot be read, nothing is deleted (``statebackend gc`` can later)."""
        if not candidates:
            return
        try:
            referenced = self.registry.retained()
        except CheckpointError:
            _log.warning("cannot read the retained checkpoints: no shared file deleted")
            return
        referenced = referenced.union(
            *(self.registry.of_acks(n, p.acks.values()) for n, p in self.pending.items())
        )
        self.registry.delete(candidates - referenced)
