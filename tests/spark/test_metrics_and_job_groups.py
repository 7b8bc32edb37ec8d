"""Observability of real runs: the metrics history a StatefulJob and a transform_with_state
batch leave in the job directory, and the Spark job groups that label their Spark jobs,
checked against the input the tests wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statebackend.checkpoint.filesystem import open_filesystem
from statebackend.checkpoint.layout import JobLayout
from statebackend.checkpoint.metrics import (
    BatchMetrics,
    CheckpointMetrics,
    RestoreMetrics,
    read_history,
    records_of,
)
from statebackend.spark.arrow_path import OPERATOR_ID as STREAM_OPERATOR_ID
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.example import OPERATOR_ID, generate_events
from statebackend.spark.job_groups import job_group_id
from statebackend.spark.streaming import transform_with_state
from tests.spark.jobs import run_user_totals, settings, state_per_batch, streaming_session
from tests.spark.streaming_parity import write_batches
from tests.spark.test_streaming_api import OUTPUT, Totals

EVENTS = 400


def _history(url: str, job_id: str) -> list:
    fs = open_filesystem(url)
    return read_history(fs, JobLayout(url, job_id).job_dir)


def test_a_job_run_records_every_batch_and_checkpoint_and_labels_its_spark_jobs(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    url = (tmp_path / "checkpoints").as_uri()
    generate_events(tmp_path / "input", EVENTS, 30, 3, 11)
    conf = StateBackendConf(checkpoint_dir=url, local_dir=str(tmp_path / "local"))
    options = {"job_id": "observed", "batch_size": 60, "checkpoint_every": 2}
    summary = run_user_totals(
        spark_local, tmp_path, conf, parallelism=2, output_dir=str(tmp_path / "output"), **options
    )

    history = _history(url, "observed")
    batches = records_of(history, BatchMetrics)
    assert [b.batch_id for b in batches] == list(range(summary.batches))
    assert sum(b.records_in for b in batches) == EVENTS  # what generate_events wrote
    assert sum(b.records_out for b in batches) == summary.outputs
    assert all(b.changelog_bytes > 0 for b in batches if b.records_in)
    assert all(b.changelog_seconds > 0 and b.manifest_seconds > 0 for b in batches)
    checkpoints = records_of(history, CheckpointMetrics)
    assert [f"chk-{c.checkpoint_id}" for c in checkpoints] == [
        Path(path).name for path in summary.checkpoints
    ]
    assert all(c.full_bytes + c.incremental_bytes > 0 for c in checkpoints)
    # Every keyed subtask counts its entries at the cut; each of the 30 users has some.
    keyed = [s for s in checkpoints[-1].subtasks if s.operator_id == OPERATOR_ID]
    assert sorted(s.subtask for s in keyed) == [0, 1]
    assert all(s.entries is not None and s.entries > 0 for s in keyed)
    assert sum(s.entries or 0 for s in keyed) >= 30

    # A run at another parallelism records the restore from what it restored (not from
    # the manifest its own first batch commits).
    generate_events(tmp_path / "input", EVENTS, 30, 3, 12)
    resumed = run_user_totals(spark_local, tmp_path, conf, parallelism=3, **options)
    (restore,) = records_of(_history(url, "observed"), RestoreMetrics)
    assert resumed.restored_from and restore.checkpoint == resumed.restored_from

    tracker = spark_local.sparkContext.statusTracker()
    for batch_id in range(summary.batches):
        group = job_group_id("observed", OPERATOR_ID, batch_id)
        assert tracker.getJobIdsForGroup(group), group
    assert spark_local.sparkContext.getLocalProperty("spark.jobGroup.id") is None


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_a_job_runs_batches_record_what_their_state_did(
    spark_local: SparkSession, tmp_path: Path, backend: str
) -> None:
    """A StatefulJob's batches record the state entries they wrote and removed, the
    entries held after them (heap: exact; RocksDB: not counted) and RocksDB's memory, as
    a transform_with_state query's do, equal to a plain-Python count of the input."""
    generate_events(tmp_path / "input", 240, 30, 3, 5)
    conf = settings(
        tmp_path,
        ("spark.statebackend.backend", backend),
        ("spark.statebackend.local.dir", str(tmp_path / "local")),
    )
    summary = run_user_totals(
        spark_local, tmp_path, conf, job_id="counted", parallelism=2, batch_size=25
    )
    assert summary.failures == 0

    history = _history(conf.checkpoint_dir, "counted")
    batches = [b for b in records_of(history, BatchMetrics) if b.records_in]
    expected = state_per_batch(tmp_path / "input", 3, 25)
    assert [b.state_rows_written for b in batches] == [written for written, _ in expected]
    assert all(b.state_rows_removed == 0 for b in batches)  # the example removes nothing
    assert all(b.timers_registered == b.timers_removed == b.timers_fired == 0 for b in batches)
    if backend == "heap":
        assert [b.state_rows for b in batches] == [held for _, held in expected]
        assert all(b.state_memory_bytes is None for b in batches)
    else:
        assert all(b.state_rows is None for b in batches)
        assert all(b.state_memory_bytes is not None and b.state_memory_bytes > 0 for b in batches)


def test_a_streaming_batch_records_its_metrics_and_labels_its_spark_jobs(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    url = (tmp_path / "ours").as_uri()
    spark_local.conf.set("spark.statebackend.checkpoint.dir", url)
    spark_local.conf.set("spark.statebackend.local.dir", str(tmp_path / "local"))
    try:
        rows = [("a", 1, 10), ("b", 2, 20), ("a", 3, 30), ("c", 4, 40), ("d", 5, 50)]
        events = spark_local.createDataFrame(rows, "user string, amount long, ts long")
        stateful = transform_with_state(events, "user", Totals(), OUTPUT, "observed-stream")
        assert stateful.toDF().count() == len({user for user, _, _ in rows})
    finally:
        spark_local.conf.unset("spark.statebackend.checkpoint.dir")
        spark_local.conf.unset("spark.statebackend.local.dir")

    latest = stateful.metrics.latest["batch"]
    assert isinstance(latest, BatchMetrics)
    assert (latest.batch_id, latest.records_in, latest.records_out) == (0, len(rows), 4)
    assert records_of(_history(url, "observed-stream"), BatchMetrics) == [latest]
    group = job_group_id("observed-stream", STREAM_OPERATOR_ID, 0)
    assert spark_local.sparkContext.statusTracker().getJobIdsForGroup(group)


def test_a_streaming_querys_batches_record_where_their_time_went(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """Each batch of a transform_with_state query records, as a StatefulJob's does, the
    seconds of its changelog write, of the manifest's commit and of the Spark job beyond
    its slowest subtask (source and shuffle), within the batch's duration Spark reports."""
    batches = [
        [{"user": "a", "amount": 1}, {"user": "b", "amount": 2}, {"user": "a", "amount": 3}],
        [{"user": "c", "amount": 4}],
    ]
    write_batches(tmp_path / "input", batches)
    url = (tmp_path / "ours").as_uri()
    with streaming_session(spark_local, tmp_path) as spark:
        source = (
            spark.readStream.schema("user string, amount long")
            .option("maxFilesPerTrigger", 1)
            .json(str(tmp_path / "input"))
        )
        query = (
            transform_with_state(source, "user", Totals(), OUTPUT, "timed-stream")
            .writeStream.foreachBatch(lambda df, batch_id: None)
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
    durations = {p["batchId"]: p["batchDuration"] / 1000 for p in query.recentProgress}

    recorded = records_of(_history(url, "timed-stream"), BatchMetrics)
    assert [(b.batch_id, b.records_in) for b in recorded] == [
        (batch_id, len(rows)) for batch_id, rows in enumerate(batches)
    ]
    for b in recorded:
        assert b.changelog_seconds > 0 and b.manifest_seconds > 0 and b.shuffle_seconds > 0
        subtask = b.keyed_seconds + b.changelog_seconds + b.sync_cut_seconds
        assert b.shuffle_seconds + subtask + b.manifest_seconds <= durations[b.batch_id]

    # The keyed jobs ran in the query's job group (its runId, which stop() cancels).
    tracker = spark_local.sparkContext.statusTracker()
    assert tracker.getJobIdsForGroup(str(query.runId))
    assert not tracker.getJobIdsForGroup(job_group_id("timed-stream", STREAM_OPERATOR_ID, 0))
