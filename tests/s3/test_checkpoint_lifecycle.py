"""The lifecycle of a checkpoint against late uploads, stale acks, failures after
completion and a second driver, on file:// and s3://.

Real backends, storage and coordinators; failures are injected by a real
``CheckpointFileSystem`` that refuses chosen deletes and copies. Expectations come from
plain-Python models of the state (``Job.models``) and from listing the storage.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

import pytest

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import (
    CheckpointCancelledError,
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointFencedError,
)
from statebackend.keygroups import KeyGroupRange
from statebackend.state.interfaces import ValueState
from statebackend.tools.gc import find_garbage
from tests.conftest import Storage, raw_fs
from tests.s3 import test_checkpoint_storage as heap_jobs
from tests.s3 import test_incremental_checkpoints as incremental_jobs

WAIT = 20.0


class InjectedFailure(OSError):
    """What ``FlakyFileSystem`` raises instead of deleting or copying."""


class FlakyFileSystem(CheckpointFileSystem):
    """A checkpoint file system whose deletes and copies fail while ``failing(path)``."""

    def __init__(self, location: Storage) -> None:
        super().__init__(raw_fs(location))
        self.failing: Callable[[str], bool] = lambda path: False

    def delete(self, path: str, recursive: bool = False) -> None:
        """``CheckpointFileSystem.delete``, unless ``failing(path)``."""
        if self.failing(path):
            raise InjectedFailure(f"injected failure deleting {path}")
        super().delete(path, recursive)

    def copy(self, src: str, dst: str) -> None:
        """``CheckpointFileSystem.copy``, unless ``failing(dst)``."""
        if self.failing(dst):
            raise InjectedFailure(f"injected failure copying to {dst}")
        super().copy(src, dst)


def flaky_heap_job(location: Storage, **options: object) -> tuple[heap_jobs.Job, FlakyFileSystem]:
    """A heap job (``test_checkpoint_storage``) whose file system fails on demand."""
    fs = FlakyFileSystem(location)
    job = heap_jobs.new_job(location, **options)
    job.storage.fs = fs
    return job, fs


def names(paths: Iterable[str]) -> set[str]:
    """The last names of ``paths``."""
    return {path.rstrip("/").rsplit("/", 1)[-1] for path in paths}


# -- defect 2: an abort reaches the uploads; late ones leave nothing -----------------------------


def test_an_abort_mid_upload_leaves_no_file_outside_retained_checkpoints(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """Two subtasks upload checkpoint 2; one is held in the middle of a shared file when
    the coordinator aborts 2. Once let go, neither its upload nor its ack recreates
    anything: chk-2 is gone and no file of the job is unreferenced, before and after
    the next checkpoint completes."""
    fs = incremental_jobs.SharedGateFileSystem(checkpoint_url)
    job = incremental_jobs.new_job(checkpoint_url, tmp_path / "local", parallelism=2, fs=fs)
    try:
        job.write(3000)
        job.checkpoint()
        job.write(3000)
        fs.shared_writes, fs.shared_allowed = 0, 1
        checkpoint_id = job.coordinator.trigger({incremental_jobs.OPERATOR: 2})
        futures = job.snapshot(checkpoint_id)
        assert fs.holding.wait(WAIT)
        job.coordinator.abort(checkpoint_id)
        fs.shared_allowed = None
        fs.gate.set()
        for subtask, future in enumerate(futures):  # what a worker's upload callback does
            try:
                handle = future.result(WAIT)
            except CheckpointCancelledError:
                continue
            ack = SubtaskAck(
                incremental_jobs.OPERATOR, subtask, 2, handle, None, job.coordinator.run_id
            )
            job.storage.write_ack(checkpoint_id, ack)

        job_dir = job.storage.layout.job_dir
        # A local file system may keep the directory, emptied: nothing is in it.
        assert heap_jobs.files_under(checkpoint_url, job.storage.resolve(checkpoint_id)) == {}
        assert find_garbage(job.storage.fs, job_dir) == []
        after = job.checkpoint()
        assert job.storage.checkpoint_ids() == [1, after]
        assert find_garbage(job.storage.fs, job_dir) == []
        restored = incremental_jobs.restore(job.storage.fs, job.storage.resolve(after), 3, tmp_path)
        assert restored == job.models[after]
    finally:
        job.close()


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_an_upload_whose_directory_an_abort_deletes_is_cancelled(
    tmp_path: Path, incremental: bool
) -> None:
    """The abort lands between an upload's (rate-limited) looks at it and deletes the
    checkpoint's directory: the upload's next file cannot be opened there, and the upload
    ends as cancelled (not as a broken or corrupted checkpoint) leaving nothing behind."""
    storage = CheckpointStorage(tmp_path.as_uri(), "job", incremental=incremental)
    coordinator = CheckpointCoordinator(storage, max_parallelism=heap_jobs.M)
    backend = RocksDBKeyedStateBackend(
        tmp_path / "local", max_parallelism=heap_jobs.M, key_group_range=KeyGroupRange(0, 127)
    )
    try:
        count = cast(ValueState, backend.get_state(incremental_jobs.COUNT))
        for key in range(200):
            backend.set_current_key(f"key-{key}")
            count.update(key)
        checkpoint_id = coordinator.trigger({incremental_jobs.OPERATOR: 1})
        target = storage.snapshot_target(
            checkpoint_id, incremental_jobs.OPERATOR, 0, coordinator.run_id
        )
        coordinator.abort(checkpoint_id)
        directory = Path(storage.layout.checkpoint_path(checkpoint_id).removeprefix("file://"))
        directory.write_bytes(b"")  # nothing can be opened under it any more
        future = backend.snapshot(checkpoint_id, target)
        with pytest.raises(CheckpointCancelledError, match="aborted"):
            future.result(WAIT)
        directory.unlink()
        assert find_garbage(storage.fs, storage.layout.job_dir) == []
    finally:
        backend.dispose()
        storage.close()


def test_retention_deletes_the_shared_files_of_an_ack_that_raced_the_abort(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """An ack that reaches an aborted checkpoint's directory anyway (written the moment
    before the abort): its shared files are deleted once a later checkpoint completes."""
    job = incremental_jobs.new_job(checkpoint_url, tmp_path / "local")
    try:
        job.write(2000)
        job.checkpoint()
        job.write(2000)
        raced = job.coordinator.trigger({incremental_jobs.OPERATOR: 1})
        (future,) = job.snapshot(raced)
        ack = SubtaskAck(
            incremental_jobs.OPERATOR, 0, 1, future.result(WAIT), None, job.coordinator.run_id
        )
        job.coordinator.abort(raced)
        job.storage.fs.write_atomic(  # the ack's PUT lands after the abort
            job.storage.layout.ack_path(raced, ack.operator_id, ack.subtask),
            json.dumps(ack.to_json()).encode(),
        )
        job.write(2000)
        job.checkpoint()
        assert raced not in job.storage.checkpoint_ids()
        assert find_garbage(job.storage.fs, job.storage.layout.job_dir) == []
    finally:
        job.close()


# -- defect 3: ids are never reused; acks of another run are ignored ------------------------------


def test_a_new_run_never_reuses_an_aborted_id_nor_takes_an_old_runs_ack(
    checkpoint_url: Storage,
) -> None:
    """Run 1 aborts checkpoint 2 (its directory deleted) while its subtasks still upload.
    Run 2 numbers on at 3; run 1's late ack of 2 is not written, and one that names run 1
    inside run 2's checkpoint is ignored: the checkpoint completes only with run 2's
    acks, and restores run 2's state."""
    job = heap_jobs.new_job(checkpoint_url)
    try:
        job.checkpoint()
        old_run = job.coordinator.run_id
        aborted = job.coordinator.trigger({heap_jobs.OPERATOR: heap_jobs.P})
        job.coordinator.abort(aborted)
        assert aborted == 2 and job.storage.checkpoint_ids() == [1]

        job.coordinator = CheckpointCoordinator(
            job.storage, max_parallelism=heap_jobs.M, clock=job.clock
        )
        job.process()
        checkpoint_id = job.coordinator.trigger({heap_jobs.OPERATOR: heap_jobs.P})
        assert checkpoint_id == 3
        late = SubtaskAck(heap_jobs.OPERATOR, 0, heap_jobs.P, None, None, old_run)
        assert not job.storage.write_ack(aborted, late)
        assert aborted not in job.storage.checkpoint_ids()

        stale = [
            SubtaskAck(heap_jobs.OPERATOR, i, heap_jobs.P, None, None, old_run) for i in (0, 1)
        ]
        for ack in stale:
            assert job.storage.write_ack(checkpoint_id, ack)
            assert job.coordinator.acknowledge(checkpoint_id, ack) is None
        assert job.coordinator.poll(checkpoint_id) is None
        assert len(job.coordinator.pending[checkpoint_id].missing()) == heap_jobs.P

        job.snapshot_and_ack(checkpoint_id)
        job.remember(checkpoint_id)
        assert job.coordinator.poll(checkpoint_id) is not None
        heap_jobs.assert_restores(job, checkpoint_id)
    finally:
        job.close()


def test_ids_stay_unique_when_every_directory_is_gone(checkpoint_url: Storage) -> None:
    """The high-water mark outlives the checkpoint directories: a coordinator that finds
    none numbers on after the highest id ever triggered."""
    job = heap_jobs.new_job(checkpoint_url)
    try:
        job.checkpoint()
        job.checkpoint()
        for checkpoint_id in job.storage.checkpoint_ids():
            job.storage.discard(checkpoint_id)
        restarted = CheckpointCoordinator(job.storage, max_parallelism=heap_jobs.M)
        assert restarted.trigger({heap_jobs.OPERATOR: heap_jobs.P}) == 3
    finally:
        job.close()


def test_a_cut_short_checkpoint_id_mark_is_one_clear_error(checkpoint_url: Storage) -> None:
    """``_checkpoint_id`` left empty (a crash while writing it, on a file system that
    does not sync before renaming) is a CheckpointCorruptedError naming it and what to
    write into it, not a ValueError from int(); a valid id there lets the job go on."""
    job = heap_jobs.new_job(checkpoint_url)
    try:
        job.checkpoint()
        mark = job.storage.layout.checkpoint_id_path
        job.storage.fs.write_atomic(mark, b"")
        with pytest.raises(CheckpointCorruptedError, match="_checkpoint_id holds b'', not a"):
            job.coordinator.trigger({heap_jobs.OPERATOR: heap_jobs.P})
        job.storage.fs.write_atomic(mark, b"101")
        assert job.checkpoint()[0] == 102
    finally:
        job.close()


def test_metadata_is_never_overwritten(checkpoint_url: Storage) -> None:
    """Completing a checkpoint that has ``_metadata`` already fails and leaves it as it was."""
    job = heap_jobs.new_job(checkpoint_url)
    try:
        checkpoint_id, _ = job.checkpoint()
        metadata = job.storage.load(checkpoint_id)
        before = job.storage.fs.read_file(job.storage.layout.metadata_path(checkpoint_id))
        with pytest.raises(CheckpointError, match="exists already"):
            job.storage.complete(metadata)
        assert job.storage.fs.read_file(job.storage.layout.metadata_path(checkpoint_id)) == before
    finally:
        job.close()


# -- defects 4 and 5: once _metadata is written, the checkpoint is complete -----------------------


def test_a_failing_discard_of_older_checkpoints_is_retried_not_an_abort(
    checkpoint_url: Storage,
) -> None:
    """With one checkpoint retained, deleting the older one fails when 2 completes: 2 is
    still reported complete and restores; the discard is retried at the next poll."""
    job, fs = flaky_heap_job(checkpoint_url, retained=1)
    try:
        job.checkpoint()
        older = job.storage.layout.checkpoint_path(1)
        fs.failing = lambda path: path.rstrip("/") == older
        checkpoint_id, directory = job.checkpoint()
        assert directory == job.storage.layout.checkpoint_path(checkpoint_id)
        # _metadata went first: 1 is no completed checkpoint any more, its files stay
        assert job.storage.completed_checkpoint_ids() == [checkpoint_id]
        assert job.storage.checkpoint_ids() == [1, checkpoint_id]
        heap_jobs.assert_restores(job, checkpoint_id)

        fs.failing = lambda path: False
        third, _ = job.checkpoint()
        assert job.storage.checkpoint_ids() == [third]
        heap_jobs.assert_restores(job, third)
    finally:
        job.close()


def test_a_fenced_coordinator_discards_nothing(checkpoint_url: Storage) -> None:
    """A discard that failed is retried at the next trigger, but not by a coordinator
    another driver took the job from: it raises CheckpointFencedError first, and the
    checkpoint it would have discarded stays complete."""
    job, fs = flaky_heap_job(checkpoint_url, retained=1)
    try:
        job.checkpoint()
        older = job.storage.layout.checkpoint_path(1)
        fs.failing = lambda path: path.startswith(older)
        job.checkpoint()
        assert job.storage.completed_checkpoint_ids() == [1, 2]
        fs.failing = lambda path: False
        CheckpointCoordinator(job.storage, max_parallelism=heap_jobs.M).check_leader()
        with pytest.raises(CheckpointFencedError):
            job.coordinator.trigger({heap_jobs.OPERATOR: heap_jobs.P})
        assert job.storage.completed_checkpoint_ids() == [1, 2]
        heap_jobs.assert_restores(job, 1)
    finally:
        job.close()


def test_a_failing_savepoint_copy_leaves_the_checkpoint_complete(
    checkpoint_url: Storage,
) -> None:
    """Copying the completed checkpoint to its savepoint fails: the error says so, the
    coordinator reports the checkpoint as completed, and it restores."""
    job, fs = flaky_heap_job(checkpoint_url)
    try:
        job.checkpoint()
        savepoint = f"{job.storage.layout.savepoints_dir}/broken"
        fs.failing = lambda path: path.startswith(savepoint)
        with pytest.raises(CheckpointError, match="completed .* but copying it"):
            job.checkpoint(savepoint_dir=savepoint)
        assert job.coordinator.last_completed_id == 2
        assert job.coordinator.pending == {}
        assert job.storage.completed_checkpoint_ids() == [1, 2]
        heap_jobs.assert_restores(job, 2)
    finally:
        job.close()


def test_a_failing_removal_of_the_acks_never_deletes_the_completed_checkpoint(
    checkpoint_url: Storage,
) -> None:
    """Removing the acks after ``_metadata`` was written fails: the checkpoint is still
    complete and restores, later checkpoints go on, and the removal is retried."""
    job, fs = flaky_heap_job(checkpoint_url)
    try:
        fs.failing = lambda path: path.rstrip("/").endswith("/acks")
        first, directory = job.checkpoint()
        assert directory == job.storage.layout.checkpoint_path(first)
        assert job.storage.completed_checkpoint_ids() == [first]
        heap_jobs.assert_restores(job, first)
        assert "acks" in names(job.storage.fs.list_dir(directory))

        fs.failing = lambda path: False
        second, _ = job.checkpoint()
        assert job.storage.completed_checkpoint_ids() == [first, second]
        assert "acks" not in names(job.storage.fs.list_dir(directory))
        heap_jobs.assert_restores(job, first)
        heap_jobs.assert_restores(job, second)
    finally:
        job.close()


# -- fencing ------------------------------------------------------------------------------------


def test_a_new_coordinator_fences_the_old_one(checkpoint_url: Storage) -> None:
    """A second coordinator on the job directory fences the first: its pending
    checkpoint cannot complete, its next trigger fails, and the second one goes on."""
    job = heap_jobs.new_job(checkpoint_url)
    try:
        job.checkpoint()
        zombie = job.coordinator
        pending = zombie.trigger({heap_jobs.OPERATOR: heap_jobs.P})
        job.snapshot_and_ack(pending)

        job.coordinator = CheckpointCoordinator(
            job.storage, max_parallelism=heap_jobs.M, clock=job.clock
        )
        assert zombie.epoch is not None
        # The new coordinator claims at its first trigger (here: at once), fencing the old.
        assert job.coordinator.claim_leadership() == zombie.epoch + 1
        with pytest.raises(CheckpointFencedError, match="another driver .* took over"):
            zombie.poll(pending)
        assert not job.storage.is_completed(pending)
        with pytest.raises(CheckpointFencedError):
            zombie.trigger({heap_jobs.OPERATOR: heap_jobs.P})
        checkpoint_id, _ = job.checkpoint()
        assert checkpoint_id == pending + 1
        heap_jobs.assert_restores(job, checkpoint_id)
    finally:
        job.close()


def test_a_takeover_between_reading_and_writing_the_id_mark_fences_the_old_driver(
    checkpoint_url: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new driver claims the job and triggers checkpoint N while the old one has read
    the id mark but not yet written it: both chose N. The old one is fenced right after
    marking N pending, before anything of N runs, and an abort of N by it deletes
    nothing: the new driver's N completes and restores. Before, the old driver went on
    with N, timed out waiting for acks the new one had cleaned up, and its abort deleted
    the new driver's completed checkpoint."""
    job = heap_jobs.new_job(checkpoint_url)
    try:
        job.checkpoint()
        old = job.coordinator
        new = CheckpointCoordinator(job.storage, max_parallelism=heap_jobs.M, clock=job.clock)
        read_mark = job.storage.checkpoint_id_mark
        taken = []

        def mark_read_then_takeover() -> int:
            mark = read_mark()
            monkeypatch.setattr(job.storage, "checkpoint_id_mark", read_mark)
            taken.append(new.trigger({heap_jobs.OPERATOR: heap_jobs.P}))
            return mark

        monkeypatch.setattr(job.storage, "checkpoint_id_mark", mark_read_then_takeover)
        with pytest.raises(CheckpointFencedError):
            old.trigger({heap_jobs.OPERATOR: heap_jobs.P})
        (checkpoint_id,) = taken
        assert checkpoint_id not in old.pending
        job.coordinator = new
        job.process()
        job.snapshot_and_ack(checkpoint_id)
        job.remember(checkpoint_id)
        assert new.poll(checkpoint_id) is not None
        old.abort(checkpoint_id)  # as its tracker does when it gives up on N
        assert job.storage.is_completed(checkpoint_id)
        heap_jobs.assert_restores(job, checkpoint_id)
    finally:
        job.close()


_DRIVER = textwrap.dedent(
    """
    import json, os, sys, time
    from statebackend.checkpoint.coordinator import CheckpointCoordinator
    from statebackend.checkpoint.metadata import SubtaskAck
    from statebackend.checkpoint.storage import CheckpointStorage
    from statebackend.errors import CheckpointFencedError

    url, options, name, started, go = sys.argv[1], json.loads(sys.argv[2]), *sys.argv[3:]
    storage = CheckpointStorage(url, "job", storage_options=options)
    coordinator = CheckpointCoordinator(storage, max_parallelism=128)
    open(started, "w").close()
    completed = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            checkpoint_id = coordinator.trigger({"op": 1}, properties={"driver": name})
            storage.write_ack(
                checkpoint_id, SubtaskAck("op", 0, 1, None, None, coordinator.run_id)
            )
            if coordinator.poll(checkpoint_id) is not None:
                completed.append(checkpoint_id)
        except CheckpointFencedError as exc:
            print(json.dumps({"completed": completed, "fenced": str(exc)}))
            sys.exit(3)
        if len(completed) >= 3 and os.path.exists(go):
            break
        time.sleep(0.05)
    print(json.dumps({"completed": completed, "fenced": None}))
    """
)


def test_two_driver_processes_on_one_directory(checkpoint_url: Storage, tmp_path: Path) -> None:
    """Driver A checkpoints in a loop; driver B starts on the same job directory. A's
    next checkpoint fails with a fencing error naming the takeover and A stops; B's
    checkpoints go on. Every completed checkpoint has a distinct id, and those after
    B started are B's."""

    def start(name: str) -> tuple[subprocess.Popen[str], Path]:
        started = tmp_path / f"{name}.started"
        command = [
            sys.executable,
            "-c",
            _DRIVER,
            checkpoint_url.url,
            json.dumps(checkpoint_url.storage_options),
            name,
            str(started),
            str(tmp_path / "go"),
        ]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True), started

    def wait_for(path: Path) -> None:
        for _ in range(600):
            if path.exists():
                return
            time.sleep(0.05)
        raise AssertionError(f"{path} never appeared")

    a, a_started = start("a")
    wait_for(a_started)
    time.sleep(1.0)  # A completes a few checkpoints alone
    b, b_started = start("b")
    wait_for(b_started)
    a_out, _ = a.communicate(timeout=90)
    (tmp_path / "go").touch()
    b_out, _ = b.communicate(timeout=90)

    a_result, b_result = json.loads(a_out), json.loads(b_out)
    assert a.returncode == 3 and "took over" in a_result["fenced"]
    assert b.returncode == 0 and b_result["fenced"] is None
    assert a_result["completed"] and len(b_result["completed"]) >= 3
    assert not set(a_result["completed"]) & set(b_result["completed"])
    assert max(a_result["completed"]) < min(b_result["completed"])
    storage = heap_jobs.CheckpointStorage(
        checkpoint_url.url, "job", storage_options=checkpoint_url.storage_options
    )
    for checkpoint_id in storage.completed_checkpoint_ids():
        driver = storage.load(checkpoint_id).properties["driver"]
        assert driver == ("a" if checkpoint_id in a_result["completed"] else "b")
