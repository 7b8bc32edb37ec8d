"""``statebackend savepoint trigger`` against a running example job.

``scripts/user_totals.py`` runs in a subprocess (its own driver and local[2] JVM) while
this test keeps appending input, so the job is still running when the request lands;
``python -m statebackend savepoint trigger JOBDIR --wait 120`` then waits for the driver to
take the savepoint between two micro-batches. The savepoint must hold a consistent prefix
of the input (exactly the state of the events before its source offsets), and restoring
from it at another parallelism with the rest of the input must end with the exact totals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from statebackend.checkpoint.layout import join
from statebackend.spark.example import expected_totals, generate_events, read_events
from statebackend.spark.source import partition_path
from tests.conftest import Storage
from tests.scripts import REPO
from tests.spark.test_cli_on_example_job import (
    JOB_ID,
    PARTITIONS,
    USERS,
    cli,
    read_totals,
    run_job,
    source_offsets,
)

APPEND_EVERY = 0.5  # seconds between appends while the savepoint is pending
APPEND_EVENTS = 20
JOB_TIMEOUT = 150.0


def _events_before(input_dir: Path, offsets: dict[int, int]) -> list[dict[str, Any]]:
    """The events of each partition before its offset (which must be a line boundary)."""
    events = []
    for partition, offset in sorted(offsets.items()):
        data = partition_path(input_dir, partition).read_bytes()[:offset]
        assert data == b"" or data.endswith(b"\n"), f"offset {offset} splits a line"
        events += [json.loads(line) for line in data.splitlines()]
    return events


class _Appender(threading.Thread):
    """Appends a few events every ``APPEND_EVERY`` seconds until stopped."""

    def __init__(self, input_dir: Path) -> None:
        super().__init__(daemon=True)
        self.input_dir = input_dir
        self.stop = threading.Event()
        self.seed = 1000

    def append(self) -> None:
        """Append one chunk of events."""
        self.seed += 1
        generate_events(self.input_dir, APPEND_EVENTS, USERS, PARTITIONS, self.seed)

    def run(self) -> None:
        while not self.stop.wait(APPEND_EVERY):
            self.append()


def test_savepoint_trigger_of_a_running_job(
    capsys: pytest.CaptureFixture[str], spark_local: SparkSession, tmp_path: Path
) -> None:
    input_dir = tmp_path / "input"
    generate_events(input_dir, 800, USERS, PARTITIONS, seed=21)
    checkpoints = tmp_path / "checkpoints"
    job_dir = join(checkpoints.as_uri(), JOB_ID)
    storage = Storage(checkpoints.as_uri())
    log = tmp_path / "job.log"
    # Its own local state dir: the default is machine-wide, shared with any other run.
    submit_args = (
        f"--conf spark.ui.enabled=false --conf spark.statebackend.local.dir={tmp_path / 'local'}"
        " pyspark-shell"
    )
    env = dict(os.environ, PYSPARK_SUBMIT_ARGS=submit_args)
    command = [
        sys.executable,
        str(REPO / "scripts/user_totals.py"),
        *("--input", str(input_dir), "--checkpoint-dir", checkpoints.as_uri()),
        *("--parallelism", "2", "--batch-size", "10", "--checkpoint-every", "3"),
        *("--restore", "none", "--master", "local[2]"),
    ]
    appender = _Appender(input_dir)
    with log.open("w") as log_file:
        job = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        # Running: the job completed its first checkpoint (Spark is up, batches go on).
        deadline = time.monotonic() + JOB_TIMEOUT
        while not list(checkpoints.glob(f"{JOB_ID}/chk-*/_metadata")):
            assert job.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        appender.start()
        trigger = subprocess.run(
            [
                sys.executable,
                "-m",
                "statebackend",
                "savepoint",
                "trigger",
                job_dir,
                "--wait",
                "120",
            ],
            capture_output=True,
            text=True,
            timeout=150,
        )
        appender.append()  # input the savepoint cannot have seen
        appender.stop.set()
        appender.join()
        assert trigger.returncode == 0, trigger.stderr + log.read_text()
        assert job.wait(JOB_TIMEOUT) == 0, log.read_text()
    finally:
        appender.stop.set()
        if job.poll() is None:
            job.kill()
            job.wait()
    savepoint = trigger.stdout.strip()
    assert savepoint.startswith(join(job_dir, "savepoints", "savepoint-request-"))

    status, out, err = cli(capsys, storage, "inspect", savepoint, "--json")
    assert status == 0 and json.loads(out)["kind"] == "savepoint", err
    assert cli(capsys, storage, "verify", savepoint)[0] == 0
    everything = list(read_events(input_dir))
    final = expected_totals(everything)
    # The job's own final checkpoint holds everything.
    status, out, err = cli(capsys, storage, "list", job_dir, "--json")
    assert status == 0, err
    last = [c["path"] for c in json.loads(out)[0]["checkpoints"] if c["status"] == "completed"]
    assert read_totals(capsys, storage, last[-1]) == final

    # The savepoint: a consistent prefix of the input, strictly before its end.
    offsets = source_offsets(capsys, storage, savepoint)
    assert sorted(offsets) == list(range(PARTITIONS))
    consumed = _events_before(input_dir, offsets)
    assert 0 < len(consumed) < len(everything)
    at_savepoint = read_totals(capsys, storage, savepoint)
    counts = {user: totals["count"] for user, totals in at_savepoint.items()}
    assert sum(counts.values()) == len(consumed)
    assert counts == dict(Counter(event["user"] for event in consumed))
    assert all(count <= final[user]["count"] for user, count in counts.items())
    assert at_savepoint == expected_totals(consumed)

    # Restored at P=3 into a fresh checkpoint directory, with the rest of the input.
    restored_storage = Storage((tmp_path / "restored").as_uri())
    summary = run_job(
        spark_local, restored_storage, input_dir, tmp_path / "local", 3, restore=savepoint
    )
    assert summary.restored_from == savepoint
    assert summary.records == len(everything) - len(consumed)
    assert summary.last_checkpoint is not None
    assert read_totals(capsys, restored_storage, summary.last_checkpoint) == final
