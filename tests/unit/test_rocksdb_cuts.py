"""The ``cut-*`` directories of RocksDB snapshots in a subtask's local directory: a
reopened backend removes those a dead process left, never one still being uploaded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import IntSerializer
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState
from tests.scripts import REPO

M = 128
FULL_RANGE = KeyGroupRange(0, M - 1)
COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)

_CUTTER = """
import sys
from pathlib import Path
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import IntSerializer
from statebackend.state.descriptors import ValueStateDescriptor

backend = RocksDBKeyedStateBackend(
    Path(sys.argv[1]), open_existing=True, max_parallelism=128,
    key_group_range=KeyGroupRange(0, 127),
)
backend.get_state(ValueStateDescriptor("count", IntSerializer(), default=0))
cut = backend.sync_cut()  # as a snapshot's synchronous part; its upload would follow
backend.close()  # the next batch may reopen the database while the upload runs
print(flush=True)
sys.stdin.read()  # an upload that does not end
"""
"""A Python worker that cuts a snapshot of the database in ``argv[1]`` and is still
uploading it: it holds its cut until it is killed."""


def open_backend(directory: Path, open_existing: bool = True) -> RocksDBKeyedStateBackend:
    return RocksDBKeyedStateBackend(
        directory, open_existing=open_existing, max_parallelism=M, key_group_range=FULL_RANGE
    )


def cut_dirs(directory: Path) -> set[str]:
    return {path.name for path in directory.glob("cut-*")}


def database_with_state(directory: Path) -> None:
    backend = open_backend(directory, open_existing=False)
    state = backend.get_state(COUNT)
    assert isinstance(state, ValueState)
    backend.set_current_key("alice")
    state.update(7)
    backend.close()


def test_a_reopen_removes_the_cut_of_a_killed_process_and_keeps_a_live_ones(
    tmp_path: Path,
) -> None:
    """A worker killed (SIGKILL) mid-upload leaves its cut; the next backend that opens
    the database removes it, but not while that worker still lived (its upload may still
    read the cut)."""
    directory = tmp_path / "subtask-0"
    database_with_state(directory)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    worker = subprocess.Popen(
        [sys.executable, "-c", _CUTTER, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "\n"
        left = cut_dirs(directory)
        assert len(left) == 1
        open_backend(directory).close()
        assert cut_dirs(directory) == left  # its worker lives: kept
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=60)
    assert worker.returncode == -signal.SIGKILL
    assert cut_dirs(directory) == left  # a killed worker removes nothing itself
    backend = open_backend(directory)
    assert cut_dirs(directory) == set()
    state = backend.get_state(COUNT)
    assert isinstance(state, ValueState)
    backend.set_current_key("alice")
    assert state.value() == 7
    backend.close()


def test_a_reopen_in_the_same_process_keeps_a_cut_until_its_release(tmp_path: Path) -> None:
    """The closer thread and the next batch share a Python worker: a reopen there must
    not remove the cut the previous batch's upload still reads."""
    directory = tmp_path / "subtask-0"
    database_with_state(directory)
    backend = open_backend(directory)
    backend.get_state(COUNT)
    cut = backend.sync_cut()
    backend.close()
    (name,) = cut_dirs(directory)
    reopened = open_backend(directory)
    assert cut_dirs(directory) == {name}
    cut.release()
    assert cut_dirs(directory) == set()
    reopened.close()
