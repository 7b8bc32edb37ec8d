"""SnapshotFuture: the cancelable asynchronous part of a snapshot."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Executor, Future
from typing import Generic, TypeVar

from statebackend.backends.keyed import Release
from statebackend.errors import CheckpointCancelledError, CheckpointError

T = TypeVar("T")

ShouldStop = Callable[[], bool]
"""Asked by the asynchronous part between chunks: True once the snapshot is cancelled."""


class SnapshotFuture(Generic[T]):
    """The background part of one snapshot, yielding its state handle: the
    ``SnapshotResult`` of the checkpoint storage (``backends.keyed``).

    ``work(should_stop)`` runs on the transfer executor; it must check ``should_stop``
    between chunks and leave nothing behind when it stops or fails. ``release`` frees the
    synchronous cut's local resources and runs exactly once, whatever happens.
    ``discard(result)`` deletes what a finished ``work`` wrote: it runs when a cancel
    landed after ``work``'s last check of ``should_stop`` (e.g. while its last file was
    committed), so that a cancel that returned True never leaves a handle or a file.
    """

    def __init__(
        self,
        executor: Executor,
        work: Callable[[ShouldStop], T],
        release: Release,
        description: str,
        discard: Callable[[T], None] | None = None,
    ) -> None:
        self.description = description
        self._cancelled = threading.Event()
        self._release_lock = threading.Lock()
        self._release: Release | None = release
        self._discard = discard
        # Decides between a cancel and the completion: whichever takes it first wins.
        self._outcome_lock = threading.Lock()
        self._completed = False
        self._future: Future[T] = executor.submit(self._run, work)

    def _run(self, work: Callable[[ShouldStop], T]) -> T:
        try:
            if self._cancelled.is_set():
                raise CheckpointCancelledError(f"{self.description} was cancelled")
            result = work(self._cancelled.is_set)
            with self._outcome_lock:
                self._completed = not self._cancelled.is_set()
            if not self._completed:
                if self._discard is not None:
                    self._discard(result)
                raise CheckpointCancelledError(f"{self.description} was cancelled")
            return result
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{self.description} failed: {exc}") from exc
        finally:
            self._release_once()

    def _release_once(self) -> None:
        with self._release_lock:
            release, self._release = self._release, None
        if release is not None:
            release()

    def cancel(self) -> bool:
        """Stop the upload at the next chunk boundary; what it wrote is deleted.

        Returns False if the snapshot had already completed (its files then belong to
        the checkpoint, which the coordinator discards as a whole); True means that no
        handle is ever returned and nothing of the snapshot is left in storage.
        """
        with self._outcome_lock:
            if self._completed:
                return False
            if self._future.done() and not self._cancelled.is_set():
                return self._future.cancelled()
            self._cancelled.set()
        if self._future.cancel():
            self._release_once()
        return True

    def done(self) -> bool:
        """Whether the snapshot finished, failed or was cancelled."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> T:
        """The state handle; raises CheckpointError (cause attached) if the part failed,
        CheckpointCancelledError if it was cancelled, TimeoutError after ``timeout``."""
        try:
            return self._future.result(timeout)
        except CancelledError as exc:
            raise CheckpointCancelledError(f"{self.description} was cancelled") from exc

    def add_done_callback(self, callback: Callable[[SnapshotFuture[T]], None]) -> None:
        """Call ``callback(self)`` when the snapshot ends (at once if it has)."""
        self._future.add_done_callback(lambda _: callback(self))
