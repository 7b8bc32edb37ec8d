"""``SnapshotFuture.cancel()`` returning True means no handle and nothing left behind,
even when the cancel lands while the last file is being committed (defect 7).

The storage is a real ``CheckpointFileSystem`` whose ``write_file`` completes the file
and then, for the last file of the snapshot, waits at a gate before returning: the
window in which the asynchronous part has passed its last ``should_stop`` check.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.operator import OperatorStateBackend
from statebackend.backends.raw_keyed import RawKeyedState
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.filesystem import CheckpointFileSystem, WrittenFile
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointCancelledError
from statebackend.serializers import IntSerializer
from statebackend.snapshot.handles import INLINE_LIMIT
from tests.conftest import Storage, raw_fs
from tests.s3.test_snapshot_async import OPERATOR, WAIT, cut_dirs, make_backend, write_state


class CommitGateFileSystem(CheckpointFileSystem):
    """Holds the ``hold_at``-th completed write (1-based) at ``gate`` before it returns;
    no write starts before ``start`` is set."""

    def __init__(self, location: Storage) -> None:
        super().__init__(raw_fs(location))
        self.hold_at = 1
        self.completed = 0
        self.start = threading.Event()
        self.gate = threading.Event()
        self.holding = threading.Event()
        self._count = threading.Lock()

    def write_file(
        self,
        path: str,
        chunks: Iterable[bytes],
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> WrittenFile:
        assert self.start.wait(WAIT), "the test never started the writes"
        written = super().write_file(path, chunks, should_stop=should_stop)
        with self._count:
            self.completed += 1
            hold = self.completed == self.hold_at
        if hold:
            self.holding.set()
            assert self.gate.wait(WAIT), "the test never opened the gate"
        return written


def stored_files(location: Storage, directory: str) -> list[str]:
    """Every file stored below ``directory`` of the location."""
    fs = raw_fs(location)
    fs.invalidate_cache()
    return sorted(fs.find(fs._strip_protocol(directory)))


@pytest.mark.parametrize("snapshot", ["full", "incremental", "operator", "raw-keyed"])
def test_cancel_while_the_last_file_commits_leaves_nothing(
    checkpoint_url: Storage, snapshot: str, tmp_path: Path
) -> None:
    fs = CommitGateFileSystem(checkpoint_url)
    storage = CheckpointStorage(
        checkpoint_url.url,
        "job",
        storage_options=checkpoint_url.storage_options,
        filesystem=fs,
        incremental=snapshot == "incremental",
        transfer_threads=1,
    )
    backend = make_backend("heap" if snapshot == "full" else "rocksdb", tmp_path / "db")
    write_state(backend, {}, random.Random(5), 3000)
    target = storage.snapshot_target(1, OPERATOR, 0)
    future: Any
    if snapshot == "operator":
        operator_state = OperatorStateBackend()
        operator_state.get_list_state("big", IntSerializer()).add_all(range(20_000))
        future = target.write_operator_snapshot(1, operator_state.sync_cut())
    elif snapshot == "raw-keyed":
        raw = RawKeyedState(backend.key_group_range)
        raw.write(backend.key_group_range.start, b"raw bytes" * 1000)
        future = target.write_raw_keyed_snapshot(1, raw.sync_cut())
    else:
        future = backend.snapshot(1, target)
        if isinstance(backend, RocksDBKeyedStateBackend):
            (cut,) = cut_dirs(backend.local_dir)
            native = [p for p in (backend.local_dir / cut).rglob("*") if p.is_file()]
            # every file of the native checkpoint is new; the small private ones are inline
            stored = [p for p in native if p.suffix == ".sst" or p.stat().st_size >= INLINE_LIMIT]
            fs.hold_at = len(stored)
    fs.start.set()

    assert fs.holding.wait(WAIT)  # the last file is complete; the handle is not returned
    assert future.cancel() is True
    fs.gate.set()
    with pytest.raises(CheckpointCancelledError):
        future.result(WAIT)
    assert stored_files(checkpoint_url, storage.layout.job_dir) == []
    if isinstance(backend, RocksDBKeyedStateBackend):
        # Only the upload records remain (reused only once their checkpoint completed).
        assert cut_dirs(backend.local_dir) in ([], ["incremental"])
    assert future.cancel() is True  # still cancelled, and still nothing
    backend.dispose()
    storage.close()
