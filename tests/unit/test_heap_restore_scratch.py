"""Where a heap subtask of the Spark runtime downloads an incremental checkpoint it
rebuilds from: a Python worker killed mid-restore leaves its downloads behind, and the
next rebuild of a subtask of that job removes them."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.serializers import StrSerializer
from statebackend.snapshot.handles import resolve_path
from statebackend.snapshot.incremental import IncrementalKeyedStateHandle
from statebackend.spark.local_state import LocalVersion, local_keyed_state
from tests.scripts import REPO
from tests.unit.test_bulk_restore import OPERATOR, M, checkpoint, read_model

_RESTORER = """
import sys
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.serializers import StrSerializer
from statebackend.spark.local_state import LocalVersion, local_keyed_state
from pathlib import Path

storage_dir, restore_dir, root = sys.argv[1:]
storage = CheckpointStorage(storage_dir, "job")
version = LocalVersion("g1", None, restore_dir, 1, 128)
with local_keyed_state(Path(root), 0, version, storage, "op", StrSerializer(), "heap"):
    pass
"""
"""A Python worker rebuilding heap subtask 0 of 1 of job ``job`` from ``restore_dir``."""


def _stored_file(storage: CheckpointStorage, directory: str) -> Path:
    """The local path of the last stored (not inline) file of the checkpoint's
    incremental handles."""
    handles = storage.load(directory).operators[OPERATOR].keyed_handles()
    files = [
        resolve_path(directory, str(f.path))
        for handle in handles
        if isinstance(handle, IncrementalKeyedStateHandle)
        for f in (*handle.shared, *handle.private)
        if f.path is not None
    ]
    return Path(files[-1].removeprefix("file://"))


def _writer_when_read(fifo: Path, worker: subprocess.Popen[bytes]) -> int:
    """A write end of ``fifo`` once ``worker`` opened it to read (it is mid-restore)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and worker.poll() is None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
        time.sleep(0.05)
    raise AssertionError(f"the worker never read {fifo} (exit code {worker.poll()})")


def test_a_restore_killed_midway_leaves_nothing_after_the_next_rebuild(tmp_path: Path) -> None:
    """A worker rebuilding a heap subtask from an incremental checkpoint is killed
    (SIGKILL) while it downloads a file (a FIFO standing for it blocks the read); the next
    rebuild of the subtask, in another process, restores every entry (the plain-Python
    model) and leaves neither the system's temp directory nor the local directory
    holding downloads."""
    storage, directory, model = checkpoint(tmp_path, incremental=True)
    stored = _stored_file(storage, directory)
    content = stored.read_bytes()
    stored.unlink()
    os.mkfifo(stored)
    temp, root = tmp_path / "tmp", tmp_path / "local" / "job" / "op"
    temp.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(temp),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    storage_dir = storage.layout.checkpoint_dir
    worker = subprocess.Popen(
        [sys.executable, "-c", _RESTORER, storage_dir, directory, str(root)], env=env
    )
    try:
        writer = _writer_when_read(stored, worker)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=60)
    os.close(writer)  # after the kill: the worker never sees the file end
    assert worker.returncode == -signal.SIGKILL
    stored.unlink()
    stored.write_bytes(content)

    version = LocalVersion("g2", None, directory, 1, M)
    with local_keyed_state(root, 0, version, storage, OPERATOR, StrSerializer(), "heap") as local:
        assert local.rebuilt and local.backend is not None
        assert read_model(local.backend) == model
    assert sorted(temp.iterdir()) == []
    assert sorted(root.iterdir()) == []
    storage.close()
