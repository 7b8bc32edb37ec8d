"""``spark.state_reader.read_state`` on a batch manifest: each partition rebuilds one
subtask's key groups from base + changelog records on an executor; the rows equal the
plain-Python model of the job (``tests/s3/changelog_jobs.changelog_job``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statebackend.checkpoint.layout import join
from statebackend.checkpoint.signing import SigningKey
from statebackend.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    ConfigurationError,
    StateAccessError,
)
from statebackend.spark.state_reader import read_state
from tests.conftest import Storage
from tests.s3.changelog_jobs import changelog_job, expected_values
from tests.s3.test_checkpoint_matrix import OPERATOR
from tests.unit.test_bulk_restore import checkpoint as incremental_checkpoint


def test_read_state_of_a_manifest_equals_the_model(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    with changelog_job(Storage(tmp_path.as_uri()), tmp_path) as job:
        manifest = job.manifest(5)
        counts = read_state(spark_local, manifest, OPERATOR, "count")
        assert counts.rdd.getNumPartitions() == 3  # the subtasks of batch 5
        assert dict(counts.collect()) == expected_values(job, 5, "count")
        latest = read_state(spark_local, join(job.job_dir, "latest"), OPERATOR, "attrs")
        assert {k: json.loads(v) for k, v in latest.collect()} == expected_values(job, 5, "attrs")
        with pytest.raises(StateAccessError, match="no keyed state 'nope'"):
            read_state(spark_local, manifest, OPERATOR, "nope")
        with pytest.raises(CheckpointCorruptedError, match="is not signed"):
            read_state(spark_local, manifest, OPERATOR, "count", signing_key=SigningKey(b"k" * 16))


def test_a_location_that_is_no_path_is_one_clear_error(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """``RunSummary.last_checkpoint`` of a run that took none is None: read_state raised a
    bare AttributeError from deep in path handling. A pathlib.Path is a location too."""
    with pytest.raises(ConfigurationError, match=r"^checkpoint None is invalid: give the"):
        read_state(spark_local, None, OPERATOR, "count")  # type: ignore[arg-type]
    with pytest.raises(CheckpointNotFoundError, match="is not a completed checkpoint"):
        read_state(spark_local, tmp_path, OPERATOR, "count")


def test_read_state_downloads_into_the_sessions_local_dir(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """The tasks of read_state download (an incremental checkpoint's files, a manifest's
    base) into spark.statebackend.local.dir, not the system's temp directory: where it is
    a file, reading fails naming it; as a directory, the rows equal the model and
    nothing stays in it."""
    storage, checkpoint, model = incremental_checkpoint(tmp_path / "incremental", True)
    storage.close()
    with changelog_job(Storage((tmp_path / "job").as_uri()), tmp_path / "job") as job:
        reads = [
            (checkpoint, "op", {key: count for key, (count, _) in model.items()}),
            (job.manifest(5), OPERATOR, expected_values(job, 5, "count")),
        ]
        local = tmp_path / "local"
        try:
            local.write_text("not a directory")
            spark_local.conf.set("spark.statebackend.local.dir", str(local))
            for source, operator, _ in reads:
                rows = read_state(spark_local, source, operator, "count")
                with pytest.raises(Exception, match=f"the local directory {local} is unusable"):
                    rows.collect()
            local.unlink()
            for source, operator, expected in reads:
                assert dict(read_state(spark_local, source, operator, "count").collect()) == (
                    expected
                )
        finally:
            spark_local.conf.unset("spark.statebackend.local.dir")
        assert [path for path in local.rglob("*") if path.is_file()] == []
