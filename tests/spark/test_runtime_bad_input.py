"""Bad input stops a run with one clear error and leaves the checkpoints intact."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from statebackend.checkpoint.layout import METRICS_DIR
from statebackend.checkpoint.metrics import FailureMetrics, read_history, records_of
from statebackend.checkpoint.savepoints import copy_checkpoint
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import build_parser
from statebackend.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    IncompatibleStateError,
    JobFailedError,
    SourceError,
)
from statebackend.spark import LogSource, StatefulJob
from statebackend.spark.conf import DEFAULT_SINGLE_STAGE_BYTES, KEYS, StateBackendConf
from statebackend.spark.example import (
    KEY_FIELD,
    OPERATOR_ID,
    UserTotals,
    checkpointed_totals,
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
    user_totals_job,
)
from statebackend.spark.runner import RunSummary
from statebackend.spark.source import partition_path
from tests.conftest import Storage
from tests.scripts import REPO

SCRIPT = REPO / "scripts" / "user_totals.py"


def _run(
    spark: SparkSession,
    tmp_path: Path,
    *,
    job_id: str = "bad",
    key_by: str = KEY_FIELD,
    parallelism: int = 2,
    restore: str | None = "latest",
    on_malformed: str = "fail",
    max_parallelism: int | None = None,
    input_dir: Path | None = None,
    **conf: Any,
) -> RunSummary:
    """Run the example job on ``input_dir`` (default ``tmp_path/input``); ``conf``: more
    StateBackendConf fields."""
    return user_totals_job(
        spark,
        job_id=job_id,
        input_dir=input_dir or tmp_path / "input",
        parallelism=parallelism,
        on_malformed=on_malformed,
        key_by=key_by,
        batch_size=100,
        checkpoint_every=2,
        restore=restore,
        conf=StateBackendConf(
            checkpoint_dir=(tmp_path / "checkpoints").as_uri(),
            local_dir=str(tmp_path / "local"),
            max_parallelism=max_parallelism,
            **conf,
        ),
    ).run()


def _files(tmp_path: Path) -> set[Path]:
    """The checkpoint files (not the metrics history: a failed run records its failure)."""
    return {
        p
        for p in (tmp_path / "checkpoints").rglob("*")
        if p.is_file() and METRICS_DIR not in p.relative_to(tmp_path / "checkpoints").parts
    }


@pytest.fixture
def checkpointed(spark_local: SparkSession, tmp_path: Path) -> RunSummary:
    generate_events(tmp_path / "input", 200, 20, 4, 3)
    return _run(spark_local, tmp_path)


def test_malformed_line(
    spark_local: SparkSession, tmp_path: Path, checkpointed: RunSummary
) -> None:
    with partition_path(tmp_path / "input", 1).open("a") as f:
        f.write('{"user": "u1", "amount": 3, "category": "food"}\n{"user": broken\n')
    before = _files(tmp_path)
    with pytest.raises(SourceError, match=r"partition-1\.jsonl line \d+: malformed record"):
        _run(spark_local, tmp_path)
    assert _files(tmp_path) == before
    skipped = _run(spark_local, tmp_path, on_malformed="skip")
    assert (skipped.records, skipped.skipped) == (1, 1)


def test_a_source_directory_without_partition_files_is_named_in_a_warning(
    spark_local: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory holding no ``partition-<n>.jsonl`` (a wrong path, files named
    otherwise) runs with no input, as before, but says so instead of a silent 0 records."""
    input_dir = tmp_path / "typo"
    input_dir.mkdir()
    (input_dir / "events.jsonl").write_text('{"user": "u1", "amount": 3}\n')
    summary = _run(spark_local, tmp_path, input_dir=input_dir)
    assert summary.records == 0
    assert f"source directory {input_dir} holds no partition-<n>.jsonl files" in caplog.text


@pytest.mark.parametrize("single_stage_bytes", [DEFAULT_SINGLE_STAGE_BYTES, 0])
@pytest.mark.parametrize("key", ["5", "null", "[1]", '{"a": 1}'], ids=str)
def test_a_line_whose_key_the_job_cannot_use_is_a_malformed_line(
    spark_local: SparkSession, tmp_path: Path, key: str, single_stage_bytes: int
) -> None:
    """A record whose key is not a str (the key serializer's type), or cannot be hashed,
    stops the run with its file and line (the first malformed one: a line that is not
    JSON follows); with on_malformed="skip" both are skipped and counted, and the state
    holds the other lines (computed in plain Python)."""
    generate_events(tmp_path / "input", 60, 8, 2, 5)
    path = partition_path(tmp_path / "input", 1)
    bad = f'{{"user": {key}, "amount": 3, "category": "food"}}\n'
    with path.open("a") as f:
        f.write(bad)
    generate_events(tmp_path / "input", 10, 8, 2, 6)
    with path.open("a") as f:
        f.write("not json\n")
    generate_events(tmp_path / "input", 10, 8, 2, 7)
    line = path.read_text().splitlines(keepends=True).index(bad) + 1

    def run(on_malformed: str) -> RunSummary:
        return _run(
            spark_local,
            tmp_path,
            job_id="bad-key",
            restore=None,
            on_malformed=on_malformed,
            single_stage_bytes=single_stage_bytes,
            max_retries=0,
        )

    with pytest.raises(SourceError, match=rf"partition-1\.jsonl line {line}: malformed record"):
        run("fail")
    summary = run("skip")
    good = [
        json.loads(line)
        for partition in sorted((tmp_path / "input").glob("partition-*.jsonl"))
        for line in partition.read_text().splitlines()
        if line.startswith('{"user": "')
    ]
    assert (summary.records, summary.skipped) == (len(good), 2)
    assert summary.last_checkpoint is not None
    assert (
        compare_totals(
            expected_totals(good), checkpointed_totals(spark_local, summary.last_checkpoint)
        )
        == []
    )


def test_checkpoint_of_another_job(
    spark_local: SparkSession, tmp_path: Path, checkpointed: RunSummary
) -> None:
    before = _files(tmp_path)
    with pytest.raises(IncompatibleStateError, match="keyed by 'user'"):
        _run(spark_local, tmp_path, key_by="category")
    assert checkpointed.last_checkpoint is not None
    with pytest.raises(ConfigurationError, match="checkpoint of job 'bad', not of 'other'"):
        _run(spark_local, tmp_path, job_id="other", restore=checkpointed.last_checkpoint)
    assert _files(tmp_path) == before


def test_a_restart_over_another_input_directory_is_refused(
    spark_local: SparkSession, tmp_path: Path, checkpointed: RunSummary
) -> None:
    """The job's checkpoints and manifests hold offsets into the files of the input
    directory they read: a restart of the job over another directory used to go on from
    those offsets in the other files, mixing the two. It is refused, naming both, from
    the newest checkpoint and from the newest manifest; the same directory through a
    symlink resumes, ending with the totals of the input (computed in plain Python)."""
    other = tmp_path / "other"
    generate_events(other, 300, 20, 4, 9)
    assert checkpointed.last_checkpoint is not None
    newest = Path(checkpointed.last_checkpoint.removeprefix("file://"))
    metadata = newest / "_metadata"
    for restore_point in (checkpointed.last_checkpoint, "manifests/"):
        before = _files(tmp_path)
        with pytest.raises(ConfigurationError) as raised:
            _run(spark_local, tmp_path, input_dir=other)
        message = str(raised.value)
        assert restore_point in message and "\n" not in message
        assert f"read the input directory {tmp_path / 'input'}, " in message
        assert f"this run reads {other}: rerun with that input" in message
        assert _files(tmp_path) == before
        if metadata.exists():  # "latest" is now the newest manifest
            metadata.rename(tmp_path / "metadata")
    (tmp_path / "metadata").rename(metadata)
    generate_events(tmp_path / "input", 50, 20, 4, 10)
    (tmp_path / "link").symlink_to(tmp_path / "input")
    summary = _run(spark_local, tmp_path, input_dir=tmp_path / "link")
    assert summary.records == 50 and summary.last_checkpoint is not None
    assert (
        compare_totals(
            expected_totals(read_events(tmp_path / "input")),
            checkpointed_totals(spark_local, summary.last_checkpoint),
        )
        == []
    )


def test_savepoint_of_another_operator(
    spark_local: SparkSession, tmp_path: Path, checkpointed: RunSummary
) -> None:
    """A job restoring a savepoint of another operator id is told the state is another
    job's (which operators it holds), not to drop state it would then lack."""
    assert checkpointed.last_checkpoint is not None
    storage = CheckpointStorage((tmp_path / "checkpoints").as_uri(), "bad")
    savepoint = (tmp_path / "savepoint").as_uri()
    copy_checkpoint(storage.fs, checkpointed.last_checkpoint, storage.fs, savepoint)
    job = StatefulJob(
        spark_local,
        job_id="other",
        source=LogSource(str(tmp_path / "input")),
        operator_id="renamed",
        key_by=KEY_FIELD,
        function=UserTotals(),
        parallelism=2,
        restore=savepoint,
        conf=StateBackendConf(
            checkpoint_dir=(tmp_path / "checkpoints").as_uri(), local_dir=str(tmp_path / "l")
        ),
    )
    with pytest.raises(
        IncompatibleStateError,
        match=rf"has no state of operator 'renamed'.*it has \['source', '{OPERATOR_ID}'\]",
    ):
        job.run()


def test_restore_path_not_completed(
    spark_local: SparkSession, tmp_path: Path, checkpointed: RunSummary
) -> None:
    pending = tmp_path / "checkpoints" / "bad" / "chk-99"
    pending.mkdir()
    with pytest.raises(CheckpointNotFoundError, match="not a completed checkpoint"):
        _run(spark_local, tmp_path, restore=pending.as_uri())


def test_restore_of_a_jobs_directory(
    spark_local: SparkSession, tmp_path: Path, checkpointed: RunSummary
) -> None:
    """A job's directory given for a checkpoint used to say only that it had no
    ``_metadata``; it names what it is, and what to give instead (as the command does)."""
    job_dir = (tmp_path / "checkpoints" / "bad").as_uri()
    before = _files(tmp_path)
    with pytest.raises(ConfigurationError) as raised:
        _run(spark_local, tmp_path, restore=job_dir)
    assert str(raised.value) == (
        f"restore {job_dir} is a job's directory, not a checkpoint or savepoint: give a "
        f"chk-<N> or savepoint directory (fold a job's batch manifests into one first: "
        f"statebackend savepoint create --from {job_dir}/latest --to DIR)"
    )
    assert _files(tmp_path) == before


def test_parallelism_above_max_parallelism(spark_local: SparkSession, tmp_path: Path) -> None:
    generate_events(tmp_path / "input", 10, 5, 1, 1)
    with pytest.raises(ConfigurationError, match="exceeds max parallelism 4"):
        _run(spark_local, tmp_path, parallelism=8, max_parallelism=4)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"parallelism": 0}, "parallelism 0 is invalid: it must be an integer >= 1"),
        ({"parallelism": True}, "parallelism True is invalid: it must be an integer >= 1"),
        ({"checkpoint_every": 0}, "checkpoint_every 0 is invalid: give an integer >= 1"),
        ({"batch_size": 0}, "batch size 0 is invalid: give an integer >= 1"),
        # of the wrong type: a TypeError from a comparison, or taken as they were
        ({"batch_size": "10"}, "batch size '10' is invalid: give an integer >= 1"),
        ({"batch_size": None}, "batch size None is invalid: give an integer >= 1"),
        ({"batch_size": 2.5}, "batch size 2.5 is invalid: give an integer >= 1"),
        ({"batch_size": True}, "batch size True is invalid: give an integer >= 1"),
        ({"checkpoint_every": "5"}, "checkpoint_every '5' is invalid: give an integer >= 1"),
        ({"checkpoint_every": 2.5}, "checkpoint_every 2.5 is invalid: give an integer >= 1"),
    ],
)
def test_bad_job_arguments_are_refused_when_the_job_is_made(
    spark_local: SparkSession, tmp_path: Path, arguments: dict[str, Any], message: str
) -> None:
    """Checked by ``StatefulJob`` itself, before a run: a parallelism of 0 used to end in
    a ZeroDivisionError inside the run, a checkpoint_every of 0 to mean the conf's."""
    options: dict[str, Any] = {"parallelism": 2, **arguments}
    with pytest.raises(ConfigurationError, match=f"^{re.escape(message)}$"):
        user_totals_job(
            spark_local,
            job_id="bad",
            input_dir=tmp_path / "input",
            conf=StateBackendConf(checkpoint_dir=tmp_path.as_uri()),
            **options,
        )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"function": UserTotals}, "function <class "),
        ({"function": lambda key, value: None}, "function <function "),
        ({"source": "input"}, "source 'input' is a str: give a LogSource"),
    ],
)
def test_a_function_or_source_of_another_type_is_refused_when_the_job_is_made(
    spark_local: SparkSession, tmp_path: Path, arguments: dict[str, Any], message: str
) -> None:
    """Not first in every task of a batch, retried max-retries times and ended as
    JobFailedError: AttributeError: 'function' object has no attribute 'open'."""
    generate_events(tmp_path / "input", 10, 5, 1, 1)
    options: dict[str, Any] = {
        "job_id": "typed",
        "source": LogSource(str(tmp_path / "input")),
        "operator_id": OPERATOR_ID,
        "key_by": KEY_FIELD,
        "function": UserTotals(),
        "parallelism": 2,
        "conf": StateBackendConf(checkpoint_dir=(tmp_path / "ck").as_uri()),
        **arguments,
    }
    with pytest.raises(ConfigurationError, match=f"^{re.escape(message)}") as raised:
        StatefulJob(spark_local, **options)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "ck").exists()


def test_relative_source_and_output_directories_are_the_driver_s(
    spark_local: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executors read the source and write the output, in a working directory of their
    own (a cluster's work/app-*/N): a relative path must be resolved where it was given,
    as scripts/user_totals.py and checkpoint.dir do."""
    monkeypatch.chdir(tmp_path)
    generate_events(tmp_path / "input", 10, 5, 1, 1)
    job = user_totals_job(
        spark_local,
        job_id="relative",
        input_dir="input",
        parallelism=2,
        conf=StateBackendConf(checkpoint_dir=(tmp_path / "ck").as_uri()),
        output_dir="out",
    )
    assert job.source.directory == str(tmp_path / "input")
    assert job.output_dir == str(tmp_path / "out")


def test_a_job_reads_the_settings_set_on_the_session(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """``spark.conf.set("spark.statebackend.backend", "heap")`` applies to a StatefulJob as
    to transform_with_state, and a misspelled key set so is refused: the job read only the
    SparkConf it was started with, ignoring both silently."""
    generate_events(tmp_path / "input", 10, 5, 1, 1)
    options: dict[str, Any] = {
        "job_id": "session",
        "input_dir": tmp_path / "input",
        "parallelism": 2,
        "conf": None,
    }
    directory = (tmp_path / "ck").as_uri()
    spark_local.conf.set("spark.statebackend.checkpoint.dir", directory)
    spark_local.conf.set("spark.statebackend.backend", "heap")
    try:
        job = user_totals_job(spark_local, **options)
        assert (job.conf.backend, job.conf.checkpoint_dir) == ("heap", directory)
        spark_local.conf.set("spark.statebackend.paralelism", "4")
        with pytest.raises(ConfigurationError, match="did you mean spark.statebackend.parallelism"):
            user_totals_job(spark_local, **options)
    finally:
        for key in ("checkpoint.dir", "backend", "paralelism"):
            spark_local.conf.unset("spark.statebackend." + key)
    assert not (tmp_path / "ck").exists()


def test_script_prints_one_line(tmp_path: Path) -> None:
    """The script's errors: one line, exit 2 (missing Java; no Spark is started)."""
    generate_events(tmp_path / "input", 10, 5, 1, 1)
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "no-java")}
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--input",
            str(tmp_path / "input"),
            "--checkpoint-dir",
            tmp_path.as_uri(),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("user_totals: error: Spark needs Java 17+")


def test_script_under_spark_submit_takes_the_checkpoint_dir_from_the_conf(tmp_path: Path) -> None:
    """``spark-submit --conf spark.statebackend.checkpoint.dir=URL user_totals.py --input
    DIR`` checkpoints there; with neither the key nor ``--checkpoint-dir``, one error line
    names both."""
    generate_events(tmp_path / "input", 20, 5, 2, 1)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    submit = [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[1]"]
    local = ["--conf", f"spark.statebackend.local.dir={tmp_path / 'local'}"]
    script = [str(SCRIPT), "--input", str(tmp_path / "input")]

    def run(*conf: str) -> subprocess.CompletedProcess[str]:
        argv = [*submit, *local, *conf, *script]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)

    result = run("--conf", f"spark.statebackend.checkpoint.dir={tmp_path.as_uri()}/ck")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "ck" / "user-totals" / "chk-1" / "_metadata").exists()
    result = run()
    assert result.returncode == 2
    # spark-submit's PythonRunner sends the script's stderr to its stdout.
    ours = [line for line in result.stdout.splitlines() if line.startswith("user_totals:")]
    assert ours == [
        "user_totals: error: no checkpoint directory: set spark.statebackend.checkpoint.dir "
        "(or --checkpoint-dir)"
    ]


@pytest.mark.parametrize("max_retries", [0, 1])
def test_max_retries_0_ends_the_run_at_the_first_failure(
    spark_local: SparkSession, tmp_path: Path, max_retries: int
) -> None:
    """``checkpoint.max-retries 0`` was refused (an integer >= 1): 0 means no retry, as
    Flink's 0 tolerable failures. A batch that always fails runs max-retries + 1 times
    (counted in the metrics history) before the run gives up."""

    class FailingTotals(UserTotals):  # local: pickled by value for the executors
        """The example's function, failing every batch with an error a retry may fix."""

        def process(self, key: Any, values: list[Any], ctx: Any) -> Any:
            raise RuntimeError("the keyed function failed")

    key = "spark.statebackend.checkpoint.max-retries"
    conf = StateBackendConf.from_pairs(
        [(key, str(max_retries))],
        checkpoint_dir=(tmp_path / "checkpoints").as_uri(),
        local_dir=str(tmp_path / "local"),
    )
    assert conf.max_retries == max_retries
    generate_events(tmp_path / "input", 20, 5, 2, 1)
    job = StatefulJob(
        spark_local,
        job_id="retries",
        source=LogSource(str(tmp_path / "input")),
        operator_id=OPERATOR_ID,
        key_by=KEY_FIELD,
        function=FailingTotals(),
        parallelism=2,
        conf=conf,
    )
    with pytest.raises(JobFailedError, match=f"failed {max_retries + 1} times in a row"):
        job.run()
    storage = CheckpointStorage(conf.checkpoint_dir, "retries")
    failures = records_of(read_history(storage.fs, storage.layout.job_dir), FailureMetrics)
    assert len(failures) == max_retries + 1
    assert all("the keyed function failed" in f.error for f in failures), failures
    for text in ("-1", "x"):
        with pytest.raises(ConfigurationError) as refused:
            StateBackendConf.from_pairs([(key, text)])
        assert str(refused.value) == f"{key}={text!r} is invalid: give an integer >= 0"


def test_conf_rejects_unknown_and_malformed_keys() -> None:
    conf = StateBackendConf.from_pairs(
        [
            ("spark.statebackend.checkpoint.interval", "5"),
            ("spark.statebackend.storage.endpoint_url", "http://127.0.0.1:9000"),
            ("spark.app.name", "x"),
        ],
        compression="zstd",
    )
    assert (conf.checkpoint_interval, conf.compression) == (5, "zstd")
    assert conf.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    with pytest.raises(ConfigurationError) as typo:
        StateBackendConf.from_pairs([("spark.statebackend.checkpoint.intreval", "5")])
    assert str(typo.value) == (
        "unknown key spark.statebackend.checkpoint.intreval: did you mean "
        "spark.statebackend.checkpoint.interval? (all keys: conf/statebackend.conf)"
    )
    with pytest.raises(ConfigurationError) as unknown:
        StateBackendConf.from_pairs([("spark.statebackend.nope", "1")])
    listed = re.fullmatch(
        r"unknown key spark\.statebackend\.nope: the known keys are (.*) and "
        r"spark\.statebackend\.storage\.<option> \(see conf/statebackend\.conf\)",
        str(unknown.value),
    )
    assert listed is not None, unknown.value
    assert listed[1].split(", ") == [f"spark.statebackend.{name}" for name in KEYS]
    with pytest.raises(ConfigurationError, match="spark.statebackend.checkpoint.interval='x'"):
        StateBackendConf.from_pairs([("spark.statebackend.checkpoint.interval", "x")])
    pairs = [("spark.statebackend.backend", "heap")]
    assert StateBackendConf.from_pairs(pairs).backend == "heap"
    with pytest.raises(ConfigurationError, match=r"backend='memory' is invalid.*'heap'"):
        StateBackendConf.from_pairs([("spark.statebackend.backend", "memory")])
    stall = [("spark.statebackend.checkpoint.upload-stall-timeout", "0")]
    with pytest.raises(ConfigurationError, match="upload-stall-timeout='0'"):
        StateBackendConf.from_pairs(stall)
    tick = "spark.statebackend.streaming.tick-interval"
    assert StateBackendConf.from_pairs([(tick, "0.5")]).tick_interval == 0.5
    assert StateBackendConf.from_pairs([(tick, "off")]).tick_interval is None
    with pytest.raises(ConfigurationError, match="tick-interval='-1'"):
        StateBackendConf.from_pairs([(tick, "-1")])
    directory = "spark.statebackend.checkpoint.dir"
    for given, read in (
        ("ckpt/a", os.path.abspath("ckpt/a")),
        ("/abs/ckpt", "/abs/ckpt"),
        ("s3://b/c", "s3://b/c"),
        ("file:/abs/ckpt", "file:/abs/ckpt"),  # as Hadoop spells a URI
        ("hdfs:/ckpt", "hdfs:/ckpt"),
        ("file:///abs/ckpt", "file:///abs/ckpt"),
    ):
        assert StateBackendConf.from_pairs([(directory, given)]).checkpoint_dir == read


@pytest.mark.s3
def test_storage_options_of_the_conf_mean_what_they_mean_on_the_command_line(
    s3_storage: Storage,
) -> None:
    """Every SparkConf value is text: ``storage.anon false`` must not be the truthy string
    'false' (anonymous requests), nor a block size the string '5242880' (every upload
    failed comparing it with a number); the CLI's --storage-option reads them as JSON."""
    given = {"default_block_size": "5242880", "anon": "false", "use_ssl": "true"}
    pairs = [(f"spark.statebackend.storage.{k}", v) for k, v in given.items()]
    pairs += [(f"spark.statebackend.storage.{k}", v) for k, v in s3_storage.storage_options.items()]
    conf = StateBackendConf.from_pairs(pairs)
    expected = {k: json.loads(v) for k, v in given.items()}
    assert {k: conf.storage_options[k] for k in given} == expected
    assert conf.storage_options["endpoint_url"] == s3_storage.storage_options["endpoint_url"]
    cli = build_parser().parse_args(
        ["list", s3_storage.url, *(f"--storage-option={k}={v}" for k, v in given.items())]
    )
    assert dict(cli.storage_option) == expected
    storage = CheckpointStorage(s3_storage.url, "job", storage_options=conf.storage_options)
    written = storage.fs.write_file(f"{s3_storage.url}/job/file", [b"x" * 100])
    assert written.size == 100
    storage.close()


@pytest.mark.parametrize(
    ("key", "text", "says"),
    [
        ("max-parallelism", "0", "from 1 to 32768"),
        ("max-parallelism", "40000", "from 1 to 32768"),
        ("checkpoint.signing-key", "short", "has 5 bytes: give at least 16"),
        ("checkpoint.timeout", "inf", "finite number of seconds"),
        ("checkpoint.timeout", "nan", "finite number of seconds"),
        ("checkpoint.upload-stall-timeout", "inf", "finite number of seconds"),
        ("checkpoint.upload-stall-timeout", "nan", "finite number of seconds"),
        ("local.dir", "", "is empty: give a directory"),
        ("local.dir", "  ", "is empty: give a directory"),
        # set but empty (an unset variable in --conf ...=$KEY): not "unsigned" silently
        ("checkpoint.signing-key", "", "is empty: give at least 16 bytes"),
        ("checkpoint.signing-key", "  ", "is empty: give at least 16 bytes"),
        ("checkpoint.signing-key-file", "", "is empty: give the key's file"),
    ],
)
def test_conf_rejects_values_that_would_fail_later(key: str, text: str, says: str) -> None:
    name = "spark.statebackend." + key
    with pytest.raises(ConfigurationError, match=f"^{re.escape(name)}.*{says}") as err:
        StateBackendConf.from_pairs([(name, text)])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("key", "text", "field", "expected"),
    [
        ("backend", "RocksDB", "backend", "rocksdb"),
        ("backend", "HEAP", "backend", "heap"),
        ("compression", "LZ4", "compression", "lz4"),
        ("compression", "Zstd", "compression", "zstd"),
        ("parallelism", "AUTO", "parallelism", None),
        ("max-parallelism", "Auto", "max_parallelism", None),
        ("streaming.tick-interval", "OFF", "tick_interval", None),
    ],
)
def test_conf_names_are_case_insensitive_as_spark_s(
    key: str, text: str, field: str, expected: Any
) -> None:
    """Spark reads the names its own keys choose from in any case
    (spark.io.compression.codec=LZ4, spark.sql.parquet.compression.codec=Zstd)."""
    conf = StateBackendConf.from_pairs([("spark.statebackend." + key, text)])
    assert getattr(conf, field) == expected


@pytest.mark.parametrize(
    ("key", "text", "seconds"),
    [
        ("checkpoint.timeout", "10min", 600.0),
        ("checkpoint.timeout", "1h", 3600.0),
        ("checkpoint.timeout", "2d", 2 * 86400.0),
        ("checkpoint.timeout", "15m", 900.0),
        ("checkpoint.upload-stall-timeout", "30s", 30.0),
        ("checkpoint.upload-stall-timeout", " 45S ", 45.0),
        ("streaming.tick-interval", "500ms", 0.5),
        ("streaming.tick-interval", "250000us", 0.25),
        ("streaming.tick-interval", "2", 2.0),
    ],
)
def test_conf_durations_take_spark_s_time_strings(key: str, text: str, seconds: float) -> None:
    """As Spark's own durations (spark.network.timeout=120s, JavaUtils.timeStringAsSec):
    a number of seconds, or one with a unit us, ms, s, m, min, h or d."""
    conf = StateBackendConf.from_pairs([("spark.statebackend." + key, text)])
    field = {
        "checkpoint.timeout": "timeout_seconds",
        "checkpoint.upload-stall-timeout": "upload_stall_seconds",
        "streaming.tick-interval": "tick_interval",
    }[key]
    assert getattr(conf, field) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["30 s", "30sec", "0s", "-5s", "s", "10mins", "infs"])
def test_conf_durations_refuse_what_is_no_duration(text: str) -> None:
    name = "spark.statebackend.checkpoint.timeout"
    with pytest.raises(ConfigurationError, match=f"^{re.escape(name)}={re.escape(repr(text))}"):
        StateBackendConf.from_pairs([(name, text)])


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("spark.stateBackend.backend", "spark.statebackend.backend"),
        ("spark.StateBackend.checkpoint.Interval", "spark.statebackend.checkpoint.interval"),
    ],
)
def test_a_key_whose_prefix_differs_only_in_case_is_unknown_not_ignored(
    key: str, meant: str
) -> None:
    """Spark's keys are case-sensitive: spark.stateBackend.backend=heap would be ignored
    and the job run on RocksDB."""
    with pytest.raises(ConfigurationError) as raised:
        StateBackendConf.from_pairs([(key, "heap")])
    assert str(raised.value) == (
        f"unknown key {key}: did you mean {meant}? (all keys: conf/statebackend.conf)"
    )


def test_conf_accepts_the_bounds() -> None:
    pairs = [
        ("spark.statebackend.max-parallelism", "32768"),
        ("spark.statebackend.checkpoint.signing-key", "s" * 16),
        ("spark.statebackend.checkpoint.timeout", "1e6"),
    ]
    conf = StateBackendConf.from_pairs(pairs)
    assert (conf.max_parallelism, conf.timeout_seconds) == (32768, 1e6)
    low = StateBackendConf.from_pairs([("spark.statebackend.max-parallelism", "1")])
    assert low.max_parallelism == 1
    assert StateBackendConf.from_pairs([("spark.statebackend.max-parallelism", "auto")]) == (
        StateBackendConf()
    )


def _properties(name: str) -> list[tuple[str, str]]:
    path = REPO / "conf" / name
    pairs = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split(None, 1)
            pairs.append((key, value))
    return pairs


def test_properties_file_parses() -> None:
    assert StateBackendConf.from_pairs(_properties("statebackend.conf")) == StateBackendConf()


@pytest.mark.parametrize(
    ("name", "checkpoint_dir"),
    [
        ("local-disk.conf", "file:///var/lib/statebackend/checkpoints"),
        ("s3.conf", "s3://my-bucket/statebackend/checkpoints"),
        ("hdfs.conf", "hdfs://namenode:8020/statebackend/checkpoints"),
    ],
)
def test_example_properties_files_parse(name: str, checkpoint_dir: str) -> None:
    pairs = _properties(name)
    conf = StateBackendConf.from_pairs(pairs)
    assert conf.checkpoint_dir == checkpoint_dir
    assert conf.retained == 3
    assert conf.storage_options == {
        key.removeprefix("spark.statebackend.storage."): value
        for key, value in pairs
        if key.startswith("spark.statebackend.storage.")
    }
