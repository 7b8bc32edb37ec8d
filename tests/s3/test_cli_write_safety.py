"""The ``statebackend`` commands that write, run as a user runs them (a process of their
own), never damage the checkpoint they read, on file:// and s3://.

Checkpoints come from real RocksDB backends checkpointing incrementally (the harness of
``test_incremental_checkpoints``); expectations are the plain-Python model of the state and
the bytes of the source read before the command.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from statebackend.checkpoint.layout import join
from statebackend.checkpoint.requests import pending_savepoint_requests
from statebackend.checkpoint.writer import OperatorRewrite, SavepointWriter
from statebackend.errors import CheckpointError
from statebackend.snapshot.handles import resolve_path
from tests import sigint
from tests.conftest import Storage, raw_fs
from tests.s3.test_cli import assert_one_error_line
from tests.s3.test_incremental_checkpoints import OPERATOR, Job, M, new_job, restore


@pytest.fixture
def job(checkpoint_url: Storage, tmp_path: Path) -> Iterator[Job]:
    """A one-subtask incremental job with two completed checkpoints, on file:// and s3://."""
    created = new_job(checkpoint_url, tmp_path / "local")
    created.write(3000)
    created.checkpoint()
    created.write(1000)
    created.checkpoint()
    yield created
    created.close()


def run_cli(
    storage: Storage, *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m statebackend ARGV`` with the storage's options (in ``env``)."""
    options = [f"--storage-option={k}={v}" for k, v in storage.storage_options.items()]
    return subprocess.run(
        [sys.executable, "-m", "statebackend", *argv, *options],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def contents(storage: Storage, directory: str) -> dict[str, bytes]:
    """Every file below ``directory`` and its bytes."""
    fs = raw_fs(storage)
    return {path: fs.cat_file(path) for path in fs.find(directory)}


def test_savepoint_create_into_the_jobs_directory_leaves_the_checkpoint_intact(
    job: Job, tmp_path: Path
) -> None:
    """The job's directory as ``--to`` (a slip for ``<job>/savepoints/NAME``) mapped the
    incremental checkpoint's ``../shared/X`` onto ``shared/X`` there, the very file being
    copied: on a local disk it was truncated to 0 bytes before it was read, destroying the
    checkpoint and every later one that reuses it."""
    checkpoint_id = max(job.models)
    source = job.storage.resolve(checkpoint_id)
    job_dir = job.storage.layout.job_dir
    before = contents(job.location, job_dir)
    result = run_cli(job.location, "savepoint", "create", "--from", source, "--to", job_dir)
    assert result.returncode == 1, result.stdout
    assert_one_error_line(result.stderr)
    assert "overwrite" in result.stderr and "shared/" in result.stderr, result.stderr
    assert contents(job.location, job_dir) == before
    assert run_cli(job.location, "verify", source).returncode == 0
    assert restore(job.storage.fs, source, 1, tmp_path) == job.models[checkpoint_id]
    elsewhere = join(job_dir, "savepoints", "sp-1")  # the intended target still works
    result = run_cli(job.location, "savepoint", "create", "--from", source, "--to", elsewhere)
    assert result.returncode == 0, result.stderr
    assert restore(job.storage.fs, elsewhere, 2, tmp_path) == job.models[checkpoint_id]


def test_a_savepoint_whose_files_another_writers_cleanup_deleted_is_not_completed(
    job: Job, tmp_path: Path
) -> None:
    """Two writes into one new directory (a command started twice) both find it empty;
    when one is interrupted it deletes the directory, files of the other included. The
    other wrote its ``_metadata`` anyway and reported success: a savepoint whose files
    were gone. It now fails, leaving no ``_metadata``, and a new run succeeds."""
    checkpoint_id = max(job.models)
    source = job.storage.resolve(checkpoint_id)
    target = join(job.storage.layout.job_dir, "savepoints", "sp-1")
    rewrite = OperatorRewrite(OPERATOR, 2)
    first, second = (
        SavepointWriter(target, M, source=source, storage_options=job.location.storage_options)
        for _ in range(2)
    )
    with pytest.raises(CheckpointError, match="while the savepoint was written"), first.writing():
        interrupted = second.writing()
        interrupted.__enter__()  # both found the target empty
        acks = [first.write_subtask(rewrite, i, ()) for i in range(2)]
        interrupted.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)  # Ctrl-C
        first.complete(acks, job_id="job")
    result = run_cli(job.location, "verify", target)
    assert result.returncode == 1 and "no _metadata" in result.stderr, result.stderr
    assert_one_error_line(result.stderr)
    again = ["savepoint", "transform", "--from", source, "--to", target, "-p", "2"]
    result = run_cli(job.location, *again)
    assert result.returncode == 0, result.stderr
    assert run_cli(job.location, "verify", target).returncode == 0
    assert restore(job.storage.fs, target, 3, tmp_path) == job.models[checkpoint_id]


def test_ctrl_c_while_waiting_for_a_savepoint_says_the_request_stays(job: Job) -> None:
    """Ctrl-C during ``savepoint trigger --wait`` said only "interrupted", while the request
    stays and the job still takes the savepoint: running the command again asked for a
    second one. The one line now says so, and where the savepoint will be."""
    job_dir = job.storage.layout.job_dir
    options = [f"--storage-option={k}={v}" for k, v in job.location.storage_options.items()]
    command = [sys.executable, "-m", "statebackend", "savepoint", "trigger", job_dir]
    process = subprocess.Popen(
        [*command, "--wait", "60", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not pending_savepoint_requests(job.storage.fs, job_dir):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    time.sleep(0.3)  # waiting for the answer
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert (process.returncode, out) == (130, ""), err
    [line] = err.splitlines()
    [request] = pending_savepoint_requests(job.storage.fs, job_dir)
    assert line.startswith("statebackend: interrupted") and "Traceback" not in err
    assert request.request_id in line and request.savepoint_dir(job_dir) in line, line


def copied_last(job: Job, checkpoint_id: int) -> str:
    """The source file ``savepoint create`` copies last (after every other one)."""
    relative = job.storage.load(checkpoint_id).files()[-1][0]
    return resolve_path(job.storage.resolve(checkpoint_id), relative)


def test_a_savepoint_copy_that_fails_midway_leaves_nothing_and_can_be_run_again(
    job: Job, tmp_path: Path
) -> None:
    """A copy that failed after some files (here: the last file is damaged) left them in
    the target, with no ``_metadata``: a directory of state files that no restore, ``gc``
    or ``list`` ever cleans up (``list`` shows it as a pending checkpoint). It now removes
    what it wrote, and the same command succeeds once the cause is gone."""
    checkpoint_id = max(job.models)
    source = job.storage.resolve(checkpoint_id)
    target = join(job.storage.layout.job_dir, "savepoints", "sp-1")
    fs = raw_fs(job.location)
    last = copied_last(job, checkpoint_id)
    intact = fs.cat_file(last)
    fs.pipe_file(last, bytes([intact[0] ^ 0xFF]) + intact[1:])
    result = run_cli(job.location, "savepoint", "create", "--from", source, "--to", target)
    assert result.returncode == 1, result.stdout
    assert_one_error_line(result.stderr)
    assert "corrupted" in result.stderr, result.stderr
    assert not raw_fs(job.location).exists(target), contents(job.location, target)
    fs.pipe_file(last, intact)
    result = run_cli(job.location, "savepoint", "create", "--from", source, "--to", target)
    assert result.returncode == 0, result.stderr
    assert restore(job.storage.fs, target, 2, tmp_path) == job.models[checkpoint_id]


def test_ctrl_c_during_a_savepoint_copy_leaves_nothing_and_it_can_be_run_again(
    job: Job, tmp_path: Path
) -> None:
    """Ctrl-C while ``savepoint create`` copied a checkpoint left the files copied so far
    under the target. Now it removes them: the target holds nothing, and the same command
    then writes a savepoint there. The command gets SIGINT once it copied and checked its
    first file (``tests.sigint``)."""
    checkpoint_id = max(job.models)
    source = job.storage.resolve(checkpoint_id)
    target = join(job.storage.layout.job_dir, "savepoints", "sp-1")
    argv = ["savepoint", "create", "--from", source, "--to", target]
    after = "statebackend.checkpoint.filesystem:CheckpointFileSystem.verify"
    result = run_cli(job.location, *argv, env=sigint.env(after=after))
    assert (result.returncode, result.stdout) == (130, ""), result.stderr
    assert result.stderr.splitlines() == ["statebackend: interrupted"], result.stderr
    assert not raw_fs(job.location).exists(target), contents(job.location, target)
    result = run_cli(job.location, *argv)
    assert result.returncode == 0, result.stderr
    assert restore(job.storage.fs, target, 2, tmp_path) == job.models[checkpoint_id]
