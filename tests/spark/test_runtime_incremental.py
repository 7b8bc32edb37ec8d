"""Incremental checkpoints in the Spark runtime (``checkpoint.incremental=true``): keyed
subtasks upload SST files to shared/, and a rescale P = 2 -> 3 from them is exact.
(That unchanged SSTs are uploaded once is tested in tests/s3/test_incremental_checkpoints.py.)"""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession

from statebackend.spark.conf import StateBackendConf
from statebackend.spark.example import (
    checkpointed_totals,
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
    user_totals_job,
)


def test_incremental_rescale_matches_python(spark_local: SparkSession, tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    conf = StateBackendConf.from_pairs(
        [
            ("spark.statebackend.checkpoint.dir", checkpoints.as_uri()),
            ("spark.statebackend.checkpoint.incremental", "true"),
            ("spark.statebackend.local.dir", str(tmp_path / "local")),
        ]
    )
    assert conf.incremental
    for seed, parallelism in enumerate((2, 3)):
        generate_events(tmp_path / "input", 600, 40, 4, seed)
        summary = user_totals_job(
            spark_local,
            job_id="incremental",
            input_dir=tmp_path / "input",
            parallelism=parallelism,
            conf=conf,
            batch_size=100,
            checkpoint_every=2,
        ).run()
        assert summary.failures == 0
    shared = list((checkpoints / "incremental" / "shared").iterdir())
    assert shared and all(p.name.endswith(".sst") for p in shared)
    last = summary.last_checkpoint
    assert last is not None
    metadata = (Path(last.removeprefix("file://")) / "_metadata").read_text()
    assert '"keyed-incremental"' in metadata and "../shared/" in metadata
    expected = expected_totals(read_events(tmp_path / "input"))
    assert compare_totals(expected, checkpointed_totals(spark_local, last, {})) == []
