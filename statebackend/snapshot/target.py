"""Where snapshots are written: a directory on a checkpoint file system."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any, Protocol

from statebackend.backends.keyed import KeyedStateCut
from statebackend.backends.operator import OperatorStateCut
from statebackend.backends.raw_keyed import RawKeyedStateCut
from statebackend.checksums import checksum
from statebackend.errors import CheckpointCancelledError, CheckpointError
from statebackend.snapshot.frames import CODECS, check_codec
from statebackend.snapshot.future import ShouldStop, SnapshotFuture
from statebackend.snapshot.handles import INLINE_LIMIT
from statebackend.snapshot.incremental import SharedLocation, upload_native_checkpoint
from statebackend.snapshot.keyed_format import FullKeyedStateHandle, encode_keyed_cut
from statebackend.snapshot.keyed_handles import KeyedHandle
from statebackend.snapshot.operator_format import (
    OperatorStateHandle,
    encode_operator_cut,
)
from statebackend.snapshot.pipeline import prefetched
from statebackend.snapshot.raw_keyed_format import RawKeyedStateHandle, encode_raw_keyed_cut

PREFETCH_FRAMES = 16
"""Frames (``keyed_format.FRAME_BYTES`` each, before compression) a keyed snapshot
encodes ahead of its upload."""


ABORT_POLL_SECONDS = 1.0
"""How often a running upload asks storage whether its checkpoint was aborted."""


class AbortSignal:
    """Whether the coordinator abandoned a checkpoint, as seen from a (remote) upload.

    ``still_pending()`` asks storage (e.g. whether the checkpoint's pending marker exists).
    Called between chunks, the signal asks at most every ``interval`` seconds; ``now()``
    always asks. Once the checkpoint is seen abandoned, the answer stays True.
    """

    def __init__(
        self, still_pending: Callable[[], bool], interval: float = ABORT_POLL_SECONDS
    ) -> None:
        self._still_pending = still_pending
        self._interval = interval
        self._lock = threading.Lock()
        self._next_check = time.monotonic() + interval
        self._aborted = False

    def __call__(self) -> bool:
        """True if the checkpoint is known to be abandoned (rate-limited look-ups)."""
        with self._lock:
            if self._aborted or time.monotonic() < self._next_check:
                return self._aborted
            self._next_check = time.monotonic() + self._interval
        return self.now()

    def now(self) -> bool:
        """True if the checkpoint is abandoned, asking storage now."""
        if not self._aborted and not self._still_pending():
            self._aborted = True
        return self._aborted


class SnapshotFileSystem(Protocol):
    """What snapshots need of a file system (``checkpoint.filesystem`` provides it)."""

    checksum_algorithm: str
    """The algorithm of the checksums of the files it writes (``checksums.py``)."""

    def write_file(
        self, path: str, chunks: Iterable[bytes], *, should_stop: Callable[[], bool] | None = None
    ) -> Any:
        """Stream chunks to a new file; return an object with ``size`` and ``checksum``;
        leave nothing behind if stopped or failed."""

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``path`` from ``start``."""

    def open_read(self, path: str) -> Any:
        """A binary stream of ``path``."""

    def delete(self, path: str, recursive: bool = False) -> None:
        """Delete ``path``; not an error if it does not exist."""


class SnapshotDirectory:
    """Writes the snapshots of one (operator, subtask) into one checkpoint directory.

    File names are ``<name>-<kind>-<random>``, relative to ``directory``, so that a
    retried or concurrent snapshot never overwrites another's file (``name`` names the
    subtask and its task attempt). With ``shared`` set, keyed snapshots of cuts that have
    a native checkpoint (RocksDB) are incremental (``snapshot/incremental.py``), uploading
    up to ``upload_threads`` files at a time; other cuts are written in the full format.

    With ``abort`` set, uploads also stop (between chunks) once the checkpoint was
    aborted, and a snapshot that finishes after that deletes what it wrote and raises
    CheckpointCancelledError instead of yielding a handle.
    """

    def __init__(
        self,
        filesystem: SnapshotFileSystem,
        directory: str,
        name: str,
        executor: Executor,
        compression: str = "none",
        shared: SharedLocation | None = None,
        upload_threads: int = 4,
        abort: AbortSignal | None = None,
    ) -> None:
        self.filesystem = filesystem
        self.directory = directory.rstrip("/")
        self.name = name
        self.executor = executor
        self.codec = check_codec(compression)
        self.shared = shared
        self.upload_threads = upload_threads
        self.abort = abort

    def _stop(self, should_stop: ShouldStop) -> ShouldStop:
        abort = self.abort
        return should_stop if abort is None else lambda: should_stop() or abort()

    def _abandoned(self) -> bool:
        return self.abort is not None and self.abort.now()

    def _keep_unless_abandoned(self, checkpoint_id: int, paths: list[str]) -> None:
        """Delete ``paths`` and raise CheckpointCancelledError if the checkpoint was
        aborted while they were written."""
        if self._abandoned():
            for path in paths:
                self.filesystem.delete(path)
            raise CheckpointCancelledError(
                f"checkpoint {checkpoint_id} was aborted while {self.name} uploaded its "
                "snapshot; the upload was deleted"
            )

    def _new_file(self, kind: str) -> str:
        return f"{self.name}-{kind}-{uuid.uuid4().hex[:12]}"

    def _write_file(
        self,
        checkpoint_id: int,
        relative: str,
        chunks: Iterable[bytes],
        should_stop: ShouldStop,
    ) -> Any:
        """Write one file of the snapshot, stopping between chunks when cancelled or
        aborted; a file finished after an abort is deleted (CheckpointCancelledError)."""
        path = f"{self.directory}/{relative}"
        try:
            written = self.filesystem.write_file(path, chunks, should_stop=self._stop(should_stop))
        except CheckpointError as exc:
            # The abort deletes the directory under a write it has not stopped yet.
            if not isinstance(exc, CheckpointCancelledError) and self._abandoned():
                raise CheckpointCancelledError(
                    f"checkpoint {checkpoint_id} was aborted while {self.name} wrote {path}"
                ) from exc
            raise
        self._keep_unless_abandoned(checkpoint_id, [path])
        return written

    def _discard(self, relative: str | None) -> None:
        """Delete a file of a snapshot whose future was cancelled after it was written."""
        if relative is not None:
            self.filesystem.delete(f"{self.directory}/{relative}")

    def write_keyed_snapshot(
        self, checkpoint_id: int, cut: KeyedStateCut
    ) -> SnapshotFuture[KeyedHandle]:
        """Write ``cut`` in the background: incrementally if configured and possible,
        else in the full keyed format."""
        if self.shared is not None and cut.native is not None:
            return self._write_incremental(checkpoint_id, cut, self.shared)
        relative = self._new_file("keyed")

        def work(should_stop: ShouldStop) -> FullKeyedStateHandle:
            index: list[tuple[int, int, int]] = []
            # Frames are encoded on a producer thread while earlier ones are written; it
            # has ended when the block is left, before ``cut.release`` may run.
            with prefetched(encode_keyed_cut(cut, self.codec, index), PREFETCH_FRAMES) as frames:
                written = self._write_file(checkpoint_id, relative, frames, should_stop)
            return FullKeyedStateHandle(
                path=relative,
                size=written.size,
                checksum=written.checksum,
                key_group_range=cut.key_group_range,
                key_groups=tuple(index),
                states=tuple(cut.states),
                key_serializer=cut.key_serializer,
                compression=CODECS[self.codec],
                timers=cut.timers,
            )

        return SnapshotFuture(
            self.executor,
            work,
            cut.release,
            f"keyed snapshot {self.name} of checkpoint {checkpoint_id}",
            lambda _: self._discard(relative),
        )

    def _write_incremental(
        self, checkpoint_id: int, cut: KeyedStateCut, shared: SharedLocation
    ) -> SnapshotFuture[KeyedHandle]:
        uploaded: list[str] = []

        def work(should_stop: ShouldStop) -> KeyedHandle:
            return upload_native_checkpoint(
                self.filesystem,
                self.directory,
                self.name,
                shared,
                checkpoint_id,
                cut,
                self._stop(should_stop),
                self.upload_threads,
                uploaded,
                self._abandoned,
            )

        def discard(_: KeyedHandle) -> None:
            for path in uploaded:
                self.filesystem.delete(path)

        return SnapshotFuture(
            self.executor,
            work,
            cut.release,
            f"incremental keyed snapshot {self.name} of checkpoint {checkpoint_id}",
            discard,
        )

    def write_raw_keyed_snapshot(
        self, checkpoint_id: int, cut: RawKeyedStateCut
    ) -> SnapshotFuture[RawKeyedStateHandle]:
        """Write ``cut`` (a stream per key group, indexed) in the background."""
        relative = self._new_file("raw-keyed")

        def work(should_stop: ShouldStop) -> RawKeyedStateHandle:
            index: list[tuple[int, int, int]] = []
            chunks = encode_raw_keyed_cut(cut, self.codec, index)
            written = self._write_file(checkpoint_id, relative, chunks, should_stop)
            return RawKeyedStateHandle(
                path=relative,
                size=written.size,
                checksum=written.checksum,
                key_group_range=cut.key_group_range,
                key_groups=tuple(index),
                compression=CODECS[self.codec],
            )

        return SnapshotFuture(
            self.executor,
            work,
            lambda: None,
            f"raw keyed snapshot {self.name} of checkpoint {checkpoint_id}",
            lambda _: self._discard(relative),
        )

    def write_operator_snapshot(
        self, checkpoint_id: int, cut: OperatorStateCut
    ) -> SnapshotFuture[OperatorStateHandle]:
        """Write ``cut`` (inline in the handle when small) in the background."""
        relative = self._new_file("operator")

        def work(should_stop: ShouldStop) -> OperatorStateHandle:
            blob, states, raw = encode_operator_cut(cut)
            if len(blob) < INLINE_LIMIT:
                return OperatorStateHandle(None, len(blob), checksum(blob), states, raw, blob)
            written = self._write_file(checkpoint_id, relative, [blob], should_stop)
            return OperatorStateHandle(relative, written.size, written.checksum, states, raw)

        return SnapshotFuture(
            self.executor,
            work,
            lambda: None,
            f"operator snapshot {self.name} of checkpoint {checkpoint_id}",
            lambda handle: self._discard(handle.path),
        )
