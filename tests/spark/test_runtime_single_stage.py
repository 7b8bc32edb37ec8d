"""Single-stage batches (``batch.single-stage-bytes``): a batch whose input is small runs
as one Spark stage, each keyed subtask reading the batch's lines of every partition
itself. With it off and at a threshold that the batches cross both ways, the example job
gives the same output rows per batch and the same final state as a plain-Python model,
across a restart that rescales P = 2 -> 3. (The other runtime tests run small batches,
so with the default threshold they run single-stage.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from statebackend.spark.example import (
    OPERATOR_ID,
    expected_totals,
    generate_events,
    read_events,
)
from statebackend.spark.job_groups import job_group_id
from statebackend.spark.source import partition_path
from tests.spark.jobs import assert_matches_python, run_user_totals, settings

PARTITIONS = 4
BATCH_SIZE = 30
"""Lines per partition and batch: a full batch is ~6.5 KB of input."""
CROSSING = 3000
"""Bytes between a full batch of the first run (two stages) and the second run's single
batch (one stage)."""


def _expected_batches(input_dir: Path, runs_lines: list[list[int]]) -> list[dict[str, Any]]:
    """Per batch with input, in order, the output rows by user: each run's batch takes the
    next ``BATCH_SIZE`` lines of every partition (``runs_lines``: the partitions' line
    counts at each run's start) until the run has read them all."""
    lines = [
        partition_path(input_dir, p).read_text(encoding="utf-8").splitlines()
        for p in range(PARTITIONS)
    ]
    totals: dict[str, dict[str, int]] = {}
    batches: list[dict[str, Any]] = []
    position = [0] * PARTITIONS
    for available in runs_lines:
        while any(position[p] < available[p] for p in range(PARTITIONS)):
            rows = {}
            for p in range(PARTITIONS):
                end = min(position[p] + BATCH_SIZE, available[p])
                for line in lines[p][position[p] : end]:
                    event = json.loads(line)
                    user = totals.setdefault(event["user"], {"count": 0, "total": 0})
                    user["count"] += 1
                    user["total"] += event["amount"]
                    rows[event["user"]] = {"user": event["user"], **user}
                position[p] = end
            batches.append(rows)
    return batches


def _output_batches(output_dir: Path) -> list[dict[str, Any]]:
    """The job's output rows by user, per batch directory in batch order."""
    batches = []
    for directory in sorted(output_dir.glob("batch-*")):
        rows = {}
        for part in sorted(directory.glob("part-*.jsonl")):
            for line in part.read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                assert row["user"] not in rows, f"{row['user']} output twice in {directory}"
                rows[row["user"]] = row
        batches.append(rows)
    return batches


def _stages_per_input_batch(spark: SparkSession, job_id: str, batches: int) -> list[int]:
    """The Spark stages of each batch's job, for batches 0..batches-1."""
    tracker = spark.sparkContext.statusTracker()
    stages = []
    for batch_id in range(batches):
        (spark_job,) = tracker.getJobIdsForGroup(job_group_id(job_id, OPERATOR_ID, batch_id))
        info = tracker.getJobInfo(spark_job)
        assert info is not None
        stages.append(len(info.stageIds))
    return stages


@pytest.mark.parametrize(
    ("threshold", "job_id"),
    [("0", "two-stage"), (str(CROSSING), "crossing")],
)
def test_single_stage_batches_match_the_two_stage_path_and_the_model(
    spark_local: SparkSession, tmp_path: Path, threshold: str, job_id: str
) -> None:
    conf = settings(
        tmp_path,
        ("spark.statebackend.batch.single-stage-bytes", threshold),
        ("spark.statebackend.local.dir", str(tmp_path / "local")),
    )
    input_dir, output_dir = tmp_path / "input", tmp_path / "output"
    runs_lines = []
    summaries = []
    for seed, (events, parallelism) in enumerate([(200, 2), (40, 3)]):
        generate_events(input_dir, events, 40, PARTITIONS, seed)
        runs_lines.append(
            [len(partition_path(input_dir, p).read_bytes().splitlines()) for p in range(PARTITIONS)]
        )
        summaries.append(
            run_user_totals(
                spark_local,
                tmp_path,
                conf,
                job_id=job_id,
                parallelism=parallelism,
                batch_size=BATCH_SIZE,
                checkpoint_every=2,
                output_dir=str(output_dir),
            )
        )

    assert _output_batches(output_dir) == _expected_batches(input_dir, runs_lines)
    assert sum(s.records for s in summaries) == 240
    assert all(s.failures == 0 for s in summaries)
    assert summaries[1].restored_bytes[0] > 0  # the restart rebuilt the rescaled subtasks
    assert_matches_python(spark_local, tmp_path, summaries[1].last_checkpoint)
    assert expected_totals(read_events(input_dir)).keys() == {
        user for batch in _output_batches(output_dir) for user in batch
    }

    # Each run ends with a batch without input (one stage, keyed only): skip them.
    total = sum(s.batches for s in summaries)
    first_run = summaries[0].batches
    stages = _stages_per_input_batch(spark_local, job_id, total)
    input_stages = stages[: first_run - 1] + stages[first_run : total - 1]
    if threshold == "0":
        assert set(input_stages) == {2}
    else:  # a full batch above the threshold, the restart's below
        assert input_stages[0] == 2 and input_stages[-1] == 1, input_stages
