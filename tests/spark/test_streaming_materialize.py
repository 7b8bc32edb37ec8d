"""Background materialization of transform_with_state queries
(``spark.statebackend.changelog.materialize-every``): checkpoints every K batches become
the base of later manifests, the changelog below them is deleted, metrics are recorded,
a restart at another parallelism is exact, and a changed staged output file of a signed
job is refused. Every check compares with a plain-Python computation of the same input.
A driver SIGKILLed while a materialization uploads: ``test_streaming_exactly_once``."""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery, StreamingQueryException

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.layout import batch_ids
from statebackend.checkpoint.metrics import (
    BatchMetrics,
    CheckpointMetrics,
    RestoreMetrics,
    read_history,
    records_of,
)
from statebackend.checkpoint.storage import CheckpointStorage
from tests.spark.jobs import SIGNING_KEY, streaming_session
from tests.spark.test_streaming_exactly_once import (
    MATERIALIZE_EVERY,
    expected_output,
    expected_totals,
    make_batches,
    read_output,
    run_to_parquet,
    state_totals,
    stateful_query,
    write_batch_files,
)


@pytest.fixture
def spark(spark_local: SparkSession, tmp_path: Path) -> Iterator[SparkSession]:
    with streaming_session(spark_local, tmp_path, (MATERIALIZE_EVERY, "2")) as session:
        yield session


def job_storage(tmp_path: Path, job_id: str) -> tuple[CheckpointStorage, ChangelogStorage]:
    storage = CheckpointStorage((tmp_path / "ours").as_uri(), job_id)
    return storage, ChangelogStorage(storage)


def _ticking_parquet_query(
    spark: SparkSession, input_dir: Path, out: Path, checkpoint: Path
) -> StreamingQuery:
    """Job ``totals`` at parallelism 2 over ``input_dir``, to parquet, a trigger every 10 ms."""
    return (
        stateful_query(spark, input_dir, "totals", 2)
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="10 milliseconds")
        .start()
    )


def test_materializations_become_the_base_and_a_rescaled_restart_is_exact(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Six batches at parallelism 2 materialize after batches 1, 3 (and 5); the newest
    manifest builds on the newest materialization before its batch and the records
    below the retained manifests' bases are gone; three more batches at parallelism 3
    rebuild every subtask from base + changelog. Output and state equal plain Python;
    the metrics history has a checkpoint record per materialization, the keys each
    batch touched and the rebuild."""
    batches = make_batches(9, seed=41)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches[:6])
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    assert read_output(spark, out) == expected_output(batches[:6])

    storage, changelog = job_storage(tmp_path, "totals")
    completed = {
        storage.load(n).properties["batch_id"]: n for n in storage.completed_checkpoint_ids()
    }
    # The one after batch 5 completes only if its ack came before the query ended.
    assert {1, 3} <= set(completed) <= {1, 3, 5}, completed
    newest = changelog.latest_manifest()
    assert newest is not None and newest.batch_id == 5 and newest.base is not None
    assert (newest.base.batch_id, newest.base.checkpoint_id) == (3, completed[3])
    assert {h.batch_id for h in newest.handles()} == {4, 5}
    oldest_base = min(
        base.batch_id
        for base in (changelog.load_manifest(b).base for b in changelog.manifest_ids())
        if base is not None
    )
    recorded = batch_ids(storage.fs.list_dir(storage.layout.changelog_dir))
    assert recorded and min(recorded) > oldest_base, (recorded, oldest_base)
    assert state_totals(spark, tmp_path / "ours" / "totals") == expected_totals(batches[:6])

    write_batch_files(input_dir, batches[6:], first=6)
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=3)
    written = read_output(spark, out)
    assert written == expected_output(batches)
    assert max(written.values()) == 1
    assert state_totals(spark, tmp_path / "ours" / "totals") == expected_totals(batches)

    history = read_history(storage.fs, storage.layout.job_dir)
    measured = records_of(history, CheckpointMetrics)
    assert {(m.batch_id, m.checkpoint_id) for m in measured} >= {
        (batch, n) for batch, n in completed.items()
    }
    assert all(m.full_bytes > 0 and m.subtasks for m in measured)
    # Each subtask counted its entries at the cut: a value per user it holds, at least.
    for m in measured:
        users = {user for rows in batches[: m.batch_id + 1] for user, _ in rows}
        assert sum(s.entries or 0 for s in m.subtasks) >= len(users), m
        assert all(s.entries is not None for s in m.subtasks), m
    keys = {m.batch_id: m.keys_touched for m in records_of(history, BatchMetrics)}
    assert keys == {b: len({user for user, _ in rows}) for b, rows in enumerate(batches)}
    (rebuild,) = records_of(history, RestoreMetrics)  # batch 6, at the new parallelism
    assert rebuild.subtasks == 3 and rebuild.restored_bytes > 0
    assert rebuild.checkpoint.endswith("manifests/5")


def test_signed_job_refuses_a_changed_staged_output(spark: SparkSession, tmp_path: Path) -> None:
    """With a signing key, manifest N holds the SHA-256 of each staged output file: when
    Spark runs a committed batch again, a staged file replaced by another well-formed
    one is refused, naming it, and nothing is published."""
    spark.conf.set(SIGNING_KEY, "0123456789abcdef-staged-output")
    batches = make_batches(2, seed=43)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches)
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=1)
    job = tmp_path / "ours" / "totals"
    checksums = json.loads((job / "manifests" / "1").read_text())["properties"]
    assert [c.split(":")[0] for c in checksums["output_checksums"]] == ["sha256"]
    (older,) = (job / "outputs" / "0").iterdir()
    (staged,) = (job / "outputs" / "1").iterdir()
    staged.write_bytes(older.read_bytes())
    shutil.rmtree(out)
    (checkpoint / "commits" / "1").unlink()  # Spark runs batch 1 again and publishes it
    with pytest.raises(Exception, match=f"{staged.name} does not match the signed checksum"):
        run_to_parquet(spark, input_dir, out, checkpoint, parallelism=1)
    assert not list(out.glob("part-1-*.parquet"))


def test_a_materialization_completing_after_its_manifest_was_deleted_becomes_the_base(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver reads the acks of the materialization after batch 1 only at its ninth
    poll, at batch 5 (as with uploads slower than three batches), when retention has
    deleted manifest 1: it still becomes the base, and the query goes on exactly."""
    real_poll = CheckpointCoordinator.poll
    polls: Counter[int] = Counter()

    def late_poll(self: CheckpointCoordinator, checkpoint_id: int) -> str | None:
        polls[checkpoint_id] += 1
        return None if polls[checkpoint_id] <= 8 else real_poll(self, checkpoint_id)

    monkeypatch.setattr(CheckpointCoordinator, "poll", late_poll)
    batches = make_batches(8, seed=44)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches)
    query = _ticking_parquet_query(spark, input_dir, out, checkpoint)
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    assert read_output(spark, out) == expected_output(batches)
    storage, changelog = job_storage(tmp_path, "totals")
    assert 1 not in changelog.manifest_ids()
    newest = changelog.latest_manifest()
    assert newest is not None and newest.batch_id == 7 and newest.base is not None
    assert newest.base.batch_id == 1, newest.base
    assert state_totals(spark, tmp_path / "ours" / "totals") == expected_totals(batches)


def test_stop_completes_a_materialization_still_pending_and_the_restart_builds_on_it(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acks of the materialization after batch 1 reach storage only after the run's
    last poll (as with uploads slower than the batches): ``query.stop()`` completes it,
    no incomplete checkpoint is left, and the restart's batch 2 builds on it instead of
    replaying every batch from the start; output and state equal plain Python."""
    real_poll = CheckpointCoordinator.poll
    acks_seen = False

    def late_poll(self: CheckpointCoordinator, checkpoint_id: int) -> str | None:
        return real_poll(self, checkpoint_id) if acks_seen else None

    monkeypatch.setattr(CheckpointCoordinator, "poll", late_poll)
    batches = make_batches(3, seed=47)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches[:2])
    query = _ticking_parquet_query(spark, input_dir, out, checkpoint)
    try:
        deadline = time.monotonic() + 120
        while not any(progress["batchId"] == 1 for progress in query.recentProgress):
            assert time.monotonic() < deadline, query.recentProgress
            assert not query.awaitTermination(0.1), query.exception()
        acks_seen = True
    finally:
        query.stop()
    storage, changelog = job_storage(tmp_path, "totals")
    completed = storage.completed_checkpoint_ids()
    assert [storage.load(n).properties["batch_id"] for n in completed] == [1]
    assert storage.checkpoint_ids() == completed

    write_batch_files(input_dir, batches[2:], first=2)
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    assert read_output(spark, out) == expected_output(batches)
    base = changelog.load_manifest(2).base
    assert base is not None and (base.batch_id, base.checkpoint_id) == (1, completed[0])
    assert state_totals(spark, tmp_path / "ours" / "totals") == expected_totals(batches)


def test_available_now_runs_of_one_batch_each_materialize(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Five availableNow runs of one batch each (materializing every 2 batches): the
    materialization cut at the end of a run's only batch completes in that run, so the
    base moves on, the changelog below it is deleted, and no pending checkpoint is left."""
    batches = make_batches(5, seed=45)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    storage, changelog = job_storage(tmp_path, "totals")
    for number, rows in enumerate(batches):
        write_batch_files(input_dir, [rows], first=number)
        run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    assert read_output(spark, out) == expected_output(batches)
    newest = changelog.latest_manifest()
    assert newest is not None and newest.batch_id == 4 and newest.base is not None
    assert newest.base.batch_id == 3, newest.base
    assert min(batch_ids(storage.fs.list_dir(storage.layout.changelog_dir))) > 1
    assert storage.checkpoint_ids() == storage.completed_checkpoint_ids()
    assert state_totals(spark, tmp_path / "ours" / "totals") == expected_totals(batches)


def test_a_lost_state_directory_fails_the_query_instead_of_starting_empty(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The job's state directory deleted while the Spark checkpointLocation is at batch
    2: the next batch fails, naming the missing state, instead of running on empty
    state; nothing more is published."""
    batches = make_batches(3, seed=46)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches[:2])
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    shutil.rmtree(tmp_path / "ours" / "totals")
    write_batch_files(input_dir, batches[2:], first=2)
    with pytest.raises(StreamingQueryException, match="has no committed batch"):
        run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    assert read_output(spark, out) == expected_output(batches[:2])


def test_a_damaged_materialization_no_manifest_builds_on_yet_is_not_adopted(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The materialization after batch 1 completes in the availableNow run's last batch,
    so no manifest builds on it yet; its ``_metadata`` is then damaged. The next run (at
    parallelism 3) goes on from the newest manifest (no base: the records of batches 0
    and 1), warning about the checkpoint, instead of failing at every start; output and
    state equal plain Python."""
    batches = make_batches(4, seed=48)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches[:2])
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    storage, changelog = job_storage(tmp_path, "totals")
    (damaged,) = storage.completed_checkpoint_ids()
    assert storage.load(damaged).properties["batch_id"] == 1
    newest = changelog.latest_manifest()
    assert newest is not None and newest.batch_id == 1 and newest.base is None
    metadata = tmp_path / "ours" / "totals" / f"chk-{damaged}" / "_metadata"
    metadata.write_bytes(metadata.read_bytes()[:-40])

    write_batch_files(input_dir, batches[2:], first=2)
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=3)
    written = read_output(spark, out)
    assert written == expected_output(batches)
    assert max(written.values()) == 1
    base = changelog.load_manifest(2).base
    assert base is None or base.checkpoint_id != damaged, base
    assert f"chk-{damaged}" in caplog.text
    assert state_totals(spark, tmp_path / "ours" / "totals") == expected_totals(batches)


def test_a_damaged_base_stops_the_query_saying_what_to_do(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A file of the base the newest manifest builds on is damaged and no local copy
    holds the state: the next batch fails naming the file and saying how to go on, and
    publishes nothing."""
    batches = make_batches(4, seed=47)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches[:3])
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    _, changelog = job_storage(tmp_path, "totals")
    newest = changelog.load_manifest(changelog.manifest_ids()[-1])
    assert newest.base is not None and newest.batch_id == 2
    base_dir = tmp_path / "ours" / "totals" / f"chk-{newest.base.checkpoint_id}"
    damaged = next(p for p in sorted(base_dir.iterdir()) if p.name != "_metadata")
    damaged.write_bytes(damaged.read_bytes()[:-3] + b"xyz")
    # No local copy (a fresh local.dir; deleting the old one races with the workers
    # closing their databases after the tasks): the subtasks rebuild from storage.
    spark.conf.set("spark.statebackend.local.dir", str(tmp_path / "local-elsewhere"))
    write_batch_files(input_dir, batches[3:], first=3)
    with pytest.raises(StreamingQueryException) as failure:
        run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    message = str(failure.value)
    assert damaged.name in message and "put the file back" in message
    assert "restore_from=" in message and "statebackend list" in message
    assert read_output(spark, out) == expected_output(batches[:3])
