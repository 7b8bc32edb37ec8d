"""A run's final checkpoint: the batch that reads the last of the input takes it when the
driver can tell beforehand (a batch run as one stage, whose end the driver fixes), so no
empty batch (one more Spark job) follows; a batch of source tasks and a shuffle cannot
tell, and an empty batch takes it. Either way the final state is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statebackend.spark.conf import DEFAULT_SINGLE_STAGE_BYTES, StateBackendConf
from statebackend.spark.example import (
    checkpointed_totals,
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
    user_totals_job,
)
from statebackend.tools.location import open_checkpoint

BATCH_LINES = 50
"""Lines per partition and batch."""


@pytest.mark.parametrize(
    ("single_stage_bytes", "empty_batches"),
    [(DEFAULT_SINGLE_STAGE_BYTES, 0), (0, 1)],
    ids=["one-stage", "shuffled"],
)
def test_the_batch_that_reads_the_last_input_takes_the_final_checkpoint(
    spark_local: SparkSession, tmp_path: Path, single_stage_bytes: int, empty_batches: int
) -> None:
    generate_events(tmp_path / "input", 600, 30, 4, seed=3)
    lines = [len(path.read_bytes().splitlines()) for path in (tmp_path / "input").iterdir()]
    batches = -(-max(lines) // BATCH_LINES) + empty_batches
    conf = StateBackendConf(
        checkpoint_dir=tmp_path.joinpath("ckpt").as_uri(),
        local_dir=str(tmp_path / "local"),
        single_stage_bytes=single_stage_bytes,
    )
    summary = user_totals_job(
        spark_local,
        job_id="final",
        input_dir=tmp_path / "input",
        parallelism=2,
        conf=conf,
        batch_size=BATCH_LINES,
        checkpoint_every=10,
    ).run()
    assert summary.records == 600
    assert summary.batches == batches
    assert summary.last_checkpoint is not None
    final = open_checkpoint(summary.last_checkpoint).metadata
    assert int(final.properties["next_batch"]) == batches
    expected = expected_totals(read_events(tmp_path / "input"))
    assert compare_totals(expected, checkpointed_totals(spark_local, summary.last_checkpoint)) == []
