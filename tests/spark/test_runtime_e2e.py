"""End to end: the example job rescaled P = 2 -> 4 -> 1 -> 3 with input appended between
runs ends with the state a plain-Python computation gives, on file:// and s3://, in
local[2] and local-cluster; batches between restores reuse the executor-local RocksDB.
And which batch takes a run's final checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statebackend.errors import SourceError
from statebackend.spark.conf import DEFAULT_SINGLE_STAGE_BYTES, StateBackendConf
from statebackend.spark.example import (
    checkpointed_totals,
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
    user_totals_job,
)
from statebackend.spark.runner import RunSummary
from statebackend.spark.source import partition_path
from statebackend.tools.location import open_checkpoint
from tests.conftest import Storage

EVENTS_PER_RUN = 1000
USERS = 60
PARTITIONS = 4


def _run(
    spark: SparkSession, tmp_path: Path, storage: Storage, parallelism: int, job_id: str
) -> RunSummary:
    conf = StateBackendConf(
        checkpoint_dir=storage.url,
        storage_options=storage.storage_options,
        local_dir=str(tmp_path / "local"),
    )
    return user_totals_job(
        spark,
        job_id=job_id,
        input_dir=tmp_path / "input",
        parallelism=parallelism,
        conf=conf,
        batch_size=100,
        checkpoint_every=2,
        output_dir=str(tmp_path / "output"),
    ).run()


def _rescale(
    spark: SparkSession, tmp_path: Path, storage: Storage, parallelisms: tuple[int, ...]
) -> list[RunSummary]:
    summaries = []
    for seed, parallelism in enumerate(parallelisms):
        generate_events(tmp_path / "input", EVENTS_PER_RUN, USERS, PARTITIONS, seed)
        summaries.append(_run(spark, tmp_path, storage, parallelism, "e2e"))
    expected = expected_totals(read_events(tmp_path / "input"))
    last = summaries[-1].last_checkpoint
    assert last is not None
    assert compare_totals(expected, checkpointed_totals(spark, last, storage.storage_options)) == []
    return summaries


def _check_summaries(summaries: list[RunSummary], parallelisms: tuple[int, ...]) -> None:
    assert sum(s.records for s in summaries) == EVENTS_PER_RUN * len(parallelisms)
    for summary, parallelism in zip(summaries, parallelisms, strict=True):
        assert summary.failures == 0
        assert summary.parallelism == parallelism
        # The first batch restores (or starts empty); every later one reuses the local DB
        # and reads nothing from checkpoint storage.
        assert summary.reused_subtasks[1:] == [parallelism] * (summary.batches - 1)
        assert summary.restored_bytes[1:] == [0] * (summary.batches - 1)
    assert summaries[0].restored_bytes[0] == 0
    assert all(s.restored_bytes[0] > 0 for s in summaries[1:])


def test_rescale_local(spark_local: SparkSession, tmp_path: Path, checkpoint_url: Storage) -> None:
    """P = 2 -> 4 -> 1 -> 3 in local[2], on file:// and on s3://."""
    parallelisms = (2, 4, 1, 3)
    summaries = _rescale(spark_local, tmp_path, checkpoint_url, parallelisms)
    _check_summaries(summaries, parallelisms)
    # Every partition was consumed to its end.
    assert summaries[-1].records > 0
    assert sum(partition_path(tmp_path / "input", p).stat().st_size for p in range(4)) > 0


def test_rerun_without_new_input_changes_nothing(spark_local: SparkSession, tmp_path: Path) -> None:
    """A run over input that was fully consumed reads nothing and takes no checkpoint."""
    storage = Storage(tmp_path.as_uri() + "/checkpoints")
    generate_events(tmp_path / "input", 300, 20, PARTITIONS, 7)
    first = _run(spark_local, tmp_path, storage, 2, "rerun")
    again = _run(spark_local, tmp_path, storage, 3, "rerun")
    assert first.records == 300
    assert again.records == 0 and again.batches == 0 and again.checkpoints == []
    assert again.restored_from == first.last_checkpoint


def test_rescale_cluster(
    spark_cluster: SparkSession, tmp_path: Path, checkpoint_url: Storage
) -> None:
    """P = 2 -> 4 -> 1 -> 3 on two executor JVMs, on file:// and on s3://."""
    parallelisms = (2, 4, 1, 3)
    summaries = _rescale(spark_cluster, tmp_path, checkpoint_url, parallelisms)
    assert sum(s.records for s in summaries) == EVENTS_PER_RUN * len(parallelisms)
    assert all(s.failures == 0 for s in summaries)


FINAL_BATCH_LINES = 50
"""Lines per partition and batch of the final-checkpoint test."""


@pytest.mark.parametrize(
    ("single_stage_bytes", "empty_batches"),
    [(DEFAULT_SINGLE_STAGE_BYTES, 0), (0, 1)],
    ids=["one-stage", "shuffled"],
)
def test_the_batch_that_reads_the_last_input_takes_the_final_checkpoint(
    spark_local: SparkSession, tmp_path: Path, single_stage_bytes: int, empty_batches: int
) -> None:
    """The batch that reads the last of the input takes the run's final checkpoint when
    the driver can tell beforehand (a batch run as one stage, whose end the driver
    fixes): no empty batch, one more Spark job, follows. A batch of source tasks and a
    shuffle cannot tell, and an empty batch takes it. Either way the state is exact."""
    generate_events(tmp_path / "input", 600, 30, 4, seed=3)
    lines = [len(path.read_bytes().splitlines()) for path in (tmp_path / "input").iterdir()]
    batches = -(-max(lines) // FINAL_BATCH_LINES) + empty_batches
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
        batch_size=FINAL_BATCH_LINES,
        checkpoint_every=10,
    ).run()
    assert summary.records == 600
    assert summary.batches == batches
    assert summary.last_checkpoint is not None
    final = open_checkpoint(summary.last_checkpoint).metadata
    assert int(final.properties["next_batch"]) == batches
    expected = expected_totals(read_events(tmp_path / "input"))
    assert compare_totals(expected, checkpointed_totals(spark_local, summary.last_checkpoint)) == []


def test_restoring_an_older_checkpoint_drops_the_output_of_the_abandoned_batches(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """A run restored from an older checkpoint abandons the later batches (their
    manifests are deleted): their output goes too, so the output directory holds each
    user's running count once per batch of one history, ending at the plain-Python count,
    even when the new history has fewer batches than the abandoned one."""
    conf = StateBackendConf(
        checkpoint_dir=tmp_path.joinpath("ckpt").as_uri(), local_dir=str(tmp_path / "local")
    )
    output = tmp_path / "output"

    def run(batch_size: int, restore: str | None = "latest") -> RunSummary:
        return user_totals_job(
            spark_local,
            job_id="older",
            input_dir=tmp_path / "input",
            parallelism=2,
            conf=conf,
            batch_size=batch_size,
            checkpoint_every=100,
            restore=restore,
            output_dir=str(output),
        ).run()

    generate_events(tmp_path / "input", 200, 10, PARTITIONS, seed=1)
    first = run(batch_size=20)
    generate_events(tmp_path / "input", 400, 10, PARTITIONS, seed=2)
    run(batch_size=10)  # many small batches
    assert first.last_checkpoint is not None
    again = run(batch_size=1000, restore=first.last_checkpoint)  # one batch re-reads the rest

    counts: dict[str, list[int]] = {}
    for directory in sorted(output.glob("batch-*")):
        for part in sorted(directory.glob("part-*.jsonl")):
            for line in part.read_text().splitlines():
                row = json.loads(line)
                counts.setdefault(row["user"], []).append(row["count"])
    expected = expected_totals(read_events(tmp_path / "input"))
    assert again.last_checkpoint is not None
    assert {user: values[-1] for user, values in counts.items()} == {
        user: totals["count"] for user, totals in expected.items()
    }
    assert all(values == sorted(set(values)) for values in counts.values()), counts


def test_a_run_stopped_after_restoring_an_older_checkpoint_resumes_its_own_batches(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """A run restored from an older checkpoint that stops (here on a malformed line)
    after committing batches but before its first checkpoint resumes, with "latest", from
    its own newest batch, not from a checkpoint of the abandoned later batches: the
    output then holds each user's running count once per batch, ending at the plain-
    Python count."""
    conf = StateBackendConf(
        checkpoint_dir=tmp_path.joinpath("ckpt").as_uri(),
        local_dir=str(tmp_path / "local"),
        retained=10,
    )
    output = tmp_path / "output"

    def run(batch_size: int, every: int, restore: str, on_malformed: str) -> RunSummary:
        return user_totals_job(
            spark_local,
            job_id="stopped",
            input_dir=tmp_path / "input",
            parallelism=2,
            conf=conf,
            on_malformed=on_malformed,
            batch_size=batch_size,
            checkpoint_every=every,
            restore=restore,
            output_dir=str(output),
        ).run()

    generate_events(tmp_path / "input", 200, 10, PARTITIONS, seed=1)
    with partition_path(tmp_path / "input", 0).open("a", encoding="utf-8") as f:
        f.write("not json\n")
    generate_events(tmp_path / "input", 200, 10, PARTITIONS, seed=2)
    first = run(batch_size=10, every=2, restore="none", on_malformed="skip")
    older = first.checkpoints[0]  # of batch 1 or 2: before the malformed line
    assert len(first.checkpoints) >= 3
    with pytest.raises(SourceError):  # commits a few small batches, then stops
        run(batch_size=8, every=100, restore=older, on_malformed="fail")
    run(batch_size=1000, every=100, restore="latest", on_malformed="skip")

    counts: dict[str, list[int]] = {}
    for directory in sorted(output.glob("batch-*"), key=lambda d: int(d.name.split("-")[1])):
        for part in sorted(directory.glob("part-*.jsonl")):
            for line in part.read_text().splitlines():
                row = json.loads(line)
                counts.setdefault(row["user"], []).append(row["count"])
    events = []
    for path in sorted((tmp_path / "input").glob("partition-*.jsonl")):
        for line in path.read_text().splitlines():
            if line != "not json":
                events.append(json.loads(line))
    expected = {user: totals["count"] for user, totals in expected_totals(events).items()}
    assert {user: values[-1] for user, values in counts.items()} == expected
    assert all(values == sorted(set(values)) for values in counts.values()), counts
