"""The ``statebackend`` commands that write, run as a user runs them (a process of their
own), never damage the checkpoint they read, on file:// and s3://.

Checkpoints come from real RocksDB backends checkpointing incrementally (the harness of
``test_incremental_checkpoints``); expectations are the plain-Python model of the state and
the bytes of the source read before the command.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from statebackend.checkpoint.layout import join
from tests.conftest import Storage
from tests.s3.test_cli import assert_one_error_line
from tests.s3.test_incremental_checkpoints import Job, new_job, raw_fs, restore


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


def run_cli(storage: Storage, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m statebackend ARGV`` with the storage's options."""
    options = [f"--storage-option={k}={v}" for k, v in storage.storage_options.items()]
    return subprocess.run(
        [sys.executable, "-m", "statebackend", *argv, *options],
        capture_output=True,
        text=True,
        timeout=120,
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
