"""The shared-file registry: which files in the job's ``shared/`` directory checkpoints use.

Incremental snapshots reference SST files in ``shared/`` that earlier checkpoints
uploaded. A shared file may be deleted only when no retained completed checkpoint and no
pending checkpoint (by the acknowledgements it has) references it. The references are
computed from the checkpoints' ``_metadata`` (cached per checkpoint: it never changes),
so they survive a driver restart without a state file of their own. Savepoints copy
the files they need and never reference ``shared/``.
"""

from __future__ import annotations

from collections.abc import Iterable

from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.storage import CheckpointStorage, written_by
from statebackend.errors import CheckpointNotFoundError
from statebackend.snapshot.handles import StoredFile, normalize_path, resolve_path


class SharedFileRegistry:
    """Reference counting over the shared files of one job's checkpoints."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self._storage = storage
        self._shared_prefix = normalize_path(storage.layout.shared_dir) + "/"
        self._by_checkpoint: dict[int, frozenset[str]] = {}
        self.deletions = 0
        """How many shared files this registry deleted so far."""

    def _paths(self, checkpoint_id: int, files: Iterable[StoredFile]) -> frozenset[str]:
        directory = self._storage.resolve(checkpoint_id)
        return frozenset(resolve_path(directory, f.path) for f in files)

    def _shared(self, checkpoint_id: int, files: Iterable[StoredFile]) -> frozenset[str]:
        return frozenset(
            p for p in self._paths(checkpoint_id, files) if p.startswith(self._shared_prefix)
        )

    def paths_of(self, checkpoint_id: int, acks: Iterable[SubtaskAck]) -> frozenset[str]:
        """Every file (shared or not) the acknowledgements of checkpoint N reference."""
        return self._paths(checkpoint_id, (f for ack in acks for f in ack.files()))

    def of_checkpoint(self, checkpoint_id: int) -> frozenset[str]:
        """The shared files completed checkpoint N references (none if N is not complete).

        Raises CheckpointError if its ``_metadata`` cannot be read.
        """
        found = self._by_checkpoint.get(checkpoint_id)
        if found is None:
            try:
                metadata = self._storage.load(checkpoint_id)
            except CheckpointNotFoundError:
                return frozenset()
            found = self._by_checkpoint[checkpoint_id] = self._shared(
                checkpoint_id, metadata.files()
            )
        return found

    def of_acks(self, checkpoint_id: int, acks: Iterable[SubtaskAck]) -> frozenset[str]:
        """The shared files the acknowledgements of (pending) checkpoint N reference."""
        return self._shared(checkpoint_id, (f for ack in acks for f in ack.files()))

    def reused_by(self, checkpoint_id: int, acks: Iterable[SubtaskAck]) -> frozenset[str]:
        """The shared files the acknowledgements of (pending) checkpoint N reference that
        their own snapshots did not upload: those named after another snapshot (another
        subtask, run or task attempt), uploaded for an earlier checkpoint."""
        reused: set[str] = set()
        for ack in acks:
            reused.update(
                p
                for p in self.of_acks(checkpoint_id, [ack])
                if not written_by(ack, p, checkpoint_id)
            )
        return frozenset(reused)

    def retained(self) -> frozenset[str]:
        """The shared files every completed checkpoint still in storage references."""
        ids = self._storage.completed_checkpoint_ids()
        return frozenset().union(*(self.of_checkpoint(n) for n in ids))

    def forget(self, checkpoint_ids: Iterable[int]) -> None:
        """Drop what is cached of discarded checkpoints."""
        for checkpoint_id in checkpoint_ids:
            self._by_checkpoint.pop(checkpoint_id, None)

    def delete(self, paths: Iterable[str]) -> None:
        """Delete shared files the caller found unreferenced."""
        for path in sorted(paths):
            self._storage.fs.delete(path)
            self.deletions += 1
