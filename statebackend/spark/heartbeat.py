"""The heartbeat of a keyed subtask's background upload: the worker beats, the driver watches.

A keyed subtask's task returns before its checkpoint upload is done; the upload runs on
the Python worker's transfer threads and writes the subtask's ack when done. If the
worker dies meanwhile (e.g. Spark kills an idle Python worker after 60 s), no ack ever
comes. So while the upload runs, the worker writes a growing counter to a heartbeat file
next to the checkpoint's acks (``UploadHeartbeat``), and the driver aborts the checkpoint
once a missing subtask has neither acknowledged nor beaten for
``checkpoint.upload-stall-timeout`` (``StallWatch``), instead of waiting for
``checkpoint.timeout``. Both ends live here so that they agree on the file and the pace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from statebackend.checkpoint.layout import join
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointError

_log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 2.0
"""How often a worker's pending upload says it is alive."""


def heartbeat_path(
    storage: CheckpointStorage, checkpoint_id: int, operator_id: str, subtask: int
) -> str:
    """The heartbeat file of a subtask's background upload of checkpoint N: next to the
    acks (not an ack name), so completing or aborting the checkpoint deletes it."""
    return join(storage.layout.acks_dir(checkpoint_id), f"{operator_id}-{subtask}.alive")


class UploadHeartbeat:
    """The worker's end: while a background upload runs, a daemon thread writes a
    growing counter to the upload's heartbeat file every ``HEARTBEAT_SECONDS`` (the first
    after that long, so quick uploads write none).

    The lock orders the last beat before the ack: no beat is written once the ack is,
    so a completed checkpoint (whose acks directory is deleted) never gets one back. It
    stops once the checkpoint is no longer pending (aborted or completed)."""

    def __init__(self, storage: CheckpointStorage, checkpoint_id: int, path: str) -> None:
        self._storage = storage
        self._checkpoint_id = checkpoint_id
        self._path = path
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def start(self) -> None:
        """Start beating in a daemon thread."""
        threading.Thread(target=self._run, name="statebackend-heartbeat", daemon=True).start()

    def stop(self) -> None:
        """Stop beating."""
        with self._lock:
            self._stopped.set()

    @contextmanager
    def stopping(self) -> Iterator[None]:
        """Run the block (the ack) with no beat in flight, then stop beating."""
        with self._lock:
            try:
                yield
            finally:
                self._stopped.set()

    def _run(self) -> None:
        beat = 0
        while not self._stopped.wait(HEARTBEAT_SECONDS):
            beat += 1
            with self._lock:
                if self._stopped.is_set():
                    return
                try:
                    if not self._storage.is_pending(self._checkpoint_id):
                        return
                    self._storage.fs.write_atomic(self._path, str(beat).encode())
                except Exception:  # a missed beat; the next one may get through
                    _log.warning("could not write the upload heartbeat %s", self._path)


@dataclass
class StallWatch:
    """The driver's end, for one pending checkpoint: the last beat seen per keyed
    subtask, and since when."""

    uploads_since: float | None = None
    """When the batch's keyed subtasks returned, leaving their uploads in the background
    (None: not yet, nothing to watch)."""
    beats: dict[int, tuple[bytes | None, float]] = field(default_factory=dict)
    """Keyed subtask -> (its last heartbeat seen, when it was first seen)."""
    next_check: float = 0.0

    def stalled(
        self,
        storage: CheckpointStorage,
        checkpoint_id: int,
        missing: Iterable[tuple[str, int]],
        operator_id: str,
        stall_seconds: float,
    ) -> str | None:
        """Which upload of ``operator_id`` among the ``missing`` (operator, subtask) acks
        has neither acknowledged nor beaten for ``stall_seconds`` (a description), or
        None. Reads the heartbeats at most every ``HEARTBEAT_SECONDS``."""
        now = time.monotonic()
        if self.uploads_since is None or now < self.next_check:
            return None
        self.next_check = now + HEARTBEAT_SECONDS
        for missing_operator, subtask in missing:
            if missing_operator != operator_id:
                continue
            path = heartbeat_path(storage, checkpoint_id, operator_id, subtask)
            try:
                beat: bytes | None = storage.fs.read_file(path)
            except CheckpointError:  # none written yet (or unreadable now): no beat seen
                beat = None
            seen = self.beats.get(subtask)
            if seen is None:  # no beat yet counts from the end of the batch
                self.beats[subtask] = (beat, now if beat else self.uploads_since)
            elif seen[0] != beat:
                self.beats[subtask] = (beat, now)
            elif now - seen[1] > stall_seconds:
                return (
                    f"the upload of {operator_id} subtask {subtask} made no progress for "
                    f"{now - seen[1]:.0f} s (no ack, no heartbeat; its Python worker has "
                    f"probably died)"
                )
        return None
