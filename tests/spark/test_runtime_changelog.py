"""StatefulJob on the per-batch changelog: subtasks continue on any executor of any host
without a job-wide rollback, and a driver killed at any moment resumes from the newest
batch manifest. Every check compares with a plain-Python computation of the input."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from statebackend.spark.conf import StateBackendConf
from statebackend.spark.example import generate_events, read_events
from statebackend.spark.runner import RunSummary
from tests.scripts import REPO
from tests.spark.jobs import assert_matches_python, run_user_totals

SCRIPT = REPO / "scripts" / "user_totals.py"
PHASES = ((2, 0), (4, 1), (3, 2))
"""(parallelism, input seed) of the runs: input is appended before each."""


def _phase_runs(
    spark: SparkSession, tmp_path: Path, local_dirs: dict[str, str]
) -> dict[str, list[RunSummary]]:
    """Per name in ``local_dirs``: the runs of ``PHASES`` with that local directory, each
    with its own checkpoint directory, over the same input."""
    summaries: dict[str, list[RunSummary]] = {name: [] for name in local_dirs}
    for parallelism, seed in PHASES:
        generate_events(tmp_path / "input", 480, 40, 4, seed)
        for name, local_dir in local_dirs.items():
            conf = StateBackendConf(
                checkpoint_dir=(tmp_path / f"checkpoints-{name}").as_uri(), local_dir=local_dir
            )
            summaries[name].append(
                run_user_totals(
                    spark,
                    tmp_path,
                    conf,
                    job_id="hosts",
                    parallelism=parallelism,
                    batch_size=30,
                    checkpoint_every=3,
                )
            )
    return summaries


def test_each_executor_with_its_own_local_dir(spark_cluster: SparkSession, tmp_path: Path) -> None:
    """local-cluster[2,1,1024], P = 2 -> 4 -> 3: with a local directory relative to each
    executor's working directory (two hosts' disks) the runs are exact, without a
    rollback, and take at most twice as long as with one shared directory."""
    own = f"own-local-{tmp_path.name}"
    summaries = _phase_runs(
        spark_cluster, tmp_path, {"shared": str(tmp_path / "shared"), "own": own}
    )

    for runs in summaries.values():
        assert [s.records for s in runs] == [480] * len(PHASES)
        assert all(s.rollbacks == 0 and s.failures == 0 for s in runs)
        assert_matches_python(spark_cluster, tmp_path, runs[-1].last_checkpoint)
    # The two executors really kept their own copies, in their own working directories.
    work = Path(os.environ["SPARK_HOME"]) / "work"
    markers = list(work.glob(f"*/*/{own}/hosts/user-totals/subtask-*.version"))
    assert len({marker.parents[3] for marker in markers}) == 2, markers
    # ... so subtasks that Spark moved rebuilt their key groups while the others went on.
    assert sum(sum(s.rebuilt_subtasks[1:]) for s in summaries["own"]) > 0
    own_seconds = sum(s.seconds for s in summaries["own"])
    shared_seconds = sum(s.seconds for s in summaries["shared"])
    assert own_seconds <= 2 * shared_seconds + 5.0, (own_seconds, shared_seconds)


def _script(tmp_path: Path, parallelism: int) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        *("--input", str(tmp_path / "input")),
        *("--checkpoint-dir", (tmp_path / "checkpoints").as_uri()),
        *("--output", str(tmp_path / "output")),
        *("--master", "local[2]", "--parallelism", str(parallelism)),
        *("--batch-size", "10", "--checkpoint-every", "4", "--job-id", "crash"),
    ]


def _newest_manifest(tmp_path: Path) -> int:
    """The newest committed batch (-1: none); older manifests are deleted as it goes."""
    names = (p.name for p in (tmp_path / "checkpoints" / "crash" / "manifests").glob("*"))
    return max((int(name) for name in names if name.isdigit()), default=-1)


def _check_outputs(output: Path, events: list[dict[str, Any]]) -> None:
    """Every user's output rows, in batch order, count up strictly with the totals of
    its first ``count`` events, and end with all of them."""
    amounts: dict[str, list[int]] = {}
    for event in events:
        amounts.setdefault(event["user"], []).append(event["amount"])
    rows: dict[str, list[tuple[int, int]]] = {}
    for batch in sorted(output.glob("batch-*")):
        for part in sorted(batch.glob("part-*.jsonl")):
            for line in part.read_text().splitlines():
                row = json.loads(line)
                rows.setdefault(row["user"], []).append((row["count"], row["total"]))
    assert sorted(rows) == sorted(amounts)
    for user, seen in rows.items():
        counts = [count for count, _ in seen]
        assert counts == sorted(set(counts)), (user, counts)
        assert counts[-1] == len(amounts[user])
        assert all(total == sum(amounts[user][:count]) for count, total in seen), user


def test_driver_killed_at_random_moments(spark_local: SparkSession, tmp_path: Path) -> None:
    """The driver is SIGKILLed twice at a random moment after some batches committed;
    each restart resumes from the newest manifest (not only the newest checkpoint); the
    last run, at another parallelism, ends with exact state and outputs."""
    rng = random.Random(int(time.time()))
    generate_events(tmp_path / "input", 600, 40, 4, 21)
    submit_args = f"--conf spark.statebackend.local.dir={tmp_path / 'local'} pyspark-shell"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_SUBMIT_ARGS": submit_args}
    resumed = []
    for _ in range(2):
        run = subprocess.Popen(
            _script(tmp_path, 2),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wanted = _newest_manifest(tmp_path) + rng.randint(1, 3)
        deadline = time.monotonic() + 120
        try:
            while _newest_manifest(tmp_path) < wanted:
                assert run.poll() is None, "the job ended before the kill"
                assert time.monotonic() < deadline, "no batch committed within 120 s"
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.3))
        finally:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        resumed.append(_newest_manifest(tmp_path))
    last = subprocess.run(
        _script(tmp_path, 3), env=env, capture_output=True, text=True, timeout=300
    )
    assert last.returncode == 0, last.stdout + last.stderr
    # It resumed at the last committed batch: from its manifest, or from a checkpoint of
    # that batch if one completed before the kill.
    restored_from = re.search(r"restored from (\S+);", last.stdout)
    assert restored_from is not None, last.stdout
    where = restored_from.group(1)
    if "/manifests/" not in where:
        metadata = json.loads(Path(where.removeprefix("file://"), "_metadata").read_text())
        assert metadata["properties"]["next_batch"] == resumed[-1] + 1, where
    else:
        assert where.endswith(f"/manifests/{resumed[-1]}"), where

    events = list(read_events(tmp_path / "input"))
    job_dir = tmp_path / "checkpoints" / "crash"
    newest = max(job_dir.glob("chk-*/_metadata"), key=lambda p: int(p.parent.name[4:]))
    assert_matches_python(spark_local, tmp_path, str(newest.parent))
    _check_outputs(tmp_path / "output", events)
