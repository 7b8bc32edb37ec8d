"""``transform_with_state(..., restore_from=SAVEPOINT)``: a new query (new
checkpointLocation, new job_id) starts from another job's savepoint at another
parallelism, continues its state exactly (compared with plain Python over the old and
the new input), stops depending on the savepoint after its first materialization, and
each bad ``restore_from`` is one clear error before any batch runs."""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StatefulProcessor, StreamingQueryException

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import open_filesystem
from statebackend.checkpoint.requests import request_savepoint, wait_for_savepoint
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from statebackend.errors import ConfigurationError, IncompatibleStateError
from statebackend.spark.streaming import transform_with_state
from tests.spark.jobs import lose_local_state, streaming_session
from tests.spark.test_streaming_exactly_once import (
    OutputRows,
    example,
    expected_output,
    expected_totals,
    make_batches,
    read_output,
    state_totals,
    totals_at,
    write_batch_files,
)

MAX_PARALLELISM = "spark.statebackend.max-parallelism"

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def spark(spark_local: SparkSession, tmp_path: Path) -> Iterator[SparkSession]:
    with streaming_session(spark_local, tmp_path) as session:
        yield session


def _source(spark: SparkSession, input_dir: Path) -> Any:
    return (
        spark.readStream.schema(example.INPUT_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(input_dir))
    )


def _run(
    spark: SparkSession,
    input_dir: Path,
    out: Path,
    checkpoint: Path,
    job_id: str,
    parallelism: int,
    restore_from: str | None = None,
) -> None:
    stateful = transform_with_state(
        _source(spark, input_dir),
        key_by="user",
        processor=example.UserTotals(),
        output_schema=example.OUTPUT_SCHEMA,
        job_id=job_id,
        parallelism=parallelism,
        restore_from=restore_from,
    )
    query = (
        stateful.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def _fold(job_dir: Path, savepoint: Path) -> None:
    """``statebackend savepoint create --from <job>/latest --to SAVEPOINT``."""
    assert main(["savepoint", "create", "--from", f"{job_dir}/latest", "--to", str(savepoint)]) == 0


def _shifted(rows: OutputRows, first: int) -> OutputRows:
    """The rows of batches ``first``... of one run, numbered from 0 as a new query does."""
    return Counter({(b - first, row): n for (b, row), n in rows.items() if b >= first})


def _old_job(spark: SparkSession, tmp_path: Path, batches: list[Any]) -> Path:
    """Run ``batches`` as job ``v1`` at parallelism 2 and fold its state into a savepoint;
    the savepoint's path."""
    write_batch_files(tmp_path / "in-v1", batches)
    _run(spark, tmp_path / "in-v1", tmp_path / "out-v1", tmp_path / "ckpt-v1", "v1", 2)
    savepoint = tmp_path / "savepoints" / "v1"
    _fold(tmp_path / "ours" / "v1", savepoint)
    return savepoint


def test_a_new_query_continues_from_a_savepoint_at_another_parallelism(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Job v1 runs four batches at parallelism 2; its savepoint starts job v2 (a new
    checkpointLocation and input) at parallelism 3: v2's rows are those plain Python
    gives for v1's and v2's input together, from v2's first batch on. v2's first batch
    materializes, so once that completes the savepoint can go: v2 restarts, its local
    copies lost, with the same ``restore_from`` and rebuilds from its own storage.
    ``inspect`` and ``list`` name the savepoint as the base of v2's first manifest;
    ``inspect`` of v2's directory or checkpointLocation says what to give instead."""
    batches = make_batches(8, seed=71)
    savepoint = _old_job(spark, tmp_path, batches[:4])
    v2 = tmp_path / "ours" / "v2"

    write_batch_files(tmp_path / "in-v2", batches[4:7])
    new_query = (tmp_path / "in-v2", tmp_path / "out-v2", tmp_path / "ckpt-v2", "v2")
    _run(spark, *new_query, 3, str(savepoint))
    assert read_output(spark, tmp_path / "out-v2") == _shifted(expected_output(batches[:7]), 4)
    assert state_totals(spark, v2) == expected_totals(batches[:7])

    storage = CheckpointStorage((tmp_path / "ours").as_uri(), "v2")
    cut = {storage.load(n).properties["batch_id"] for n in storage.completed_checkpoint_ids()}
    assert 0 in cut, cut
    newest = ChangelogStorage(storage).latest_manifest()
    assert newest is not None and newest.base is not None
    assert newest.base.path.startswith("../"), newest.base  # the job's own checkpoint

    capsys.readouterr()
    assert main(["inspect", f"{v2}/manifests/0"]) == 0
    assert "base: the savepoint the job started from (restore_from), " in capsys.readouterr().out
    assert main(["list", str(tmp_path / "ours")]) == 0
    assert "v1 (restore_from)" in capsys.readouterr().out
    # A job's directory, or the query's checkpointLocation, given for a checkpoint.
    assert main(["inspect", str(v2)]) == 1
    assert f"it is a job's directory: give {v2}/latest" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "ckpt-v2")]) == 1
    error = capsys.readouterr().err
    assert "it is the Spark checkpointLocation of state job 'v2': give " in error, error
    assert f"{v2.as_uri()}/latest" in error

    shutil.rmtree(savepoint)
    lose_local_state(tmp_path / "local")
    write_batch_files(tmp_path / "in-v2", batches[7:], first=7)
    _run(spark, *new_query, 2, str(savepoint))
    written = read_output(spark, tmp_path / "out-v2")
    assert written == _shifted(expected_output(batches), 4)
    assert max(written.values()) == 1
    assert state_totals(spark, v2) == expected_totals(batches)


class ListTotals(StatefulProcessor):
    """Declares ``totals`` as list state, which UserTotals stores as value state."""

    def init(self, handle: Any) -> None:
        handle.getListState("totals", "count long, total long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        return iter(())

    def close(self) -> None:
        pass


def test_each_bad_restore_from_is_one_error_before_any_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A manifest, a job's ``latest``, its directory or its checkpointLocation instead of
    a savepoint, another storage, a savepoint keyed by other columns, a state of another
    kind, another max parallelism, one without a transform_with_state operator, and a
    restore_from given to a job that has committed batches from elsewhere: each raises
    from ``transform_with_state``, naming it; and the old job's sink path, from ``start``.
    Nothing is written to the new job's directory."""
    savepoint = _old_job(spark, tmp_path, make_batches(2, seed=72))
    source = _source(spark, tmp_path / "in-v1")

    def start(restore_from: str, job_id: str = "v2", **options: Any) -> None:
        arguments: dict[str, Any] = {
            "key_by": "user",
            "processor": example.UserTotals(),
            "output_schema": example.OUTPUT_SCHEMA,
            "job_id": job_id,
            "parallelism": 2,
            **options,
        }
        transform_with_state(source, restore_from=restore_from, **arguments)

    manifest = f"{tmp_path / 'ours' / 'v1'}/manifests/1"
    with pytest.raises(ConfigurationError, match="is not a completed checkpoint or savepoint"):
        start(manifest)
    with pytest.raises(ConfigurationError, match="names a job's newest state on the command"):
        start(f"{tmp_path / 'ours' / 'v1'}/latest")
    with pytest.raises(ConfigurationError, match="is a job's directory, not a checkpoint"):
        start(str(tmp_path / "ours" / "v1"))
    with pytest.raises(ConfigurationError, match="is the Spark checkpointLocation of state job"):
        start(str(tmp_path / "ckpt-v1"))
    with pytest.raises(ConfigurationError, match="is not on the file system of the job's storage"):
        start("s3://bucket/savepoints/v1")
    with pytest.raises(ConfigurationError, match="is keyed by .*, this query by"):
        start(str(savepoint), key_by=["user", "amount"])
    with pytest.raises(IncompatibleStateError, match="'totals' was stored as value state"):
        start(str(savepoint), processor=ListTotals())
    initial = spark.createDataFrame([("u1", 5)], "user string, amount long")
    with pytest.raises(ConfigurationError, match="initial_state seeds only a job that starts"):
        start(str(savepoint), initial_state=initial)
    spark.conf.set(MAX_PARALLELISM, "64")
    try:
        with pytest.raises(ConfigurationError, match=f"{MAX_PARALLELISM}=64 differs"):
            start(str(savepoint))
    finally:
        spark.conf.unset(MAX_PARALLELISM)
    dropped = tmp_path / "savepoints" / "empty"
    status = main(
        ["savepoint", "transform", "--from", str(savepoint), "--to", str(dropped),
         "--drop-operator", "transform-with-state"]
    )  # fmt: skip
    assert status == 0
    with pytest.raises(ConfigurationError, match="holds no transform_with_state state"):
        start(str(dropped))
    # v1 has committed batches and did not start from the savepoint.
    with pytest.raises(ConfigurationError, match="applies to a job's first start only"):
        start(str(savepoint), job_id="v1")
    # v1's sink path: v2 numbers its batches from 0 and would replace v1's part-0-* files.
    with pytest.raises(ConfigurationError, match="holds files another query published"):
        _run(
            spark,
            tmp_path / "in-v1",
            tmp_path / "out-v1",
            tmp_path / "ckpt-v2",
            "v2",
            2,
            str(savepoint),
        )
    assert not (tmp_path / "ours" / "v2").exists()
    assert not (tmp_path / "ckpt-v2").exists()


def test_savepoint_trigger_of_a_running_query(spark: SparkSession, tmp_path: Path) -> None:
    """``savepoint trigger`` of a running transform_with_state job: the request is taken
    at the next batch, whose end the savepoint holds (plain Python over the batches up to
    it), and a new job restored from it continues exactly."""
    batches = make_batches(5, seed=73)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches[:2])
    stateful = transform_with_state(
        _source(spark, input_dir),
        key_by="user",
        processor=example.UserTotals(),
        output_schema=example.OUTPUT_SCHEMA,
        job_id="v1",
        parallelism=2,
    )
    query = (
        stateful.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="50 milliseconds")
        .start()
    )
    try:
        query.processAllAvailable()
        job_dir = f"{(tmp_path / 'ours').as_uri()}/v1"
        fs = open_filesystem(job_dir)
        request = request_savepoint(fs, job_dir)
        write_batch_files(input_dir, batches[2:3], first=2)  # batch 2 takes the request
        savepoint = wait_for_savepoint(fs, job_dir, request, 60)
        query.processAllAvailable()
    finally:
        query.stop()
    assert read_output(spark, out) == expected_output(batches[:3])
    assert totals_at(spark, savepoint) == expected_totals(batches[:3])

    write_batch_files(tmp_path / "in-v2", batches[3:], first=3)
    _run(spark, tmp_path / "in-v2", tmp_path / "out-v2", tmp_path / "ckpt-v2", "v2", 3, savepoint)
    assert read_output(spark, tmp_path / "out-v2") == _shifted(expected_output(batches), 3)


def test_a_query_whose_job_id_differs_only_in_case_from_an_existing_job_is_refused(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A query with ``job_id="V1"`` beside job ``v1`` started a second job where names
    are case-sensitive; on macOS or a Windows share it shares ``v1``'s directory (fences
    its driver, discards its checkpoints). ``transform_with_state`` now refuses it,
    naming ``v1``, before anything is written."""
    write_batch_files(tmp_path / "in-v1", make_batches(1, seed=73))
    _run(spark, tmp_path / "in-v1", tmp_path / "out-v1", tmp_path / "ckpt-v1", "v1", 2)
    ours = tmp_path / "ours"
    before = {path: path.read_bytes() for path in ours.rglob("*") if path.is_file()}
    with pytest.raises(ConfigurationError, match="'V1' differs only in case from the job 'v1'"):
        _run(spark, tmp_path / "in-v1", tmp_path / "out-V1", tmp_path / "ckpt-V1", "V1", 2)
    assert sorted(os.listdir(ours)) == ["v1"]
    assert {path: path.read_bytes() for path in ours.rglob("*") if path.is_file()} == before


class FailsWhileFlagged(StatefulProcessor):
    """``UserTotals`` that raises while the file ``flag`` exists (its first batch fails,
    then the same batch runs once the flag is gone)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag
        self.totals = example.UserTotals()

    def init(self, handle: Any) -> None:
        self.totals.init(handle)

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        if os.path.exists(self.flag):
            raise RuntimeError("flagged to fail")
        return self.totals.handleInputRows(key, rows, timerValues)

    def close(self) -> None:
        pass


def test_a_restore_from_survives_a_restart_without_it_before_the_first_commit(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Job v2 starts from v1's savepoint and its first batch fails (nothing committed);
    the query is started again with the same checkpointLocation but without
    ``restore_from``: it goes on from the savepoint it was first started from, as a
    restart after committed batches resumes from the job's own state (plain Python over
    v1's and v2's input). Another ``restore_from`` before the first commit is refused,
    naming both."""
    batches = make_batches(6, seed=74)
    savepoint = _old_job(spark, tmp_path, batches[:3])
    write_batch_files(tmp_path / "in-v2", batches[3:])
    flag = tmp_path / "fail"
    flag.write_text("")

    def start(restore_from: str | None) -> None:
        stateful = transform_with_state(
            _source(spark, tmp_path / "in-v2"),
            key_by="user",
            processor=FailsWhileFlagged(str(flag)),
            output_schema=example.OUTPUT_SCHEMA,
            job_id="v2",
            parallelism=3,
            restore_from=restore_from,
        )
        query = (
            stateful.writeStream.format("parquet")
            .option("path", str(tmp_path / "out-v2"))
            .option("checkpointLocation", str(tmp_path / "ckpt-v2"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    with pytest.raises(StreamingQueryException, match="flagged to fail"):
        start(str(savepoint))
    assert not list((tmp_path / "ours" / "v2").glob("manifests/*"))
    flag.unlink()
    other = tmp_path / "savepoints" / "other"
    shutil.copytree(savepoint, other)
    with pytest.raises(ConfigurationError, match="was first started with restore_from") as raised:
        start(str(other))
    assert str(savepoint) in str(raised.value) and str(other) in str(raised.value)
    start(None)
    assert read_output(spark, tmp_path / "out-v2") == _shifted(expected_output(batches), 3)
    assert state_totals(spark, tmp_path / "ours" / "v2") == expected_totals(batches)


def test_a_todf_job_goes_on_from_the_restore_from_its_first_batch_recorded(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Job v2's first ``toDF()`` starts from v1's savepoint and its batch fails (nothing
    committed). A ``toDF()`` with another ``restore_from`` is refused, naming both; one
    without ``restore_from`` goes on from the savepoint (plain Python over v1's and v2's
    input), as a query's restart does. Job v3 likewise, but its savepoint is deleted
    before the start without ``restore_from``: the error says that the job's first start
    recorded it and that it is gone."""
    ours = tmp_path / "ours"
    batches = make_batches(4, seed=75)
    savepoint = _old_job(spark, tmp_path, batches[:3])
    other = tmp_path / "savepoints" / "other"
    shutil.copytree(savepoint, other)
    flag = tmp_path / "fail"
    frame = spark.createDataFrame(batches[3], "user string, amount long")

    def run(job_id: str, restore_from: Path | None) -> OutputRows:
        stateful = transform_with_state(
            frame,
            key_by="user",
            processor=FailsWhileFlagged(str(flag)),
            output_schema=example.OUTPUT_SCHEMA,
            job_id=job_id,
            parallelism=2,
            restore_from=None if restore_from is None else str(restore_from),
        )
        rows = stateful.toDF().collect()
        return Counter((0, (r.user, r["count"], r.total, r.amounts)) for r in rows)

    for job_id, first in (("v2", savepoint), ("v3", other)):
        flag.write_text("")
        with pytest.raises(Exception, match="flagged to fail"):
            run(job_id, first)
        assert not list((tmp_path / "ours" / job_id).glob("manifests/*"))
    flag.unlink()
    with pytest.raises(ConfigurationError, match="was first started with restore_from") as raised:
        run("v2", other)
    assert str(savepoint) in str(raised.value) and str(other) in str(raised.value)
    assert run("v2", None) == _shifted(expected_output(batches), 3)
    assert state_totals(spark, tmp_path / "ours" / "v2") == expected_totals(batches)
    for command in (["inspect", str(tmp_path / "ours" / "v2" / "latest")], ["gc", str(ours)]):
        assert main(command) == 0, command  # the new file is nothing to them

    shutil.rmtree(other)
    with pytest.raises(ConfigurationError, match="first started with restore_from=") as raised:
        run("v3", None)
    assert f"but {other} is gone" in str(raised.value)
    assert not list((tmp_path / "ours" / "v3").glob("manifests/*"))
