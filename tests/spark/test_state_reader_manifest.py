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
