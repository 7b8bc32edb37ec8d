"""Incremental checkpoints in the Spark runtime (``checkpoint.incremental=true``): keyed
subtasks upload SST files to shared/, and a rescale P = 2 -> 3 from them is exact.
(That unchanged SSTs are uploaded once is tested in tests/s3/test_incremental_checkpoints.py.)"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession

from tests.spark.jobs import assert_matches_python, rescale_runs, settings


def test_incremental_rescale_matches_python(spark_local: SparkSession, tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    conf = settings(
        tmp_path,
        ("spark.statebackend.checkpoint.incremental", "true"),
        ("spark.statebackend.local.dir", str(tmp_path / "local")),
    )
    assert conf.incremental
    summaries = rescale_runs(
        spark_local,
        tmp_path,
        conf,
        (2, 3),
        600,
        job_id="incremental",
        batch_size=100,
        checkpoint_every=2,
    )
    assert all(summary.failures == 0 for summary in summaries)
    shared = list((checkpoints / "incremental" / "shared").iterdir())
    assert shared and all(p.name.endswith(".sst") for p in shared)
    last = summaries[-1].last_checkpoint
    assert last is not None
    metadata = (Path(last.removeprefix("file://")) / "_metadata").read_text()
    assert '"keyed-incremental"' in metadata and "../shared/" in metadata
    assert_matches_python(spark_local, tmp_path, last, {})
