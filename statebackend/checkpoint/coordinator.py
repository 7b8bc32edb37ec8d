"""The checkpoint coordinator: trigger, collect acknowledgements, complete or abort, retain.

It runs where the job is driven (the Spark driver). A checkpoint is complete only when
every expected (operator, subtask) acknowledged and ``_metadata`` was written; anything
else is pending or aborted and never restored from. After each completion the coordinator
keeps the newest ``retained`` checkpoints and deletes the older ones. Savepoints live in
their own self-contained directories, which retention never touches.

Shared files (``shared/``, written by incremental snapshots) are deleted by retention and
abort only once no retained completed checkpoint and no pending checkpoint's
acknowledgement references them (``registry.py``). A pending checkpoint whose snapshots
reused a shared file that was deleted meanwhile (possible only with concurrent
checkpoints) fails on completion instead of completing with a missing file.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from statebackend.checkpoint.metadata import CheckpointMetadata, OperatorSnapshot, SubtaskAck
from statebackend.checkpoint.registry import SharedFileRegistry
from statebackend.checkpoint.savepoints import copy_checkpoint
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointError, ConfigurationError
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

    def missing(self) -> list[tuple[str, int]]:
        """The (operator, subtask) pairs that have not acknowledged yet."""
        return [
            (operator, subtask)
            for operator, parallelism in sorted(self.expected.items())
            for subtask in range(parallelism)
            if (operator, subtask) not in self.acks
        ]


class CheckpointCoordinator:
    """Coordinates the checkpoints of one job in one ``CheckpointStorage``."""

    def __init__(
        self,
        storage: CheckpointStorage,
        *,
        max_parallelism: int,
        retained: int = DEFAULT_RETAINED,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        max_concurrent: int = 1,
        clock: Clock = time.time,
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
        self.pending: dict[int, PendingCheckpoint] = {}
        self.registry = SharedFileRegistry(storage)
        self._next_id = max(storage.checkpoint_ids(), default=0) + 1

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
        Raises CheckpointError if as many checkpoints as allowed are pending already.
        """
        if len(self.pending) >= self.max_concurrent:
            raise CheckpointError(
                f"checkpoint {min(self.pending)} is still pending: wait for it to complete "
                f"or abort it before triggering another"
            )
        if not expected or any(p < 1 for p in expected.values()):
            raise ConfigurationError(f"a checkpoint needs operators with subtasks, not {expected}")
        checkpoint_id = self._next_id
        self._next_id += 1
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
        asked for) when this acknowledgement completed it, else None.
        """
        pending = self._pending(checkpoint_id)
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
        pending = self._pending(checkpoint_id)
        for key, ack in self.storage.read_acks(checkpoint_id).items():
            if key not in pending.acks:
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

    def abort(self, checkpoint_id: int) -> None:
        """Abandon a pending checkpoint and delete its files (its shared files too, unless
        another checkpoint references them)."""
        pending = self.pending.pop(checkpoint_id, None)
        acks = [
            *(pending.acks.values() if pending else ()),
            *self.storage.read_acks(checkpoint_id).values(),
        ]
        uploaded = self.registry.of_acks(checkpoint_id, acks)
        self.storage.discard(checkpoint_id)
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
        """CheckpointError (the checkpoint aborted) if shared files it references were
        deleted since it was triggered; checked only if the registry deleted any since."""
        if pending.shared_deletions == self.registry.deletions:
            return
        checkpoint_id = pending.checkpoint_id
        referenced = self.registry.of_acks(checkpoint_id, pending.acks.values())
        missing = [
            path
            for path in sorted(referenced - self.registry.retained())
            if not self.storage.fs.exists(path)
        ]
        if missing:
            self.abort(checkpoint_id)
            raise CheckpointError(
                f"checkpoint {checkpoint_id} references shared files that were deleted when "
                f"older checkpoints were discarded ({', '.join(missing)}); it was aborted"
            )

    def _complete(self, pending: PendingCheckpoint) -> str:
        self._check_shared_files(pending)
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
        directory = self.storage.complete(metadata)
        del self.pending[pending.checkpoint_id]
        self._discard_older()
        if pending.savepoint_dir is not None:
            return copy_checkpoint(
                self.storage.fs,
                directory,
                self.storage.fs,
                pending.savepoint_dir,
                signing_key=self.storage.signing_key,
            )
        return directory

    def _discard_older(self) -> None:
        completed = self.storage.completed_checkpoint_ids()
        keep = set(completed[-self.retained :]) | set(self.pending)
        newest = completed[-1] if completed else 0
        # Older incomplete directories are leftovers of aborted or crashed attempts.
        discarded = [n for n in self.storage.checkpoint_ids() if n not in keep and n < newest]
        try:
            used = frozenset().union(*(self.registry.of_checkpoint(n) for n in discarded))
        except CheckpointError:
            _log.warning("cannot read what %s reference: their shared files stay", discarded)
            used = frozenset()
        for checkpoint_id in discarded:
            self.storage.discard(checkpoint_id)
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
