"""Where snapshots are written: a directory on a checkpoint file system."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any, Protocol

from statebackend.backends.keyed import KeyedStateCut
from statebackend.backends.operator import OperatorStateCut
from statebackend.checksums import checksum
from statebackend.snapshot.frames import CODECS, check_codec
from statebackend.snapshot.future import ShouldStop, SnapshotFuture
from statebackend.snapshot.keyed_format import KeyedStateHandle, encode_keyed_cut
from statebackend.snapshot.operator_format import (
    INLINE_LIMIT,
    OperatorStateHandle,
    encode_operator_cut,
)


class SnapshotFileSystem(Protocol):
    """What snapshots need of a file system (``checkpoint.filesystem`` provides it)."""

    def write_file(
        self, path: str, chunks: Iterable[bytes], *, should_stop: Callable[[], bool] | None = None
    ) -> Any:
        """Stream chunks to a new file; return an object with ``size`` and ``checksum``;
        leave nothing behind if stopped or failed."""

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``path`` from ``start``."""


class SnapshotDirectory:
    """Writes the snapshots of one (operator, subtask) into one checkpoint directory.

    File names are ``<name>-<kind>-<random>``, relative to ``directory``, so that a
    retried or concurrent snapshot never overwrites another's file.
    """

    def __init__(
        self,
        filesystem: SnapshotFileSystem,
        directory: str,
        name: str,
        executor: Executor,
        compression: str = "none",
    ) -> None:
        self.filesystem = filesystem
        self.directory = directory.rstrip("/")
        self.name = name
        self.executor = executor
        self.codec = check_codec(compression)

    def _new_file(self, kind: str) -> str:
        return f"{self.name}-{kind}-{uuid.uuid4().hex[:12]}"

    def write_keyed_snapshot(
        self, checkpoint_id: int, cut: KeyedStateCut
    ) -> SnapshotFuture[KeyedStateHandle]:
        """Write ``cut`` in the full keyed format in the background."""
        relative = self._new_file("keyed")

        def work(should_stop: ShouldStop) -> KeyedStateHandle:
            index: list[tuple[int, int, int]] = []
            written = self.filesystem.write_file(
                f"{self.directory}/{relative}",
                encode_keyed_cut(cut, self.codec, index),
                should_stop=should_stop,
            )
            return KeyedStateHandle(
                path=relative,
                size=written.size,
                checksum=written.checksum,
                key_group_range=cut.key_group_range,
                key_groups=tuple(index),
                states=tuple(cut.states),
                key_serializer=cut.key_serializer,
                compression=CODECS[self.codec],
            )

        return SnapshotFuture(
            self.executor,
            work,
            cut.release,
            f"keyed snapshot {self.name} of checkpoint {checkpoint_id}",
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
            written = self.filesystem.write_file(
                f"{self.directory}/{relative}", [blob], should_stop=should_stop
            )
            return OperatorStateHandle(relative, written.size, written.checksum, states, raw)

        return SnapshotFuture(
            self.executor,
            work,
            lambda: None,
            f"operator snapshot {self.name} of checkpoint {checkpoint_id}",
        )
