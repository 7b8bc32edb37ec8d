"""``statebackend gc --apply`` in a loop while the example job checkpoints incrementally.

An incremental snapshot uploads its SST files to ``shared/`` before anything of its
``chk-<N>`` exists, and later snapshots reuse them: a gc that deletes such a file breaks the
checkpoint being taken and every later one. Here gc runs over and over (in a thread,
in-process through ``cli.main``, grace period 0) during a run of many small checkpoints;
afterwards every retained checkpoint must verify, hold exactly the state a plain-Python
computation gives for its source offsets, and restore a restarted job exactly.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.restore import restore_operator_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.example import (
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
    user_totals_job,
)
from statebackend.spark.runner import SOURCE_OPERATOR
from statebackend.spark.source import iter_owned, offsets_state, partition_path
from tests.conftest import Storage
from tests.spark.test_cli_on_example_job import read_totals

JOB_ID = "gc-live"
PARALLELISM = 2
PARTITIONS = 4
USERS = 40
EVENTS = 1600
BATCH_SIZE = 20  # records per partition and batch: 20 batches, a checkpoint due at each


def events_before(input_dir: Path, offsets: dict[int, int]) -> list[dict[str, Any]]:
    """The events of each partition before its byte offset, partition by partition."""
    events = []
    for partition, offset in sorted(offsets.items()):
        data = partition_path(input_dir, partition).read_bytes()[:offset]
        events += [json.loads(line) for line in data.splitlines()]
    return events


def checkpointed_offsets(storage: CheckpointStorage, checkpoint_id: int) -> dict[int, int]:
    """partition -> byte offset of the source operator state of checkpoint N."""
    metadata = storage.load(checkpoint_id)
    directory = storage.resolve(checkpoint_id)
    parallelism = metadata.operators[SOURCE_OPERATOR].parallelism
    offsets: dict[int, int] = {}
    for subtask in range(parallelism):
        backend = restore_operator_state(
            storage.fs, directory, metadata, SOURCE_OPERATOR, subtask, parallelism
        )
        offsets.update(iter_owned([list(offsets_state(backend).get())]))
    return offsets


class GcLoop:
    """``statebackend gc JOBDIR --apply --grace 0`` over and over in a thread until stopped,
    from when the job's first checkpoint directory exists (before, JOBDIR is no job's)."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = job_dir
        self.statuses: list[int] = []
        self.errors: list[str] = []
        """What gc printed on stderr when it failed."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gc-loop", daemon=True)

    def _run(self) -> None:
        while not any(self.job_dir.glob("chk-*")):
            if self._stop.wait(0.01):
                return
        while not self._stop.is_set():
            said = io.StringIO()
            with contextlib.redirect_stderr(said):  # for the failure's message
                status = main(["gc", self.job_dir.as_uri(), "--apply", "--grace", "0"])
            self.statuses.append(status)
            if status:
                self.errors.append(said.getvalue())

    def __enter__(self) -> GcLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()


def test_gc_in_a_loop_never_breaks_a_running_incremental_job(
    capsys: pytest.CaptureFixture[str], spark_local: SparkSession, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    job_dir = checkpoints / JOB_ID
    location = Storage(checkpoints.as_uri())
    input_dir = tmp_path / "input"
    generate_events(input_dir, EVENTS, USERS, PARTITIONS, seed=21)

    def run(local_dir: Path) -> Any:
        conf = StateBackendConf.from_pairs(
            [
                ("spark.statebackend.checkpoint.dir", checkpoints.as_uri()),
                ("spark.statebackend.checkpoint.incremental", "true"),
                ("spark.statebackend.local.dir", str(local_dir)),
            ]
        )
        return user_totals_job(
            spark_local,
            job_id=JOB_ID,
            input_dir=input_dir,
            parallelism=PARALLELISM,
            conf=conf,
            batch_size=BATCH_SIZE,
            checkpoint_every=1,
            restore="latest",
        ).run()

    with GcLoop(job_dir) as gc:
        summary = run(tmp_path / "local")
    assert summary.failures == 0 and summary.aborted == 0
    # A checkpoint due while the previous one still uploads is taken at a later batch, so
    # about every other batch checkpoints here (11 of 20 in a run on a quiet machine).
    assert len(summary.checkpoints) >= 4
    assert len(summary.checkpoint_waits) <= 2  # no batch waited: only the run's end does
    capsys.readouterr()

    storage = CheckpointStorage(checkpoints.as_uri(), JOB_ID)
    retained = storage.completed_checkpoint_ids()
    # The newest 3, and the older ones that retained batch manifests build on.
    pinned = ChangelogStorage(storage).referenced_checkpoints()
    assert set(retained) == set(retained[-3:]) | pinned and len(retained) >= 3
    for checkpoint_id in retained:
        directory = storage.resolve(checkpoint_id)
        assert main(["verify", directory]) == 0, capsys.readouterr()
        offsets = checkpointed_offsets(storage, checkpoint_id)
        expected = expected_totals(events_before(input_dir, offsets))
        assert compare_totals(expected, read_totals(capsys, location, directory)) == []
    storage.close()
    assert len(gc.statuses) >= 10, "gc must have run while the job checkpointed"
    assert set(gc.statuses) == {0}, gc.errors

    # A restart on a fresh local directory restores every subtask from the checkpoint.
    generate_events(input_dir, 400, USERS, PARTITIONS, seed=22)
    with GcLoop(job_dir) as gc:
        summary = run(tmp_path / "local-restart")
    assert summary.restored_from is not None and summary.failures == 0
    assert set(gc.statuses) == {0}, gc.errors
    assert summary.last_checkpoint is not None
    expected = expected_totals(read_events(input_dir))
    assert compare_totals(expected, read_totals(capsys, location, summary.last_checkpoint)) == []
