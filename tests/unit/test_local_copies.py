"""``statebackend local-gc`` on real RocksDB copies in a local.dir: it lists and deletes
exactly the copies no task used for --older-than and no process holds, and a task
waiting for a copy's lock while it is removed locks the lock file that is there after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.cli import main
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import IntSerializer
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.tools.local_copies import READS, LocalCopy, acquire_lock, release_lock

DAY = 86400.0


def _make_copy(local_dir: Path, job: str, subtask: int, age_seconds: float) -> LocalCopy:
    """A copy as a keyed subtask leaves it: a RocksDB with data, its marker and lock
    file, last changed ``age_seconds`` ago."""
    copy = LocalCopy(local_dir / job / "op", subtask)
    backend = RocksDBKeyedStateBackend(
        copy.directory, max_parallelism=128, key_group_range=KeyGroupRange(0, 127)
    )
    count = backend.get_state(ValueStateDescriptor("count", IntSerializer(), default=0))
    backend.set_current_key("user")
    count.update(7)
    backend.close()
    copy.marker.write_text(json.dumps({"batch": 3}))
    fd = acquire_lock(copy)
    release_lock(fd)
    then = time.time() - age_seconds
    for path in (copy.marker, copy.lock, copy.directory, *copy.directory.iterdir()):
        os.utime(path, (then, then))
    return copy


def _holding(copy: LocalCopy) -> subprocess.Popen[str]:
    """Another process holding ``copy``'s lock (as a task of a running job does) until
    its stdin closes."""
    code = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(copy.lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_local_gc_deletes_only_idle_copies_no_task_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = tmp_path / "local"
    retired = _make_copy(local, "retired-job", 0, 9 * DAY)
    other = _make_copy(local, "retired-job", 1, 8 * DAY)
    recent = _make_copy(local, "running-job", 0, 1 * DAY)
    held = _make_copy(local, "held-job", 0, 30 * DAY)
    idle = {retired, other, held}  # older than the default 7 days
    expected = {copy.directory for copy in idle}

    assert main(["local-gc", str(local)]) == 0
    listed = capsys.readouterr().out
    assert {Path(line.split()[1]) for line in listed.splitlines()[:-1]} == expected
    assert listed.splitlines()[-1].startswith("3 local copies no task used for 604800 s")
    assert all(copy.directory.is_dir() for copy in (*idle, recent))  # only listed

    holder = _holding(held)
    try:
        assert main(["local-gc", str(local), "--apply"]) == 0
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    out = capsys.readouterr().out
    assert f"{held.directory}  (kept: a task holds it now)" in out
    assert out.splitlines()[-1].startswith("deleted 2 local copies")
    for copy in (retired, other):
        assert not copy.directory.exists() and not copy.marker.exists()
        assert not copy.lock.exists()
    assert not (local / "retired-job").exists()  # its emptied directories too
    assert recent.directory.is_dir() and recent.marker.exists()
    assert held.directory.is_dir() and held.marker.exists()

    assert main(["local-gc", str(local), "--older-than", "0", "--apply"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("deleted 2 local copies")
    assert list(local.iterdir()) == []


def test_local_gc_refuses_a_directory_that_is_not_one_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for given in (str(tmp_path / "missing"), "s3://bucket/local"):
        with pytest.raises(SystemExit) as exit_info:
            main(["local-gc", given])
        assert exit_info.value.code == 2
        assert f"{given!r} is not a directory on this host" in capsys.readouterr().err


def test_a_waiting_task_locks_the_lock_file_there_after_a_removal(tmp_path: Path) -> None:
    """A task waiting for the lock while the copy is removed (lock file unlinked) must not
    end up holding the unlinked file, beside another task holding the new one."""
    copy = LocalCopy(tmp_path / "job" / "op", 0)
    first = acquire_lock(copy)
    assert first is not None
    taken: list[int | None] = []
    waiter = threading.Thread(target=lambda: taken.append(acquire_lock(copy)))
    waiter.start()
    time.sleep(0.2)  # the waiter is blocked in flock on the file about to be unlinked
    copy.lock.unlink()
    release_lock(first)
    waiter.join(timeout=10)
    (second,) = taken
    assert second is not None
    try:
        assert os.fstat(second).st_ino == os.stat(copy.lock).st_ino
        assert acquire_lock(copy, wait=False) is None  # held, on the file that is there
    finally:
        release_lock(second)


def test_local_gc_says_how_long_each_copy_it_deletes_was_idle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The line of each copy gives the days since a task last used it, listed or
    deleted alike (not the time since the epoch of a copy already gone)."""
    local = tmp_path / "local"
    ages = {
        _make_copy(local, "retired-job", subtask, days * DAY): days
        for subtask, days in enumerate((9.0, 12.5))
    }
    for argv in (["local-gc", str(local)], ["local-gc", str(local), "--apply"]):
        assert main(argv) == 0
        lines = capsys.readouterr().out.splitlines()[:-1]
        said = {Path(line.split()[1]): line.split("for ")[1] for line in lines}
        assert said == {copy.directory: f"{days:.1f} days)" for copy, days in ages.items()}
    assert not local.exists() or list(local.iterdir()) == []


def test_local_gc_lists_a_killed_reads_downloads_apart_from_idle_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dry run's summary counts the idle copies as unused for --older-than and the
    downloads a killed read left (however recent) as such, not as unused for a week."""
    local = tmp_path / "local"
    _make_copy(local, "retired-job", 0, 9 * DAY)
    _make_copy(local, "running-job", 0, 1 * DAY)
    killed = LocalCopy(local / READS, 0)  # as a read killed a second ago leaves it
    (killed.directory / "state").mkdir(parents=True)
    (killed.directory / "state" / "000001.sst").write_bytes(bytes(1000))
    release_lock(acquire_lock(killed))

    assert main(["local-gc", str(local)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert any(line.endswith("(downloads of a read, 0.0 days old)") for line in lines)
    assert lines[-1].startswith(
        "1 local copies no task used for 604800 s and 1 download of a killed read, "
    )
    assert lines[-1].endswith("; run with --apply to delete them")
