"""Multi-host: parity with Spark and an exactly-once restart at another parallelism on
``local-cluster[2,1,1024]`` (two executor JVMs), each executor keeping its RocksDB
copies in a directory of its own: a relative ``spark.statebackend.local.dir`` resolves
against each executor's working directory, so no executor can see another's copies and
a subtask that moves rebuilds from storage alone."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.storage import CheckpointStorage
from tests.spark import test_streaming_exactly_once, test_streaming_parity
from tests.spark.jobs import streaming_session
from tests.spark.streaming_parity import ParityCase, run_parity

PRIVATE_LOCAL_DIR = "statebackend-local"
"""Relative: one directory per executor, under its working directory."""


def executor_local_dirs(spark: SparkSession, job_id: str) -> list[Path]:
    """The executors' local directories holding state of ``job_id`` (the standalone
    worker runs each executor in ``$SPARK_HOME/work/<application>/<executor>``)."""
    work = Path(os.environ["SPARK_HOME"]) / "work" / spark.sparkContext.applicationId
    return sorted(
        executor / PRIVATE_LOCAL_DIR
        for executor in work.iterdir()
        if (executor / PRIVATE_LOCAL_DIR / job_id).is_dir()
    )


@pytest.fixture
def spark(spark_cluster: SparkSession, tmp_path: Path) -> Iterator[SparkSession]:
    materialize = (test_streaming_exactly_once.MATERIALIZE_EVERY, "2")
    with streaming_session(
        spark_cluster, tmp_path, materialize, local_dir=PRIVATE_LOCAL_DIR
    ) as session:
        yield session


def test_parity_on_two_executors(spark_cluster: SparkSession, tmp_path: Path) -> None:
    parity = test_streaming_parity
    case = ParityCase(parity.INPUT, ["user"], parity.AllStates, parity.OUTPUT)
    theirs, ours = run_parity(
        spark_cluster, case, parity.BATCHES, tmp_path, **{"local.dir": PRIVATE_LOCAL_DIR}
    )
    expected = parity._expected(parity.BATCHES)
    assert theirs == expected
    assert ours == expected
    assert len(executor_local_dirs(spark_cluster, "parity")) == 2


def test_restart_at_another_parallelism_on_two_executors(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Materializing every 2 batches: both executors cut and upload their subtasks'
    state, and the restart rebuilds from a materialized base plus changelog."""
    test_streaming_exactly_once.restart_at_another_parallelism(spark, tmp_path)
    assert len(executor_local_dirs(spark, "totals")) == 2
    storage = CheckpointStorage((tmp_path / "ours").as_uri(), "totals")
    newest = ChangelogStorage(storage).latest_manifest()
    assert newest is not None and newest.base is not None
    assert storage.is_completed(newest.base.checkpoint_id)
