"""``statebackend.spark.state_writer``: bootstrap a savepoint from DataFrames, transform one.

The example job's ``user-totals`` state is bootstrapped from DataFrames computed in plain
Python over half of the input; the job then runs on the other half from that savepoint
at another parallelism and must end with the plain-Python totals over all of it.
Transforms (a state mapped with a serializer change, one renamed, one removed, operator
state added) round trip at P -> P', and bad bootstrap data is a clear error.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    ArrayType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from statebackend.checkpoint.filesystem import open_filesystem
from statebackend.checkpoint.restore import restore_operator_state
from statebackend.checkpoint.storage import load_metadata
from statebackend.errors import ConfigurationError, SerializationError, StateAccessError
from statebackend.redistribution import DistributionMode
from statebackend.serializers import FloatSerializer, StrSerializer
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.example import (
    CATEGORY_COUNTS,
    COUNT,
    OPERATOR_ID,
    RECENT_AMOUNTS,
    TOTAL,
    checkpointed_totals,
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
    user_totals_job,
)
from statebackend.spark.job_groups import job_group_id
from statebackend.spark.state_reader import read_state
from statebackend.spark.state_writer import StateWriter
from statebackend.state.descriptors import ValueStateDescriptor
from tests.conftest import Storage
from tests.scripts import REPO
from tests.unit.test_bulk_restore import checkpoint as incremental_checkpoint

USERS = 40
PARTITIONS = 4


def totals_frames(spark: SparkSession, totals: dict[str, dict[str, Any]]) -> dict[str, DataFrame]:
    """One (key, value) DataFrame per state of the example job, from plain-Python totals."""

    def frame(name: str, value_type: Any) -> DataFrame:
        schema = StructType(
            [StructField("key", StringType(), False), StructField("value", value_type)]
        )
        return spark.createDataFrame([(u, t[name]) for u, t in totals.items()], schema)

    return {
        "count": frame("count", LongType()),
        "total": frame("total", LongType()),
        "categories": frame("categories", MapType(StringType(), LongType())),
        "recent": frame("recent", ArrayType(LongType())),
    }


def bootstrap(
    spark: SparkSession, totals: dict[str, dict[str, Any]], target: str, storage: Storage, p: int
) -> str:
    frames = totals_frames(spark, totals)
    writer = StateWriter.new(spark, max_parallelism=64, storage_options=storage.storage_options)
    for descriptor in (COUNT, TOTAL, CATEGORY_COUNTS, RECENT_AMOUNTS):
        writer.with_keyed_state(OPERATOR_ID, descriptor, frames[descriptor.name])
    return writer.write(target, parallelism=p)


def test_bootstrap_then_run_on_the_rest(
    spark_local: SparkSession, tmp_path: Path, checkpoint_url: Storage
) -> None:
    """Bootstrap from half the input at P=2, run on the other half at P=3: the job ends
    with the totals over all of it."""
    generate_events(tmp_path / "first", 400, USERS, PARTITIONS, seed=1)
    generate_events(tmp_path / "second", 400, USERS, PARTITIONS, seed=2)
    first = list(read_events(tmp_path / "first"))
    savepoint = bootstrap(
        spark_local,
        expected_totals(first),
        f"{checkpoint_url.url}/savepoints/bootstrap",
        checkpoint_url,
        2,
    )
    conf = StateBackendConf(
        checkpoint_dir=checkpoint_url.url,
        storage_options=checkpoint_url.storage_options,
        local_dir=str(tmp_path / "local"),
    )
    summary = user_totals_job(
        spark_local,
        job_id="from-bootstrap",
        input_dir=tmp_path / "second",
        parallelism=3,
        conf=conf,
        batch_size=200,
        checkpoint_every=1,
        restore=savepoint,
        output_dir=str(tmp_path / "output"),
    ).run()
    assert summary.restored_from == savepoint
    assert summary.records == 400
    # The savepoint's Spark job was labelled for the Spark UI.
    group = job_group_id("bootstrap", OPERATOR_ID)
    assert spark_local.sparkContext.statusTracker().getJobIdsForGroup(group)
    expected = expected_totals(first + list(read_events(tmp_path / "second")))
    last = summary.last_checkpoint
    assert last is not None
    actual = checkpointed_totals(spark_local, last, checkpoint_url.storage_options)
    assert compare_totals(expected, actual) == []


def test_a_savepoint_restored_by_a_run_without_input_is_what_the_next_run_resumes(
    spark_local: SparkSession,
    tmp_path: Path,
    checkpoint_url: Storage,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run that restores a savepoint and finds no input takes a checkpoint of it, so
    that ``restore="latest"`` later resumes from the savepoint's state, not from nothing
    (or from the job's older checkpoints). A local savepoint is given as a relative path,
    which the executors, in another working directory, must find too."""
    generate_events(tmp_path / "first", 400, USERS, PARTITIONS, seed=1)
    generate_events(tmp_path / "input", 0, USERS, PARTITIONS, seed=2)
    first = list(read_events(tmp_path / "first"))
    savepoint = bootstrap(
        spark_local, expected_totals(first), f"{checkpoint_url.url}/savepoints/b", checkpoint_url, 2
    )
    conf = StateBackendConf(
        checkpoint_dir=checkpoint_url.url,
        storage_options=checkpoint_url.storage_options,
        local_dir=str(tmp_path / "local"),
    )

    def run(restore: str) -> Any:
        return user_totals_job(
            spark_local,
            job_id="restored-idle",
            input_dir=tmp_path / "input",
            parallelism=2,
            conf=conf,
            batch_size=200,
            restore=restore,
        ).run()

    restore = savepoint
    if savepoint.startswith("file://"):
        monkeypatch.chdir(tmp_path)
        restore = os.path.relpath(savepoint.removeprefix("file://"))
    idle = run(restore)
    assert idle.records == 0 and str(idle.restored_from).endswith("/savepoints/b")
    assert idle.last_checkpoint is not None
    generate_events(tmp_path / "input", 300, USERS, PARTITIONS, seed=3)
    resumed = run("latest")
    assert resumed.restored_from == idle.last_checkpoint
    expected = expected_totals(first + list(read_events(tmp_path / "input")))
    last = resumed.last_checkpoint
    assert last is not None
    actual = checkpointed_totals(spark_local, last, checkpoint_url.storage_options)
    assert compare_totals(expected, actual) == []


@pytest.mark.s3
def test_writer_and_reader_take_the_storage_options_of_the_session(
    spark_local: SparkSession, s3_storage: Storage
) -> None:
    """Without ``storage_options``, ``StateWriter`` and ``read_state`` reach the storage
    through the session's ``spark.statebackend.storage.*``, as the jobs do."""
    keys = [f"spark.statebackend.storage.{k}" for k in s3_storage.storage_options]
    for key, value in zip(keys, s3_storage.storage_options.values(), strict=True):
        spark_local.conf.set(key, str(value))
    try:
        totals = {"u1": {"count": 2, "total": 5, "categories": {"a": 2}, "recent": [2, 3]}}
        frame = totals_frames(spark_local, totals)["count"]
        savepoint = (
            StateWriter.new(spark_local, max_parallelism=64)
            .with_keyed_state(OPERATOR_ID, COUNT, frame)
            .write(f"{s3_storage.url}/savepoints/session", parallelism=2)
        )
        transformed = (
            StateWriter.from_savepoint(spark_local, savepoint)
            .with_keyed_state(OPERATOR_ID, TOTAL, totals_frames(spark_local, totals)["total"])
            .write(f"{s3_storage.url}/savepoints/session-2")
        )
        assert state_rows(spark_local, transformed, "count") == {"u1": 2}
        assert state_rows(spark_local, transformed, "total") == {"u1": 5}
    finally:
        for key in keys:
            spark_local.conf.unset(key)


def state_rows(spark: SparkSession, savepoint: str, name: str) -> dict[str, Any]:
    rows = read_state(spark, savepoint, OPERATOR_ID, name).collect()
    return {
        row["key"]: json.loads(row["value"]) if isinstance(row["value"], str) else row["value"]
        for row in rows
    }


@pytest.mark.parametrize(("parallelism", "new_parallelism"), [(2, 3), (3, 1)])
def test_transform_round_trip(
    spark_local: SparkSession, tmp_path: Path, parallelism: int, new_parallelism: int
) -> None:
    """count mapped to count / 2 as floats (a serializer change), total renamed, recent
    removed, categories rewritten from ``read_state`` unchanged, operator state added."""
    generate_events(tmp_path / "input", 300, USERS, PARTITIONS, seed=3)
    totals = expected_totals(read_events(tmp_path / "input"))
    storage = Storage(tmp_path.as_uri())
    source = bootstrap(spark_local, totals, f"{storage.url}/v1", storage, parallelism)
    source_metadata = (tmp_path / "v1" / "_metadata").read_bytes()

    counts = read_state(spark_local, source, OPERATOR_ID, "count")
    halves = counts.selectExpr("key", "CAST(value AS DOUBLE) / 2 AS value")
    categories = read_state(spark_local, source, OPERATOR_ID, "categories")
    notes = [f"note-{n}" for n in range(7)]
    target = (
        StateWriter.from_savepoint(spark_local, source)
        .with_keyed_state(OPERATOR_ID, ValueStateDescriptor("count", FloatSerializer()), halves)
        .with_keyed_state(OPERATOR_ID, CATEGORY_COUNTS, categories)
        .rename_state(OPERATOR_ID, "total", "sum")
        .remove_state(OPERATOR_ID, "recent")
        .with_operator_state(
            OPERATOR_ID, "notes", notes, mode=DistributionMode.UNION, serializer=StrSerializer()
        )
        .write(f"{storage.url}/v2", parallelism=new_parallelism)
    )
    assert (tmp_path / "v1" / "_metadata").read_bytes() == source_metadata

    metadata = load_metadata(open_filesystem(target), target)
    assert metadata.is_savepoint
    assert metadata.operators[OPERATOR_ID].parallelism == new_parallelism
    assert state_rows(spark_local, target, "count") == {
        user: t["count"] / 2 for user, t in totals.items()
    }
    assert state_rows(spark_local, target, "sum") == {u: t["total"] for u, t in totals.items()}
    assert state_rows(spark_local, target, "categories") == {
        u: t["categories"] for u, t in totals.items()
    }
    with pytest.raises(StateAccessError, match="no keyed state 'recent'"):
        read_state(spark_local, target, OPERATOR_ID, "recent")
    fs = open_filesystem(target)
    for subtask in range(2):
        restored = restore_operator_state(fs, target, metadata, OPERATOR_ID, subtask, 2)
        assert sorted(restored.get_union_list_state("notes", StrSerializer()).get()) == notes


def test_the_readme_example_runs_as_printed(spark_local: SparkSession, tmp_path: Path) -> None:
    """The README's StateWriter example, on a local directory instead of S3: bootstrap
    count and recent, then double count and remove recent."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    (example,) = (b for b in blocks if "StateWriter.new(" in b)
    exec(example.replace("s3://bucket", tmp_path.as_uri()), {"spark": spark_local})  # noqa: S102
    doubled = (tmp_path / "savepoints" / "doubled").as_uri()
    assert state_rows(spark_local, doubled, "count") == {"alice": 6, "bob": 10}
    with pytest.raises(StateAccessError, match="no keyed state 'recent'"):
        read_state(spark_local, doubled, OPERATOR_ID, "recent")


@pytest.mark.parametrize(
    ("rows", "key_type", "error", "message"),
    [
        (
            [("a", 1), ("b", 2), ("a", 3)],
            StringType(),
            ConfigurationError,
            "key 'a' is given twice",
        ),
        ([(1, 1)], LongType(), SerializationError, "key 1 does not fit the key serializer str"),
    ],
)
def test_bad_bootstrap_data_is_a_clear_error(
    spark_local: SparkSession,
    tmp_path: Path,
    rows: list[tuple[Any, Any]],
    key_type: Any,
    error: type[Exception],
    message: str,
) -> None:
    schema = StructType([StructField("key", key_type), StructField("value", LongType())])
    frame = spark_local.createDataFrame(rows, schema)
    writer = StateWriter.new(spark_local).with_keyed_state(OPERATOR_ID, COUNT, frame)
    with pytest.raises(error, match=message):
        writer.write(str(tmp_path / "sp"), parallelism=2)
    assert not (tmp_path / "sp" / "_metadata").exists()


@pytest.mark.parametrize(
    ("max_parallelism", "operator", "message"),
    [
        (0, OPERATOR_ID, "max parallelism 0 is out of range"),
        (None, "../escaped", "operator id '../escaped' is invalid"),
    ],
)
def test_bad_writer_arguments_are_refused_before_writing(
    spark_local: SparkSession,
    tmp_path: Path,
    max_parallelism: int | None,
    operator: str,
    message: str,
) -> None:
    schema = StructType([StructField("key", StringType()), StructField("value", LongType())])
    frame = spark_local.createDataFrame([("a", 1)], schema)
    writer = StateWriter.new(spark_local, max_parallelism=max_parallelism)
    writer.with_keyed_state(operator, COUNT, frame)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        writer.write(str(work / "sp"), parallelism=2)
    assert list(tmp_path.rglob("*")) == [work]


def test_a_transform_downloads_into_the_sessions_local_dir(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """The tasks of ``write`` restore an incremental source into
    spark.statebackend.local.dir, not the system's temp directory: where it is a file,
    writing fails naming it (and leaves no target); as a directory, the savepoint reads
    back as the model and nothing stays in it."""
    storage, source, model = incremental_checkpoint(tmp_path / "incremental", True)
    storage.close()
    local = tmp_path / "local"
    target = f"{tmp_path.as_uri()}/transformed"
    try:
        local.write_text("not a directory")
        spark_local.conf.set("spark.statebackend.local.dir", str(local))
        with pytest.raises(Exception, match=f"the local directory {local} is unusable"):
            # One task: with more, one still running when another fails the job can write
            # its file after the failed write cleaned the target up.
            StateWriter.from_savepoint(spark_local, source).write(target, parallelism=1)
        assert not (tmp_path / "transformed").exists()
        local.unlink()
        StateWriter.from_savepoint(spark_local, source).write(target, parallelism=3)
        rows = read_state(spark_local, target, "op", "count").collect()
    finally:
        spark_local.conf.unset("spark.statebackend.local.dir")
    assert dict(rows) == {key: count for key, (count, _) in model.items()}
    assert [path for path in local.rglob("*") if path.is_file()] == []
