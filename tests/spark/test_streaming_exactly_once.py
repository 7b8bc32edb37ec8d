"""Exactly-once of transform_with_state queries with Spark's own checkpoint: restart at
another parallelism, SIGKILLed drivers, a lost executor-local copy, and the binding of a
Spark checkpointLocation to one state job. Every check compares the parquet output rows
per batch with a plain-Python computation of the same input."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from statebackend.checkpoint.metrics import BatchMetrics, read_history, records_of
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from statebackend.errors import ConfigurationError
from statebackend.spark.arrow_path import OPERATOR_ID
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.example import generate_events, user_totals_job
from statebackend.spark.state_reader import read_state
from statebackend.spark.streaming import transform_with_state
from tests.conftest import Storage
from tests.scripts import REPO, load_script
from tests.spark.jobs import lose_local_state, streaming_session

SCRIPT = REPO / "scripts" / "streaming_user_totals.py"
example = load_script("scripts/streaming_user_totals.py", "streaming_user_totals")
cloudpickle.register_pickle_by_value(example)

Batches = list[list[tuple[str, int]]]
OutputRows = Counter[tuple[int, tuple[Any, ...]]]
KILLS = 5
"""SIGKILLed drivers per run of the kill test; each restart changes the parallelism."""
FILES_PER_RUN = 2
MAX_KILLED_RUNS = 8
PART_NAME = re.compile(r"part-(\d+)-(\d+)\.parquet$")
MATERIALIZE_EVERY = "spark.statebackend.changelog.materialize-every"


def make_batches(count: int, seed: int) -> Batches:
    """``count`` batches of 1-6 (user, amount) rows over 7 users."""
    rng = random.Random(seed)
    users = [f"u{i}" for i in range(7)]
    return [
        [(rng.choice(users), rng.randint(1, 50)) for _ in range(rng.randint(1, 6))]
        for _ in range(count)
    ]


def write_batch_files(directory: Path, batches: Batches, first: int = 0) -> None:
    """One JSON-lines file per batch, numbered from ``first``, with increasing
    modification times (the file source takes them in that order)."""
    directory.mkdir(parents=True, exist_ok=True)
    for number, rows in enumerate(batches, start=first):
        path = directory / f"batch-{number:04d}.json"
        path.write_text("".join(f'{{"user": "{u}", "amount": {a}}}\n' for u, a in rows))
        stamp = 1_700_000_000 + number
        os.utime(path, (stamp, stamp))


def expected_output(batches: Batches) -> OutputRows:
    """What ``UserTotals`` outputs per batch, computed in plain Python."""
    amounts: dict[str, list[int]] = {}
    out: OutputRows = Counter()
    for batch_id, rows in enumerate(batches):
        seen: list[str] = []
        for user, amount in rows:
            amounts.setdefault(user, []).append(amount)
            if user not in seen:
                seen.append(user)
        for user in seen:
            history = amounts[user]
            row = (user, len(history), sum(history), ",".join(map(str, history)))
            out[(batch_id, row)] += 1
    return out


def read_output(spark: SparkSession, directory: Path) -> OutputRows:
    """The parquet sink's rows, by the batch named in their file's name."""
    frame = spark.read.parquet(str(directory)).withColumn("file", F.input_file_name())
    out: OutputRows = Counter()
    for row in frame.collect():
        match = PART_NAME.search(row.file)
        assert match is not None, row.file
        out[(int(match.group(1)), (row.user, row["count"], row.total, row.amounts))] += 1
    return out


@pytest.fixture
def spark(spark_local: SparkSession, tmp_path: Path) -> Iterator[SparkSession]:
    with streaming_session(spark_local, tmp_path) as session:
        yield session


def stateful_query(spark: SparkSession, input_dir: Path, job_id: str, parallelism: int) -> Any:
    source = (
        spark.readStream.schema(example.INPUT_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(input_dir))
    )
    return transform_with_state(
        source,
        key_by="user",
        processor=example.UserTotals(),
        output_schema=example.OUTPUT_SCHEMA,
        job_id=job_id,
        parallelism=parallelism,
    )


def run_to_parquet(
    spark: SparkSession, input_dir: Path, out: Path, checkpoint: Path, parallelism: int
) -> None:
    query = (
        stateful_query(spark, input_dir, "totals", parallelism)
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def test_restart_at_another_parallelism_is_exact(spark: SparkSession, tmp_path: Path) -> None:
    restart_at_another_parallelism(spark, tmp_path)


def restart_at_another_parallelism(spark: SparkSession, tmp_path: Path) -> None:
    """Four batches at parallelism 2, then three more at 3: the parquet output equals
    plain Python, no row twice."""
    batches = make_batches(7, seed=11)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches[:4])
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    assert read_output(spark, out) == expected_output(batches[:4])

    write_batch_files(input_dir, batches[4:], first=4)
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=3)
    written = read_output(spark, out)
    assert written == expected_output(batches)
    assert max(written.values()) == 1  # no row twice


@pytest.mark.s3
def test_state_on_s3_restarts_at_another_parallelism_exactly(
    spark_local: SparkSession, tmp_path: Path, s3_storage: Storage
) -> None:
    """Our state on S3 (the local endpoint), materialized every 2 batches: four batches
    at parallelism 2, the executor-local copies lost (as on other hosts), then three at
    3 rebuilt from S3 alone: the output equals plain Python, no row twice, and so does
    the state read back from S3."""
    options = s3_storage.storage_options.items()
    pairs = [
        ("spark.statebackend.checkpoint.dir", s3_storage.url),
        (MATERIALIZE_EVERY, "2"),
        *((f"spark.statebackend.storage.{key}", str(value)) for key, value in options),
    ]
    batches = make_batches(7, seed=13)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    with streaming_session(spark_local, tmp_path, *pairs) as spark:
        write_batch_files(input_dir, batches[:4])
        run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
        lose_local_state(tmp_path / "local")
        write_batch_files(input_dir, batches[4:], first=4)
        run_to_parquet(spark, input_dir, out, checkpoint, parallelism=3)
        written = read_output(spark, out)
        totals = state_totals(spark, f"{s3_storage.url}/totals", s3_storage.storage_options)
    assert written == expected_output(batches)
    assert max(written.values()) == 1
    assert totals == expected_totals(batches)


def test_signed_job_refuses_a_forged_changelog_record_on_rebuild(
    spark: SparkSession, tmp_path: Path
) -> None:
    """With ``checkpoint.signing-key`` the driver signs the manifests and the keyed
    subtasks checksum their records with SHA-256: a record replaced by another
    well-formed one is refused when a subtask rebuilds from storage."""
    spark.conf.set("spark.statebackend.checkpoint.signing-key", "0123456789abcdef-streaming")
    try:
        batches = make_batches(3, seed=3)
        input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
        write_batch_files(input_dir, batches[:2])
        run_to_parquet(spark, input_dir, out, checkpoint, parallelism=1)
        job = tmp_path / "ours" / "totals"
        assert "signature" in json.loads((job / "manifests" / "1").read_text())
        (older,) = (job / "changelog" / "0").iterdir()
        (newest,) = (job / "changelog" / "1").iterdir()
        newest.write_bytes(older.read_bytes())
        lose_local_state(tmp_path / "local")  # batch 2 rebuilds from storage
        write_batch_files(input_dir, batches[2:], first=2)
        with pytest.raises(Exception, match=f"{newest.name} does not match the signed"):
            run_to_parquet(spark, input_dir, out, checkpoint, parallelism=1)
    finally:
        spark.conf.unset("spark.statebackend.checkpoint.signing-key")


def test_lost_local_copy_is_rebuilt_from_storage(spark: SparkSession, tmp_path: Path) -> None:
    batches = make_batches(4, seed=5)
    input_dir, local = tmp_path / "in", tmp_path / "local"
    write_batch_files(input_dir, batches)
    rows: OutputRows = Counter()

    def collect_then_lose_local_state(df: DataFrame, batch_id: int) -> None:
        for row in df.collect():
            rows[(batch_id, tuple(row))] += 1
        lose_local_state(local)  # the next batch runs as if on another host

    query = (
        stateful_query(spark, input_dir, "wiped", parallelism=2)
        .writeStream.foreachBatch(collect_then_lose_local_state)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert rows == expected_output(batches)


def test_checkpoint_location_is_bound_to_one_job(spark: SparkSession, tmp_path: Path) -> None:
    input_dir = tmp_path / "in"
    write_batch_files(input_dir, make_batches(1, seed=1))
    first, other = tmp_path / "ckpt", tmp_path / "other-ckpt"

    def start(job_id: str, checkpoint: Path) -> None:
        query = (
            stateful_query(spark, input_dir, job_id, parallelism=2)
            .writeStream.foreachBatch(lambda df, batch_id: None)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    start("bound", first)
    with pytest.raises(ConfigurationError, match=r"belongs to state job 'bound'.*'intruder'"):
        start("intruder", first)
    with pytest.raises(ConfigurationError, match=r"job 'bound'.*belongs to checkpointLocation"):
        start("bound", other)
    start("bound", first)  # its own location still works


@pytest.mark.parametrize("restore", ["none", "savepoint"])
def test_a_stateful_job_refuses_the_state_of_a_streaming_query(
    spark: SparkSession, tmp_path: Path, restore: str
) -> None:
    """A ``StatefulJob`` given the job_id of a streaming query, restoring nothing or a
    savepoint (which deletes the manifests after its restore point), is one
    ConfigurationError before it touches the job directory, as ``toDF()`` on it is: the
    query's manifests stay, and the query goes on exactly (plain Python) instead of taking
    the other job's batches for its own (rows missing, state reset)."""
    batches = make_batches(4, seed=17)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches[:2])
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    job_dir = tmp_path / "ours" / "totals"
    before = sorted(path.name for path in (job_dir / "manifests").iterdir())
    generate_events(tmp_path / "events", 20, 5, 2, seed=1)
    if restore == "savepoint":  # a savepoint of another StatefulJob
        other = StateBackendConf(checkpoint_dir=(tmp_path / "other").as_uri())
        summary = user_totals_job(
            spark, job_id="other", input_dir=tmp_path / "events", parallelism=2, conf=other
        ).run()
        checkpoint_of_other = summary.last_checkpoint
        assert checkpoint_of_other is not None
        savepoint = tmp_path / "savepoint"
        assert (
            main(["savepoint", "create", "--from", checkpoint_of_other, "--to", str(savepoint)])
            == 0
        )
        restore = str(savepoint)
    conf = StateBackendConf(checkpoint_dir=(tmp_path / "ours").as_uri())
    with pytest.raises(ConfigurationError, match=r"job 'totals' .* a streaming query"):
        user_totals_job(
            spark,
            job_id="totals",
            input_dir=tmp_path / "events",
            parallelism=2,
            conf=conf,
            restore=restore,
        ).run()
    assert sorted(path.name for path in (job_dir / "manifests").iterdir()) == before

    write_batch_files(input_dir, batches[2:], first=2)
    run_to_parquet(spark, input_dir, out, checkpoint, parallelism=2)
    written = read_output(spark, out)
    assert written == expected_output(batches)
    assert state_totals(spark, job_dir) == expected_totals(batches)


def test_a_query_refuses_the_state_of_a_stateful_job(spark: SparkSession, tmp_path: Path) -> None:
    """A query given the job_id of a ``StatefulJob`` is one ConfigurationError from
    ``transform_with_state`` saying that a query cannot take that job's state (a savepoint
    of it holds no transform_with_state operator either), not advice to restore_from a
    savepoint of it; the job's manifests stay."""
    generate_events(tmp_path / "events", 20, 5, 2, seed=1)
    conf = StateBackendConf(checkpoint_dir=(tmp_path / "ours").as_uri())
    user_totals_job(
        spark, job_id="totals", input_dir=tmp_path / "events", parallelism=2, conf=conf
    ).run()
    manifests = tmp_path / "ours" / "totals" / "manifests"
    before = sorted(path.name for path in manifests.iterdir())
    write_batch_files(tmp_path / "in", make_batches(1, seed=3))
    with pytest.raises(ConfigurationError) as raised:
        stateful_query(spark, tmp_path / "in", "totals", 2)
    message = str(raised.value)
    assert "state job 'totals' holds batches of a StatefulJob" in message, message
    assert "give the query another job_id" in message and "restore_from a" not in message
    assert sorted(path.name for path in manifests.iterdir()) == before


def test_a_restart_keeps_time_mode_output_mode_and_key(spark: SparkSession, tmp_path: Path) -> None:
    """Another time mode or output mode (Spark refuses both), other key columns or another
    max parallelism on restart: one clear error naming the setting, before any batch. The same
    checkpointLocation spelled as a relative path or a file:// URL is the same."""
    input_dir, checkpoint = tmp_path / "in", tmp_path / "ckpt"
    write_batch_files(input_dir, make_batches(2, seed=3))
    source = spark.readStream.schema(example.INPUT_SCHEMA).json(str(input_dir))

    def stateful(**changes: Any) -> Any:
        arguments: dict[str, Any] = {
            "key_by": "user",
            "processor": example.UserTotals(),
            "output_schema": example.OUTPUT_SCHEMA,
            "job_id": "kept",
            **changes,
        }
        return transform_with_state(source, **arguments)

    def run(location: str) -> None:
        query = (
            stateful()
            .writeStream.foreachBatch(lambda df, batch_id: None)
            .option("checkpointLocation", location)
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    run(str(checkpoint))
    run(os.path.relpath(checkpoint))
    run(checkpoint.as_uri())
    with pytest.raises(
        ConfigurationError, match="cannot change time_mode from 'None' to 'ProcessingTime'"
    ):
        stateful(time_mode="ProcessingTime")
    with pytest.raises(ConfigurationError, match="cannot change output_mode from 'Update'"):
        stateful(output_mode="Append")
    with pytest.raises(
        ConfigurationError, match=r"keyed by \(user string\), this query by \(amount bigint\)"
    ):
        stateful(key_by="amount")
    spark.conf.set("spark.statebackend.max-parallelism", "64")
    try:
        with pytest.raises(
            ConfigurationError, match=r"max-parallelism=64 differs from the max parallelism 128"
        ):
            stateful()
    finally:
        spark.conf.unset("spark.statebackend.max-parallelism")


def test_rerun_of_a_committed_batch_appends_nothing(spark: SparkSession, tmp_path: Path) -> None:
    batches = make_batches(3, seed=7)
    input_dir, out, checkpoint = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    write_batch_files(input_dir, batches)

    def run() -> None:
        query = (
            stateful_query(spark, input_dir, "json-sink", parallelism=2)
            .writeStream.format("json")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    run()
    # A driver dying after our commit and publish but before Spark's commits/2, and
    # before it recorded batch 2's metrics:
    (checkpoint / "commits" / "2").unlink()
    (checkpoint / "commits" / ".2.crc").unlink(missing_ok=True)
    job_dir = tmp_path / "ours" / "json-sink"
    for segment in (job_dir / "metrics").rglob("*"):
        if segment.is_file():
            lines = segment.read_text().splitlines(keepends=True)
            kept = [
                line for line in lines if not ('"kind":"batch"' in line and '"batch_id":2,' in line)
            ]
            segment.write_text("".join(kept))
    run()  # Spark runs batch 2 again
    assert (checkpoint / "commits" / "2").exists()
    written = Counter(
        (row.user, row["count"], row.total, row.amounts)
        for row in spark.read.schema(example.OUTPUT_SCHEMA).json(str(out)).collect()
    )
    assert written == Counter(row for (_, row) in expected_output(batches).elements())
    # The batch's metrics come from its manifest, once.
    fs = CheckpointStorage((tmp_path / "ours").as_uri(), "json-sink").fs
    recorded = records_of(read_history(fs, job_dir.as_uri()), BatchMetrics)
    assert sorted((b.batch_id, b.records_in) for b in recorded) == [
        (n, len(rows)) for n, rows in enumerate(batches)
    ]


def expected_totals(batches: Batches) -> dict[str, tuple[int, int]]:
    """``UserTotals``' ``totals`` value state (count, total) per user after ``batches``."""
    totals: dict[str, tuple[int, int]] = {}
    for rows in batches:
        for user, amount in rows:
            count, total = totals.get(user, (0, 0))
            totals[user] = (count + 1, total + amount)
    return totals


def state_totals(
    spark: SparkSession, job_dir: Path | str, storage_options: dict[str, Any] | None = None
) -> dict[str, tuple[int, int]]:
    """The ``totals`` state at the job's newest manifest, read with ``read_state``."""
    return totals_at(spark, f"{job_dir}/latest", storage_options)


def totals_at(
    spark: SparkSession, location: str, storage_options: dict[str, Any] | None = None
) -> dict[str, tuple[int, int]]:
    """The ``totals`` state in a checkpoint, savepoint or manifest, read with
    ``read_state``."""
    frame = read_state(spark, location, OPERATOR_ID, "totals", storage_options)
    totals = {}
    for key, value in frame.collect():  # row tuples come as JSON arrays
        (user,), (count, total) = json.loads(key), json.loads(value)
        totals[user] = (count, total)
    return totals


SLOW_UPLOADS = '''"""Imported by every Python process of a test driver with this directory on
its PYTHONPATH: snapshot uploads sleep before each file, so that the driver can be
killed while a materialization uploads."""
import time

from statebackend.snapshot import target

_write_file = target.SnapshotDirectory._write_file


def _slow_write_file(self, *args, **kwargs):
    time.sleep(60)
    return _write_file(self, *args, **kwargs)


target.SnapshotDirectory._write_file = _slow_write_file
'''


def _run_script(
    args: list[str], log: Path, slow_uploads: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start the example driver, materializing every 2 batches; with ``slow_uploads`` (a
    directory) its snapshot uploads sleep (``SLOW_UPLOADS``, as its ``sitecustomize``)."""
    env = dict(os.environ)
    env["PYSPARK_SUBMIT_ARGS"] = f"--conf {MATERIALIZE_EVERY}=2 pyspark-shell"
    if slow_uploads is not None:
        slow_uploads.mkdir(exist_ok=True)
        (slow_uploads / "sitecustomize.py").write_text(SLOW_UPLOADS)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(slow_uploads), env.get("PYTHONPATH")])
        )
    with log.open("ab") as sink:
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def _materialization_uploads(job_dir: Path) -> bool:
    """Whether a materialization is uploading after batch 1 was committed: a checkpoint
    is pending (``_pending``, no ``_metadata``) and manifest 1 exists."""
    if not (job_dir / "manifests" / "1").exists():
        return False
    return any(
        (chk / "_pending").exists() and not (chk / "_metadata").exists()
        for chk in job_dir.glob("chk-*")
    )


def spark_batches(checkpoint: Path, batches: Batches) -> Batches:
    """The batches Spark actually ran, from its own logs: after a restart the file source
    may put several files into one batch (it re-plans a batch whose offsets it had not
    logged). ``offsets/N`` ends with the source's log offset; the source log
    ``sources/0/<k>`` (every 10th one compacted: ``<k>.compact``, holding all entries so
    far) names each file with its source batch k."""
    files: dict[int, set[str]] = defaultdict(set)
    for log in (checkpoint / "sources" / "0").iterdir():
        if not log.name.startswith("."):
            for entry in map(json.loads, log.read_text().splitlines()[1:]):
                files[int(entry["batchId"])].add(Path(entry["path"]).name)
    ran: Batches = []
    previous = -1
    for batch_id in range(_committed_batches(checkpoint / "commits")):
        offsets = checkpoint / "offsets" / str(batch_id)
        assert offsets.exists(), (
            f"{checkpoint} has no offsets/{batch_id}: Spark deleted the logs of its older "
            f"batches (spark.sql.streaming.minBatchesToRetain): raise it for this test"
        )
        last = json.loads(offsets.read_text().splitlines()[-1])
        rows: list[tuple[str, int]] = []
        for source_batch in range(previous + 1, int(last["logOffset"]) + 1):
            for name in sorted(files[source_batch]):
                rows.extend(batches[int(name.removeprefix("batch-").removesuffix(".json"))])
        ran.append(rows)
        previous = int(last["logOffset"])
    return ran


def _amounts_as_sets(rows: OutputRows) -> OutputRows:
    """Rows with the amounts history sorted: Spark orders the rows of a batch of several
    files by its own file packing, not by file name."""
    out: OutputRows = Counter()
    for (batch_id, (user, count, total, amounts)), n in rows.items():
        history = ",".join(sorted(amounts.split(","), key=int))
        out[(batch_id, (user, count, total, history))] += n
    return out


def _committed_batches(commits: Path) -> int:
    """How many batches Spark committed: its newest ``commits/N``'s N + 1 (not how many
    files there are: Spark keeps only the newest ``minBatchesToRetain``, 100)."""
    names = os.listdir(commits) if commits.exists() else []
    return max((int(name) for name in names if name.isdigit()), default=-1) + 1


def test_committed_batches_past_the_commits_spark_retains(tmp_path: Path) -> None:
    """With commits 150..249 (Spark deleted the older ones), 250 batches were committed,
    and one more commit makes 251 (the number of files stays 100). ``spark_batches``
    says it cannot tell the batches apart whose offsets Spark deleted."""
    commits = tmp_path / "commits"
    commits.mkdir()
    for batch_id in range(150, 250):
        (commits / str(batch_id)).write_text("v1\n{}\n")
        (commits / f".{batch_id}.crc").write_bytes(b"")
        (tmp_path / "offsets").mkdir(exist_ok=True)
        (tmp_path / "offsets" / str(batch_id)).write_text('v1\n{}\n{"logOffset": 0}\n')
    (tmp_path / "sources" / "0").mkdir(parents=True)
    assert _committed_batches(commits) == 249 + 1
    (commits / "250").write_text("v1\n{}\n")
    (commits / "150").unlink()
    assert _committed_batches(commits) == 250 + 1
    assert _committed_batches(tmp_path / "none") == 0
    with pytest.raises(AssertionError, match="no offsets/0: Spark deleted"):
        spark_batches(tmp_path, [])


def test_sigkilled_driver_restarts_exactly_once(spark: SparkSession, tmp_path: Path) -> None:
    """Each run gets new input files, is SIGKILLed at a random moment of the batch after
    its first commit, and the next run starts at the other parallelism; a run that ends
    before its kill does not count. The drivers materialize every 2 batches, and the
    first one is killed while its first materialization (after batch 1) uploads, slowed
    down. Then a last run finishes the input. Output and state equal plain Python."""
    batches = make_batches(MAX_KILLED_RUNS * FILES_PER_RUN, seed=23)
    input_dir, out = tmp_path / "in", tmp_path / "out"
    args = [
        "--input", str(input_dir),
        "--output", str(out),
        "--checkpoint-location", str(tmp_path / "ckpt"),
        "--state-dir", str(tmp_path / "state"),
        "--local-dir", str(tmp_path / "local"),
    ]  # fmt: skip
    log = tmp_path / "driver.log"
    commits = tmp_path / "ckpt" / "commits"
    job_dir = tmp_path / "state" / "streaming-user-totals"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kills = written_files = 0
    while kills < KILLS:
        assert written_files < len(batches), (
            f"{kills} kills (seed {seed}): {log.read_text()[-2000:]}"
        )
        slow = tmp_path / "slow-uploads" if kills == 0 else None
        files = FILES_PER_RUN + (slow is not None)  # a batch 2 to kill it in
        write_batch_files(input_dir, batches[written_files:][:files], first=written_files)
        written_files += files
        before = _committed_batches(commits)
        process = _run_script([*args, "--parallelism", str(2 + kills % 2)], log, slow)
        deadline = time.monotonic() + 240
        while process.poll() is None and (
            not _materialization_uploads(job_dir)
            if slow is not None
            else _committed_batches(commits) == before
        ):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        if slow is None:  # anywhere in the next batch: job, commit, publish
            time.sleep(rng.uniform(0.0, 1.5))
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            kills += 1
        process.wait()
    final = _run_script([*args, "--parallelism", "3"], log)
    assert final.wait(timeout=300) == 0, log.read_text()[-3000:]
    written = read_output(spark, out)
    ran = spark_batches(tmp_path / "ckpt", batches)
    given = batches[:written_files]
    assert sorted(row for rows in ran for row in rows) == sorted(r for b in given for r in b)
    expected = _amounts_as_sets(expected_output(ran))
    assert _amounts_as_sets(written) == expected, f"seed {seed}, {kills} kills"
    assert max(written.values()) == 1
    assert state_totals(spark, job_dir) == expected_totals(given)
