"""``statebackend gc`` against a job that is checkpointing, one rule at a time, on file://
and s3://.

Real RocksDB backends checkpoint incrementally through a real coordinator and storage
(the harness of ``test_incremental_checkpoints``); gc must keep every file a completed,
pending or future checkpoint uses: files younger than the grace period, files a pending
checkpoint's acknowledgements reference, shared files written since the newest completed
checkpoint was triggered (an incremental snapshot uploads those before its ``chk-<N>``
exists), and anything that changed between deciding and deleting. Expectations come from
the plain-Python model of the state and from the files the test itself wrote.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fsspec.utils import get_protocol

from statebackend.checkpoint.filesystem import CheckpointFileSystem, WrittenFile, open_filesystem
from statebackend.checkpoint.layout import join
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.requests import (
    REQUESTS_DIR,
    answer_savepoint_request,
    pending_savepoint_requests,
    request_savepoint,
)
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata
from statebackend.cli import main
from statebackend.errors import CheckpointCorruptedError, CheckpointError
from statebackend.snapshot.handles import resolve_path
from statebackend.tools.gc import DEFAULT_GRACE_SECONDS, delete_garbage, find_garbage
from statebackend.tools.location import CheckpointRef
from statebackend.tools.verify import verify_checkpoint
from tests.conftest import Storage, raw_fs
from tests.s3.test_incremental_checkpoints import (
    OPERATOR,
    WAIT,
    Job,
    new_job,
    restore,
)

FAR_FUTURE = 10.0**10
"""A ``now`` at which every file is older than any grace period used here."""


def settle(location: Storage) -> None:
    """Wait until a file written now has a later modification time than one written
    before (s3 keeps whole seconds)."""
    time.sleep(1.1 if get_protocol(location.url) == "s3" else 0.02)


class PrivateGateFileSystem(CheckpointFileSystem):
    """A checkpoint file system that, once ``closed`` is set, holds every write into a
    ``chk-<N>`` directory until ``gate`` is set (``holding`` says one waits), and counts
    the shared files it wrote."""

    def __init__(self, location: Storage) -> None:
        super().__init__(raw_fs(location))
        self.closed = threading.Event()
        self.gate = threading.Event()
        self.holding = threading.Event()
        self.shared_written = 0

    def write_file(
        self,
        path: str,
        chunks: Iterable[bytes],
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> WrittenFile:
        """``CheckpointFileSystem.write_file``, held as configured."""
        if "/chk-" in path and self.closed.is_set():
            self.holding.set()
            assert self.gate.wait(WAIT), "the test never opened the gate"
        written = super().write_file(path, chunks, should_stop=should_stop)
        if "/shared/" in path:
            self.shared_written += 1
        return written


@pytest.fixture
def job(checkpoint_url: Storage, tmp_path: Path) -> Iterator[Job]:
    """The one-subtask job on file:// and on s3://."""
    created = new_job(checkpoint_url, tmp_path / "local")
    yield created
    created.close()


def job_dir(job: Job) -> str:
    """The job's directory."""
    return job.storage.layout.job_dir


def shared_file(job: Job, name: str) -> str:
    """Write a shared file no checkpoint references (a crashed upload's); its path."""
    path = job.storage.layout.shared_path(name)
    job.storage.fs.write_atomic(path, b"left behind by a crashed upload")
    return path


def listed(job: Job, **options: float) -> set[str]:
    """The paths ``find_garbage`` lists for the job."""
    return {g.path for g in find_garbage(job.storage.fs, job_dir(job), **options)}


def new_shared_files(job: Job, before: set[str]) -> set[str]:
    """The paths in ``shared/`` that are not in ``before``."""
    shared = job.storage.layout.shared_dir
    return {join(shared, n) for n in job.storage.fs.list_dir(shared)} - before


def shared_paths(job: Job) -> set[str]:
    """The paths in ``shared/``."""
    return new_shared_files(job, set())


def acknowledge(job: Job, checkpoint_id: int, futures: list[Any]) -> None:
    """Write the acknowledgements of the finished snapshots of checkpoint N."""
    for i, future in enumerate(futures):
        ack = SubtaskAck(
            OPERATOR, i, len(job.backends), future.result(WAIT), None, job.coordinator.run_id
        )
        job.storage.write_ack(checkpoint_id, ack)


def assert_restores(job: Job, checkpoint_id: int, local: Path) -> None:
    """Checkpoint N verifies and restores to the model of its time."""
    directory = job.storage.resolve(checkpoint_id)
    fs = job.storage.fs
    assert verify_checkpoint(CheckpointRef(fs, directory, load_metadata(fs, directory))) == []
    assert restore(fs, directory, 1, local) == job.models[checkpoint_id]


def cli_gc(capsys: pytest.CaptureFixture[str], job: Job, *argv: str) -> tuple[int, list[str]]:
    """``statebackend gc JOBDIR ARGV``: (status, the listed paths)."""
    capsys.readouterr()
    options = [f"--storage-option={k}={v}" for k, v in job.location.storage_options.items()]
    status = main(["gc", job_dir(job), *argv, *options])
    out = capsys.readouterr().out.splitlines()
    return status, [line.split()[1] for line in out[:-1]]


# -- the rules ----------------------------------------------------------------------------


def test_a_young_file_is_never_garbage(
    capsys: pytest.CaptureFixture[str], job: Job, tmp_path: Path
) -> None:
    """Every kind of garbage is kept while younger than the grace period (by its
    modification time on the storage), and listed once older; the CLI's default grace
    period keeps files just written, ``--grace 0`` lists them."""
    orphan = shared_file(job, "op-0-orphan-000001.sst")
    settle(job.location)
    job.write(500)
    job.checkpoint()
    aborted = job.coordinator.trigger({OPERATOR: 1})
    job.coordinator.abort(aborted)
    job.write(500)
    completed = job.checkpoint()
    late = join(job.storage.resolve(aborted), "op-0-late-upload")
    stray = join(job.storage.resolve(completed), "op-0-retried-upload")
    for path in (late, stray):
        job.storage.fs.write_atomic(path, b"an upload after its checkpoint ended")
    garbage = {orphan, late, stray}

    times = {path: job.storage.fs.modified(path) for path in garbage}
    youngest, oldest = max(times.values()), min(times.values())
    assert listed(job, grace_seconds=0) == garbage
    assert listed(job, grace_seconds=100, now=oldest + 50) == set()
    assert listed(job, grace_seconds=100, now=youngest + 150) == garbage

    assert DEFAULT_GRACE_SECONDS == 3600
    assert cli_gc(capsys, job) == (0, [])
    assert cli_gc(capsys, job, "--apply") == (0, [])
    assert all(job.storage.fs.exists(path) for path in garbage)
    status, paths = cli_gc(capsys, job, "--grace", "0", "--apply")
    assert status == 0 and set(paths) == garbage
    assert not any(job.storage.fs.exists(path) for path in garbage)
    for checkpoint_id in job.storage.completed_checkpoint_ids():
        assert_restores(job, checkpoint_id, tmp_path / f"restore-{checkpoint_id}")


def test_gc_tells_its_progress_over_every_file_it_checks_and_deletes(job: Job) -> None:
    """``checked`` hears (done, total) for each candidate file looked up, ``deleted`` for
    each file deleted (what `statebackend gc` shows as progress bars)."""
    orphans = {shared_file(job, f"op-0-orphan-{i:06d}.sst") for i in range(3)}
    settle(job.location)
    job.write(500)
    job.checkpoint()
    checks: list[tuple[int, int]] = []
    garbage = find_garbage(
        job.storage.fs, job_dir(job), grace_seconds=0, checked=lambda *p: checks.append(p)
    )
    assert {item.path for item in garbage} == orphans
    candidates = checks[-1][1]
    assert candidates >= len(orphans)
    assert checks == [(done, candidates) for done in range(1, candidates + 1)]
    deletes: list[tuple[int, int]] = []
    deleted = delete_garbage(
        job.storage.fs,
        job_dir(job),
        garbage,
        grace_seconds=0,
        deleted=lambda *p: deletes.append(p),
    )
    assert {item.path for item in deleted} == orphans
    assert deletes == [(done, len(orphans)) for done in range(1, len(orphans) + 1)]


def test_shared_files_of_a_pending_checkpoint_are_kept_before_its_directory_exists(
    capsys: pytest.CaptureFixture[str], checkpoint_url: Storage, tmp_path: Path
) -> None:
    """The data loss of issue 8: an incremental snapshot has uploaded an SST file to
    ``shared/`` and nothing of its ``chk-<N>`` exists yet. gc (grace 0, ``--apply``) keeps
    that file, since it was written after the newest completed checkpoint was triggered,
    and still deletes an older unreferenced one; the checkpoint completes, verifies and
    restores, and so does the next one, which reuses the file."""
    fs = PrivateGateFileSystem(checkpoint_url)
    job = new_job(checkpoint_url, tmp_path / "local", fs=fs)
    try:
        orphan = shared_file(job, "op-0-orphan-000001.sst")
        settle(checkpoint_url)
        job.write(2000)
        job.checkpoint()
        before = shared_paths(job)
        job.write(2000)
        shared_written = fs.shared_written
        fs.closed.set()  # the files of chk-2 wait; its SST files upload
        checkpoint_id = job.coordinator.trigger({OPERATOR: 1})
        futures = job.snapshot(checkpoint_id)
        model = {k: (c, dict(t)) for k, (c, t) in job.model.items()}
        deadline = time.monotonic() + WAIT
        # until the SST files are up and the rest waits (or is inline: no ack is written yet)
        while fs.shared_written == shared_written or not (
            fs.holding.is_set() or all(future.done() for future in futures)
        ):
            assert time.monotonic() < deadline, "no SST file of chk-2 was uploaded"
            time.sleep(0.01)
        uploaded = new_shared_files(job, before)
        assert uploaded
        assert fs.list_dir(job.storage.resolve(checkpoint_id)) == ["_pending"]  # only the marker

        assert listed(job, grace_seconds=0, now=FAR_FUTURE) == {orphan}
        status, deleted = cli_gc(capsys, job, "--grace", "0", "--apply")
        assert status == 0 and deleted == [orphan]
        assert uploaded <= shared_paths(job)

        fs.gate.set()
        acknowledge(job, checkpoint_id, futures)
        assert job.coordinator.poll(checkpoint_id) is not None
        job.models[checkpoint_id] = model
        directory = job.storage.resolve(checkpoint_id)
        metadata = job.storage.load(checkpoint_id)
        assert uploaded <= {resolve_path(directory, f.path) for f in metadata.files()}
        following = job.checkpoint()  # reuses the SST files of checkpoint N
        assert cli_gc(capsys, job, "--grace", "0", "--apply") == (0, [])
        for completed in (checkpoint_id, following):
            assert_restores(job, completed, tmp_path / f"restore-{completed}")
    finally:
        fs.gate.set()
        job.close()


def test_shared_files_a_pending_acknowledgement_references_are_kept(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """With concurrent checkpoints, checkpoint 2 is acknowledged but not complete when
    checkpoint 3 completes: gc keeps the files 2's acknowledgement references (its SST
    files, though older than 3's trigger, and its private files) and deletes an
    unreferenced file of the same age. 2 keeps its pending marker of the newest leader
    epoch, so it may still complete: nothing of it is garbage. Once another driver claims
    a newer epoch, 2 can never complete: its acknowledgements go first, then the files
    they referenced."""
    job = new_job(checkpoint_url, tmp_path / "local", max_concurrent=2)
    try:
        job.write(2000)
        job.checkpoint()
        before = shared_paths(job)
        job.write(2000)
        pending = job.coordinator.trigger({OPERATOR: 1})
        acknowledge(job, pending, job.snapshot(pending))
        acknowledged = new_shared_files(job, before)
        orphan = shared_file(job, "op-0-orphan-000001.sst")
        assert acknowledged
        settle(checkpoint_url)
        job.write(500)
        newest = job.checkpoint()
        assert job.storage.completed_checkpoint_ids() == [1, newest]
        pending_dir = job.storage.resolve(pending)
        ack_dir = job.storage.layout.acks_dir(pending)
        acks = {join(ack_dir, name) for name in job.storage.fs.list_dir(ack_dir)}
        private = {join(pending_dir, name) for name in job.storage.fs.list_dir(pending_dir)}
        private -= {ack_dir}
        assert acks and private

        garbage = find_garbage(job.storage.fs, job_dir(job), grace_seconds=0)
        assert {g.path for g in garbage} == {orphan}
        deleted = delete_garbage(job.storage.fs, job_dir(job), garbage, grace_seconds=0)
        assert deleted == garbage
        assert acknowledged <= shared_paths(job)
        assert listed(job, grace_seconds=0) == set()

        fenced_by = max(job.storage.leader_epochs()) + 1
        job.storage.write_leader(fenced_by, "another-driver", time.time())
        garbage = find_garbage(job.storage.fs, job_dir(job), grace_seconds=0)
        marker = job.storage.layout.pending_marker_path(pending)
        assert {g.path for g in garbage} == acks | {marker}
        delete_garbage(job.storage.fs, job_dir(job), garbage, grace_seconds=0)
        assert acknowledged <= shared_paths(job)
        assert listed(job, grace_seconds=0) == acknowledged | (private - {marker})
        assert_restores(job, newest, tmp_path / "restore")
    finally:
        job.close()


def test_deleting_decides_again_from_a_fresh_listing(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """Between ``find_garbage`` and ``delete_garbage``, checkpoint 2 (pending while the
    newer 3 completed; its pending marker is the newest leader's, so none of its files is
    listed) completes and a stray file is written again: nothing is deleted, and both
    checkpoints verify and restore."""
    job = new_job(checkpoint_url, tmp_path / "local", max_concurrent=2)
    try:
        job.write(2000)
        job.checkpoint()
        job.write(2000)
        pending = job.coordinator.trigger({OPERATOR: 1})
        acknowledge(job, pending, job.snapshot(pending))
        job.models[pending] = {k: (c, dict(t)) for k, (c, t) in job.model.items()}
        job.write(500)
        newest = job.checkpoint()
        stray = join(job.storage.resolve(newest), "op-0-retried-upload")
        job.storage.fs.write_atomic(stray, b"first attempt")

        garbage = find_garbage(job.storage.fs, job_dir(job), grace_seconds=0)
        pending_dir = job.storage.resolve(pending)
        assert stray in {g.path for g in garbage}
        assert not any(g.path.startswith(pending_dir + "/") for g in garbage)
        assert job.coordinator.poll(pending) is not None
        settle(checkpoint_url)
        job.storage.fs.write_atomic(stray, b"second attempt")

        assert delete_garbage(job.storage.fs, job_dir(job), garbage, grace_seconds=0) == []
        assert job.storage.fs.read_file(stray) == b"second attempt"
        for checkpoint_id in (pending, newest):
            assert_restores(job, checkpoint_id, tmp_path / f"restore-{checkpoint_id}")
    finally:
        job.close()


def test_savepoints_requests_pending_checkpoints_and_unknown_files_are_never_garbage(
    job: Job,
) -> None:
    """However old: a savepoint being written (no ``_metadata`` yet), savepoint requests,
    a ``chk-<N>`` newer than the newest completed one, and files gc does not know in the
    job's directory (such as the job's own bookkeeping)."""
    job.write(500)
    job.checkpoint()
    fs, layout = job.storage.fs, job.storage.layout
    in_progress = join(layout.savepoint_path(1), "shared", "op-0-abc-000009.sst")
    fs.write_atomic(in_progress, b"a savepoint's copy, its _metadata not written yet")
    request_savepoint(fs, layout.job_dir)
    pending = join(layout.checkpoint_path(9), "op-0-private-file")
    fs.write_atomic(pending, b"an upload of a checkpoint not complete yet")
    for name in ("checkpoint-id", "_fence", "unknown/file"):
        fs.write_atomic(join(layout.job_dir, name), b"something gc does not know")
    assert listed(job, grace_seconds=0, now=FAR_FUTURE) == set()


def test_answered_savepoint_requests_are_garbage_once_their_answer_is_old(job: Job) -> None:
    """Every ``savepoint trigger`` leaves a request and, once the job answered it, its
    answer in ``requests/``; nothing else deletes them, so a job asked for a savepoint
    every hour holds 17,520 files there after a year, listed by its driver every batch.
    gc deletes the two files of an answered request (a savepoint or an error) once the
    answer is older than the grace period, the request first (an unanswered request
    would be served again); unanswered requests stay."""
    fs, job_directory = job.storage.fs, job_dir(job)
    requests_dir = join(job_directory, REQUESTS_DIR)
    ids = [request_savepoint(fs, job_directory) for _ in range(3)]
    by_id = {r.request_id: r for r in pending_savepoint_requests(fs, job_directory)}
    settle(job.location)
    answer_savepoint_request(fs, job_directory, by_id[ids[0]], savepoint_path="file:///sp-0")
    settle(job.location)
    answer_savepoint_request(fs, job_directory, by_id[ids[2]], error="the job failed")

    def files_of(request_id: str) -> list[str]:
        """The request's file, then its answer's."""
        return [join(requests_dir, f"savepoint-{request_id}{s}") for s in (".json", ".done.json")]

    first_answer = fs.modified(files_of(ids[0])[1])
    # The third request is old, but its answer is not: a requester may still read it.
    assert listed(job, grace_seconds=0, now=first_answer) == set(files_of(ids[0]))
    garbage = find_garbage(fs, job_directory, grace_seconds=0, now=FAR_FUTURE)
    assert [g.path for g in garbage] == files_of(ids[0]) + files_of(ids[2])
    delete_garbage(fs, job_directory, garbage, grace_seconds=0)
    assert fs.list_dir(requests_dir) == [f"savepoint-{ids[1]}.json"]
    assert [r.request_id for r in pending_savepoint_requests(fs, job_directory)] == [ids[1]]


def test_listed_times_are_modified_times_to_the_microsecond(tmp_path: Path) -> None:
    """``list_files`` gives each file's time as ``modified`` does: a local file's
    nanosecond mtime, which ``modified`` rounds to whole microseconds (a datetime), was
    listed unrounded, so a file whose time gc compared against ``modified`` of another
    listing could come out a fraction of a microsecond younger than itself."""
    fs = open_filesystem(tmp_path.as_uri())
    for index, nanoseconds in enumerate((123_456_400, 123_456_600, 999_999_900, 0)):
        path = tmp_path / f"file-{index}"
        path.write_bytes(b"x")
        os.utime(path, ns=(1_700_000_000 * 10**9 + nanoseconds,) * 2)
    listed = fs.list_files(tmp_path.as_uri())
    assert len(listed) == 4
    for name, (_, modified) in listed.items():
        assert modified == fs.modified(join(tmp_path.as_uri(), name))


def test_modified_is_the_storage_write_time(checkpoint_url: Storage) -> None:
    """``CheckpointFileSystem.modified``: when a file was written, later after a rewrite;
    a missing file is reported as missing."""
    storage = CheckpointStorage(
        checkpoint_url.url, "job", storage_options=checkpoint_url.storage_options
    )
    path = storage.layout.shared_path("file")
    start = time.time()
    storage.fs.write_atomic(path, b"one")
    first = storage.fs.modified(path)
    assert start - 2 <= first <= time.time() + 2
    settle(checkpoint_url)
    storage.fs.write_atomic(path, b"two")
    assert storage.fs.modified(path) > first
    with pytest.raises(CheckpointCorruptedError, match="missing"):
        storage.fs.modified(storage.layout.shared_path("nothing"))


class RetentionRaceFileSystem(CheckpointFileSystem):
    """A checkpoint file system on which the job's retention deletes checkpoint
    ``doomed`` between gc's check that its ``_metadata`` exists and gc's read of it."""

    def __init__(self, location: Storage, doomed: str) -> None:
        super().__init__(raw_fs(location))
        self.doomed = doomed
        self.raced = False

    def read_file(self, path: str) -> bytes:
        """``CheckpointFileSystem.read_file``, with the doomed checkpoint deleted first."""
        self._race([path])
        return super().read_file(path)

    def read_files(self, paths: Sequence[str]) -> list[bytes | CheckpointError]:
        """``CheckpointFileSystem.read_files``, with the doomed checkpoint deleted first."""
        self._race(paths)
        return super().read_files(paths)

    def _race(self, paths: Sequence[str]) -> None:
        if f"{self.doomed}/_metadata" in paths and not self.raced:
            self.raced = True
            self.delete(self.doomed, recursive=True)


def test_a_checkpoint_deleted_while_gc_reads_it_is_skipped(
    checkpoint_url: Storage, job: Job
) -> None:
    """Retention deletes an old checkpoint between gc's listing of its ``_metadata`` and
    the read: gc goes on without it (it failed, so a gc loop next to a job failed now
    and then), and lists the files of the others as before: none."""
    job.write(2000)
    older = job.checkpoint()
    job.write(500)
    job.checkpoint()
    fs = RetentionRaceFileSystem(checkpoint_url, job.storage.resolve(older))
    assert find_garbage(fs, job_dir(job), grace_seconds=0) == []
    assert fs.raced


def test_a_directory_someone_put_in_a_checkpoint_or_batch_is_left_alone(job: Job) -> None:
    """Files in a directory of their own inside a completed ``chk-<N>`` or a changelog
    batch directory (put there by hand or by another tool) are not gc's: the one listing
    names the directory among the checkpoint's entries, and taking its size and time
    from the listing failed with a KeyError."""
    job.write(500)
    job.checkpoint()
    fs, layout = job.storage.fs, job.storage.layout
    foreign = join(layout.checkpoint_path(1), "notes", "readme.txt")
    fs.write_atomic(foreign, b"written by hand")
    assert listed(job, grace_seconds=0, now=FAR_FUTURE) == set()
    assert fs.exists(foreign)
