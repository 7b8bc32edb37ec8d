"""The ``statebackend`` command against the checkpoints of a real run of the example job.

The example job (``statebackend.spark.example``, run by ``StatefulJob`` in ``local[2]``)
runs once per storage (file:// and s3://) at P=2 over generated input; the tests then run
``read``, ``verify``, ``plan``, ``gc`` and ``savepoint create`` (in-process through
``cli.main``) on its checkpoints and compare with ``expected_totals``, the example's
plain-Python computation of the input, and with what a restart of the job does. Tests that
damage, add or delete files work on a copy of the job directory, so the tests are
independent of each other and of their order. ``scripts/savepoint-and-rescale.sh`` is
tested here too, with the restart command it prints run in-process.
"""

from __future__ import annotations

import json
import os
import posixpath
import shlex
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
from pyspark.sql import SparkSession

import statebackend.spark.runner as runner_module
from statebackend.backends.operator import OperatorStateBackend
from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.layout import join
from statebackend.checkpoint.requests import answer_savepoint_request, pending_savepoint_requests
from statebackend.checkpoint.savepoints import copy_checkpoint
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from statebackend.keygroups import assign_to_key_group
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.example import (
    OPERATOR_ID,
    expected_totals,
    generate_events,
    read_events,
    user_totals_job,
)
from statebackend.spark.runner import SOURCE_OPERATOR, RunSummary
from statebackend.spark.source import offsets_state, partition_path
from statebackend.tools.location import open_location
from tests.conftest import S3Endpoint, Storage
from tests.report_job import figures, marks
from tests.scripts import REPO, load_script
from tests.spark.conftest import LOCAL_MASTER
from tests.spark.jobs import state_per_batch

JOB_ID = "user-totals"
EVENTS = 1200
USERS = 50
PARTITIONS = 4
BATCH_SIZE = 50  # records per partition and batch: 6 batches, one checkpoint each
STATES = ("count", "total", "categories", "recent")


@dataclass(frozen=True)
class ExampleRun:
    """A completed run of the example job: where its input and checkpoints are."""

    storage: Storage
    input_dir: Path
    summary: RunSummary
    s3: S3Endpoint | None

    @property
    def job_dir(self) -> str:
        """The job's checkpoint directory."""
        return join(self.storage.url, JOB_ID)

    @property
    def checkpoint(self) -> str:
        """The run's last completed checkpoint."""
        assert self.summary.last_checkpoint is not None
        return self.summary.last_checkpoint

    def new_storage(self, tmp_path: Path) -> Storage:
        """A fresh, empty location on the same kind of storage."""
        if self.s3 is not None:
            return self.s3.new_storage()
        return Storage((tmp_path / f"storage-{uuid.uuid4().hex[:8]}").as_uri())

    def fs(self) -> CheckpointFileSystem:
        """The checkpoint file system of the run's storage."""
        return open_location(self.storage.url, self.storage.storage_options)

    def expected(self) -> dict[str, dict[str, Any]]:
        """The state a correct run ends with, computed in plain Python from the input."""
        return expected_totals(read_events(self.input_dir))


def run_job(
    spark: SparkSession,
    storage: Storage,
    input_dir: Path,
    local_dir: Path,
    parallelism: int,
    restore: str | None = "latest",
) -> RunSummary:
    """Run the example job over what is in ``input_dir``, checkpointing every batch."""
    conf = StateBackendConf(
        checkpoint_dir=storage.url,
        storage_options=storage.storage_options,
        local_dir=str(local_dir),
    )
    return user_totals_job(
        spark,
        job_id=JOB_ID,
        input_dir=input_dir,
        parallelism=parallelism,
        conf=conf,
        batch_size=BATCH_SIZE,
        checkpoint_every=1,
        restore=restore,
    ).run()


@pytest.fixture(scope="module", params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def example(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    _spark_sessions: Any,
) -> ExampleRun:
    """One run of the example job at P=2 per storage, shared by this module's tests.

    Module-scoped (``checkpoint_url`` is per test): running the job per test would cost
    a Spark run each. Its tests also ask for ``spark_local``, which marks them ``spark``.
    """
    tmp = tmp_path_factory.mktemp(f"example-{request.param}")
    s3: S3Endpoint | None = None
    if request.param == "s3":
        s3 = request.getfixturevalue("s3_endpoint")
        assert s3 is not None
        storage = s3.new_storage()
    else:
        storage = Storage((tmp / "checkpoints").as_uri())
    generate_events(tmp / "input", EVENTS, USERS, PARTITIONS, seed=11)
    spark = _spark_sessions.get(LOCAL_MASTER)
    summary = run_job(spark, storage, tmp / "input", tmp / "local", 2, restore=None)
    assert summary.records == EVENTS and summary.failures == 0
    return ExampleRun(storage, tmp / "input", summary, s3)


# -- helpers --------------------------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], storage: Storage, *argv: str) -> tuple[int, str, str]:
    """Run ``statebackend ARGV`` in-process with the storage's options: (status, out, err)."""
    capsys.readouterr()
    options = [f"--storage-option={k}={v}" for k, v in storage.storage_options.items()]
    status = main([*argv, *options])
    out, err = capsys.readouterr()
    return status, out, err


def jsonl(text: str) -> list[dict[str, Any]]:
    """The JSON objects of JSON-lines output."""
    return [json.loads(line) for line in text.splitlines()]


def read(
    capsys: pytest.CaptureFixture[str], storage: Storage, checkpoint: str, operator: str, state: str
) -> list[dict[str, Any]]:
    """``statebackend read`` of one state as records (``{"key", "value"}`` or ``{"value"}``)."""
    status, out, err = cli(
        capsys, storage, "read", checkpoint, "--operator", operator, "--state", state
    )
    assert status == 0, err
    return jsonl(out)


def read_totals(
    capsys: pytest.CaptureFixture[str], storage: Storage, checkpoint: str
) -> dict[str, dict[str, Any]]:
    """The example's four states per user, read with ``statebackend read``, shaped like
    ``expected_totals``."""
    totals: dict[str, dict[str, Any]] = {}
    for state in STATES:
        for record in read(capsys, storage, checkpoint, OPERATOR_ID, state):
            totals.setdefault(record["key"], {})[state] = record["value"]
    return totals


def source_offsets(
    capsys: pytest.CaptureFixture[str], storage: Storage, checkpoint: str
) -> dict[int, int]:
    """partition -> byte offset of the checkpoint's source operator state."""
    records = read(capsys, storage, checkpoint, SOURCE_OPERATOR, "offsets")
    return dict(tuple(r["value"]) for r in records)


def end_offsets(input_dir: Path) -> dict[int, int]:
    """partition -> size of its file: the offsets once everything was consumed."""
    return {p: partition_path(input_dir, p).stat().st_size for p in range(PARTITIONS)}


def list_files(storage: Storage, directory: str) -> set[str]:
    """The files under ``directory`` (a URL), as URLs, asking the storage (no cache)."""
    options = storage.storage_options if directory.startswith("s3://") else {}
    fs, root = fsspec.core.url_to_fs(directory, **options)
    root = str(root).rstrip("/")
    fs.invalidate_cache()
    return {directory.rstrip("/") + str(path)[len(root) :] for path in fs.find(root)}


def copy_tree(storage: Storage, source: str, target: str) -> None:
    """Copy every file under ``source`` to the same place under ``target`` (same storage)."""
    fs = open_location(source, storage.storage_options)
    for path in list_files(storage, source):
        fs.copy(path, target.rstrip("/") + path[len(source.rstrip("/")) :])


def clone_job(example: ExampleRun, tmp_path: Path) -> Storage:
    """A copy of the run's job directory in a fresh location (same kind of storage)."""
    storage = example.new_storage(tmp_path)
    copy_tree(storage, example.job_dir, join(storage.url, JOB_ID))
    return storage


def resolve(directory: str, relative: str) -> str:
    """The URL of a file a checkpoint in ``directory`` references as ``relative``."""
    scheme, sep, rest = join(directory, relative).rpartition("://")
    return f"{scheme}{sep}{posixpath.normpath(rest)}"


def referenced_files(storage: Storage) -> set[str]:
    """Every file (and ``_metadata``) the job's completed checkpoints reference."""
    checkpoints = CheckpointStorage(storage.url, JOB_ID, storage_options=storage.storage_options)
    try:
        referenced = set()
        for checkpoint_id in checkpoints.completed_checkpoint_ids():
            directory = checkpoints.resolve(checkpoint_id)
            metadata = checkpoints.load(checkpoint_id)
            referenced |= {resolve(directory, f) for f, _, _ in metadata.files()}
            referenced.add(join(directory, "_metadata"))
        return referenced
    finally:
        checkpoints.close()


# -- the tests ------------------------------------------------------------------------------


def test_read_equals_the_plain_python_computation(
    capsys: pytest.CaptureFixture[str], spark_local: SparkSession, example: ExampleRun
) -> None:
    """``read`` of each of count, total, categories and recent (jsonl), one key, and the
    source offsets (every partition consumed to its end)."""
    expected = example.expected()
    assert len(expected) == USERS
    for state in STATES:
        records = read(capsys, example.storage, example.checkpoint, OPERATOR_ID, state)
        keys = [r["key"] for r in records]
        assert len(keys) == len(set(keys)), state
        assert {r["key"]: r["value"] for r in records} == {
            user: totals[state] for user, totals in expected.items()
        }, state
    status, out, err = cli(
        capsys,
        example.storage,
        *("read", example.checkpoint, "--operator", OPERATOR_ID, "--state", "categories"),
        *("--key", "u7"),
    )
    assert status == 0, err
    assert jsonl(out) == [{"key": "u7", "value": expected["u7"]["categories"]}]
    assert source_offsets(capsys, example.storage, example.checkpoint) == end_offsets(
        example.input_dir
    )
    # The driver commits them in each manifest too: the last batch's has the same.
    manifest = join(example.job_dir, "manifests", str(example.summary.batches - 1))
    assert source_offsets(capsys, example.storage, manifest) == end_offsets(example.input_dir)


def test_verify_passes_then_catches_missing_truncated_and_flipped_files(
    capsys: pytest.CaptureFixture[str],
    spark_local: SparkSession,
    example: ExampleRun,
    tmp_path: Path,
) -> None:
    """``verify`` on the run's checkpoint, then on a copy with one keyed file damaged."""
    status, out, err = cli(capsys, example.storage, "verify", example.checkpoint)
    assert status == 0 and out.startswith("OK "), err
    storage = clone_job(example, tmp_path)
    checkpoint = join(storage.url, JOB_ID, example.checkpoint.rsplit("/", 1)[-1])
    assert cli(capsys, storage, "verify", checkpoint)[0] == 0
    checkpoints = CheckpointStorage(storage.url, JOB_ID, storage_options=storage.storage_options)
    relative, _, _ = max(checkpoints.load(checkpoint).files(), key=lambda f: f[1])
    checkpoints.close()
    fs = open_location(storage.url, storage.storage_options)
    path = resolve(checkpoint, relative)  # the biggest file: keyed state
    original = fs.read_file(path)
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    for damage, content in (
        ("delete", None),
        ("truncate", original[:-5]),
        ("flip", bytes(flipped)),
    ):
        fs.delete(path)
        if content is not None:
            fs.write_file(path, [content])
        status, out, err = cli(capsys, storage, "verify", checkpoint)
        assert status == 1, damage
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("statebackend: error: "), err
        assert path.rsplit("/", 1)[-1] in err and f"FAILED {path}" in out, (damage, out)
        fs.delete(path)
        fs.write_file(path, [original])
    assert cli(capsys, storage, "verify", checkpoint)[0] == 0


@pytest.mark.parametrize(("parallelism", "spread"), [(1, [4]), (2, [2, 2]), (4, [1, 1, 1, 1])])
def test_plan_of_the_source_matches_a_restart(
    capsys: pytest.CaptureFixture[str],
    spark_local: SparkSession,
    example: ExampleRun,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    parallelism: int,
    spread: list[int],
) -> None:
    """``plan --operator source`` spreads the 4 partitions 4 / 2+2 / 1+1+1+1, and a restart
    of the job at that parallelism restores exactly those offsets per source subtask."""
    argv = ("plan", example.checkpoint, "--parallelism", str(parallelism), "--operator", "source")
    status, out, err = cli(capsys, example.storage, *argv, "--json")
    assert status == 0, err
    plans = json.loads(out)
    assert list(plans) == [SOURCE_OPERATOR]
    planned = [
        [tuple(record["value"]) for record in sub["operator_state"]["offsets"]["values"]]
        for sub in plans[SOURCE_OPERATOR]
    ]
    assert [len(share) for share in planned] == spread
    assert dict(offset for share in planned for offset in share) == end_offsets(example.input_dir)
    status, text, _ = cli(capsys, example.storage, *argv)
    assert status == 0
    assert [line.split()[1] for line in text.splitlines() if "offsets:" in line] == [
        str(n) for n in spread
    ]
    assert all(f"({p}, {o})" in text for p, o in end_offsets(example.input_dir).items())

    restored: dict[int, OperatorStateBackend] = {}
    real_restore = runner_module.restore_operator_state

    def recording(*args: Any) -> OperatorStateBackend:
        backend = real_restore(*args)
        if args[3] == SOURCE_OPERATOR:
            restored[args[4]] = backend
        return backend

    monkeypatch.setattr(runner_module, "restore_operator_state", recording)
    summary = run_job(
        spark_local,
        example.storage,
        example.input_dir,
        tmp_path / "local",
        parallelism,
        restore=example.checkpoint,
    )
    assert summary.restored_from == example.checkpoint and summary.batches == 0
    assert sorted(restored) == list(range(parallelism))
    assert [list(offsets_state(restored[i]).get()) for i in range(parallelism)] == planned


def test_gc_lists_an_aborted_checkpoint_and_never_a_referenced_file(
    capsys: pytest.CaptureFixture[str],
    spark_local: SparkSession,
    example: ExampleRun,
    tmp_path: Path,
) -> None:
    """A clean run leaves no garbage. A crashed upload (a ``chk-<N>`` without
    ``_metadata`` older than the newest completed one, and a stray file in a completed
    checkpoint) is listed file by file, deleted with ``--apply``, and nothing else."""
    status, out, err = cli(capsys, example.storage, "gc", example.job_dir)
    assert status == 0, err
    assert out.strip() == f"0 unreferenced files, 0 B, in {example.job_dir}"

    storage = clone_job(example, tmp_path)
    job_dir = join(storage.url, JOB_ID)
    checkpoints = CheckpointStorage(storage.url, JOB_ID, storage_options=storage.storage_options)
    completed = checkpoints.completed_checkpoint_ids()
    checkpoints.close()
    newest = max(completed)
    # An id retention retired; with few checkpoints (a loaded machine postpones some while
    # others upload) there is none, and 0 stands for one: an id below the newest.
    stale = min(set(range(1, newest)) - set(completed), default=0)
    fs = open_location(job_dir, storage.storage_options)
    newest_dir, stale_dir = join(job_dir, f"chk-{newest}"), join(job_dir, f"chk-{stale}")
    # The crashed upload of chk-<stale>: every file of a checkpoint, but no _metadata.
    copy_tree(storage, newest_dir, stale_dir)
    fs.delete(join(stale_dir, "_metadata"))
    stale_files = list_files(storage, stale_dir)
    assert stale_files
    # A retried task's second upload into the newest completed checkpoint.
    stray = join(newest_dir, f"{OPERATOR_ID}-0-keyed-retried-{uuid.uuid4().hex[:8]}")
    fs.write_file(stray, [b"the upload of a task attempt that was retried"])
    referenced = referenced_files(storage)

    assert (
        cli(capsys, storage, "gc", job_dir)[1].strip() == f"0 unreferenced files, 0 B, in {job_dir}"
    )
    status, out, err = cli(capsys, storage, "gc", job_dir, "--grace", "0")  # all are young
    assert status == 0, err
    listed = {line.split()[1] for line in out.splitlines()[:-1]}
    assert listed == stale_files | {stray}
    assert not listed & referenced
    assert out.splitlines()[-1].startswith(f"{len(listed)} unreferenced files")
    status, out, _ = cli(capsys, storage, "gc", job_dir, "--apply", "--grace", "0")
    assert status == 0 and out.splitlines()[-1].startswith(f"deleted {len(listed)} files")
    assert out.splitlines()[-1].endswith(f", from {job_dir}")
    status, out, _ = cli(capsys, storage, "gc", job_dir, "--grace", "0")
    assert out.strip() == f"0 unreferenced files, 0 B, in {job_dir}"
    assert referenced_files(storage) == referenced
    assert cli(capsys, storage, "verify", newest_dir)[0] == 0
    assert read_totals(capsys, storage, newest_dir) == example.expected()


def test_savepoint_create_restores_at_p3_after_the_checkpoints_are_deleted(
    capsys: pytest.CaptureFixture[str],
    spark_local: SparkSession,
    example: ExampleRun,
    tmp_path: Path,
) -> None:
    """``savepoint create`` from the job's newest state (``<job dir>/latest``: its newest
    batch manifest, folded with its base checkpoint); the job directory deleted; the job
    restored from the savepoint at P=3 with more input ends with the right totals, its
    source resuming at the offsets of the manifest's batch (nothing read twice)."""
    storage = clone_job(example, tmp_path)
    job_dir = join(storage.url, JOB_ID)
    latest = join(job_dir, "latest")
    target = join(example.new_storage(tmp_path).url, "savepoints", "sp-1")
    status, out, err = cli(capsys, storage, "savepoint", "create", "--from", latest, "--to", target)
    assert status == 0, err
    assert out.strip() == target
    fs = open_location(job_dir, storage.storage_options)
    fs.delete(job_dir, recursive=True)
    assert not fs.exists(job_dir)
    assert cli(capsys, storage, "verify", target)[0] == 0
    status, out, _ = cli(capsys, storage, "inspect", target, "--json")
    assert json.loads(out)["kind"] == "savepoint"
    assert read_totals(capsys, storage, target) == example.expected()

    input_dir = tmp_path / "input"
    shutil.copytree(example.input_dir, input_dir)
    generate_events(input_dir, 600, USERS + 10, PARTITIONS, seed=12)
    summary = run_job(spark_local, storage, input_dir, tmp_path / "local", 3, restore=target)
    assert summary.restored_from == target and summary.records == 600
    assert summary.last_checkpoint is not None
    expected = expected_totals(read_events(input_dir))
    assert read_totals(capsys, storage, summary.last_checkpoint) == expected


@pytest.fixture(scope="module")
def user_totals() -> Iterator[Any]:
    """``scripts/user_totals.py`` as a module, to run restart commands in-process."""
    yield load_script("scripts/user_totals.py", "user_totals")


def test_savepoint_and_rescale_script_from_the_latest_checkpoint(
    capsys: pytest.CaptureFixture[str],
    spark_local: SparkSession,
    example: ExampleRun,
    tmp_path: Path,
    user_totals: Any,
) -> None:
    """``scripts/savepoint-and-rescale.sh JOBDIR -p 4`` (the job is stopped): a savepoint
    of its newest state (the newest manifest, folded) and a restart command that, run
    with more input, ends with the right totals at P=4."""
    storage = clone_job(example, tmp_path)
    job_dir = join(storage.url, JOB_ID)
    options = [f"--storage-option={k}={v}" for k, v in storage.storage_options.items()]
    result = subprocess.run(
        [str(REPO / "scripts/savepoint-and-rescale.sh"), job_dir, "-p", "4", *options],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    savepoint = lines["savepoint"]
    assert savepoint.startswith(join(job_dir, "savepoints", "savepoint-"))
    status, out, _ = cli(capsys, storage, "inspect", savepoint, "--json")
    assert status == 0 and json.loads(out)["kind"] == "savepoint"
    assert read_totals(capsys, storage, savepoint) == example.expected()

    command = shlex.split(lines["restart"])
    assert command[1] == str(REPO / "scripts/user_totals.py")
    args = user_totals._parser().parse_args(command[2:])
    assert (args.input, args.checkpoint_dir, args.job_id) == (
        str(example.input_dir),
        storage.url,
        JOB_ID,
    )
    assert (args.restore, args.parallelism) == (savepoint, 4)
    # Run the restart command in-process (it reuses this Spark session), with more input.
    input_dir = tmp_path / "input"
    shutil.copytree(example.input_dir, input_dir)
    generate_events(input_dir, 400, USERS, PARTITIONS, seed=13)
    argv = command[2:]
    argv[argv.index("--input") + 1] = str(input_dir)
    assert user_totals.main([*argv, "--batch-size", str(BATCH_SIZE)]) == 0
    checkpoints = CheckpointStorage(storage.url, JOB_ID, storage_options=storage.storage_options)
    latest = checkpoints.latest_completed()
    metadata = checkpoints.load(latest) if latest else None
    checkpoints.close()
    assert latest is not None and metadata is not None
    assert metadata.operators[OPERATOR_ID].parallelism == 4
    assert read_totals(capsys, storage, latest) == expected_totals(read_events(input_dir))


def test_a_job_id_differing_only_in_case_from_an_existing_job_is_refused(
    capsys: pytest.CaptureFixture[str],
    spark_local: SparkSession,
    tmp_path: Path,
    user_totals: Any,
) -> None:
    """``--job-id Users`` beside an existing job ``users`` started a second job, in a
    directory of its own only where names are case-sensitive (Linux, S3): on macOS or a
    Windows share it is ``users``'s directory, whose driver it fences and whose
    checkpoints its retention deletes. It is now refused before it writes anything,
    naming the existing job, wherever it runs; ``users`` itself goes on."""
    generate_events(tmp_path / "input", 200, USERS, PARTITIONS, seed=3)
    job = ["--input", str(tmp_path / "input"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    job += ["--parallelism", "2", "--batch-size", str(BATCH_SIZE)]
    assert user_totals.main([*job, "--job-id", "users", "--output", str(tmp_path / "a")]) == 0
    before = {path: path.read_bytes() for path in (tmp_path / "ckpt").rglob("*") if path.is_file()}
    capsys.readouterr()
    assert user_totals.main([*job, "--job-id", "Users", "--output", str(tmp_path / "b")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "'Users'" in line and "'users'" in line, line
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["users"]
    after = {path: path.read_bytes() for path in (tmp_path / "ckpt").rglob("*") if path.is_file()}
    assert after == before
    generate_events(tmp_path / "input", 100, USERS, PARTITIONS, seed=4)
    again = [*job, "--job-id", "users", "--output", str(tmp_path / "a"), "--restore", "latest"]
    assert user_totals.main(again) == 0


def test_relative_paths_of_the_job_and_the_script_become_absolute(
    spark_local: SparkSession,
    tmp_path: Path,
    user_totals: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``user_totals.py`` with a relative --input, --output and --checkpoint-dir runs
    (its executors have another working directory); the script, given a relative JOB_DIR
    from elsewhere, prints a restart command with absolute paths that runs from anywhere,
    with the JOB_ARGS after ``--``."""
    monkeypatch.chdir(tmp_path)
    generate_events("input", 400, USERS, PARTITIONS, seed=3)
    job = ["--checkpoint-dir", "ckpt", "--job-id", "rel", "--parallelism", "2"]
    assert user_totals.main(["--input", "input", "--output", "out", *job]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [str(REPO / "scripts/savepoint-and-rescale.sh"), "../ckpt/rel", "-p", "3", "--"]
        + ["--output", "../out", "--batch-size", "25"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this repository's statebackend
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    command = shlex.split(lines["restart"])
    args = user_totals._parser().parse_args(command[2:])
    assert (args.input, args.checkpoint_dir) == (str(tmp_path / "input"), str(tmp_path / "ckpt"))
    assert (args.job_id, args.restore, args.parallelism) == ("rel", lines["savepoint"], 3)
    assert lines["savepoint"].startswith(str(tmp_path / "ckpt" / "rel" / "savepoints") + "/")
    generate_events(tmp_path / "input", 200, USERS, PARTITIONS, seed=4)
    monkeypatch.chdir(elsewhere)
    before = set((tmp_path / "out").iterdir())
    assert user_totals.main(command[2:]) == 0
    # 50 new events per partition at 25 a batch: two more batches, in the same output.
    assert len(set((tmp_path / "out").iterdir()) - before) >= 2


def test_savepoint_and_rescale_script_of_a_running_job(
    spark_local: SparkSession, example: ExampleRun, tmp_path: Path
) -> None:
    """``--running``: the script asks the job for a savepoint and waits for it. Here a
    thread plays the job's driver (``test_savepoint_running_job`` has a real one): it
    answers the request with a savepoint of the latest checkpoint."""
    storage = clone_job(example, tmp_path)
    job_dir = join(storage.url, JOB_ID)
    fs = open_location(job_dir, storage.storage_options)
    latest = join(job_dir, example.checkpoint.rsplit("/", 1)[-1])
    stop = threading.Event()

    def driver() -> None:
        while not stop.wait(0.05):
            for request in pending_savepoint_requests(fs, job_dir):
                path = copy_checkpoint(fs, latest, fs, request.savepoint_dir(job_dir))
                answer_savepoint_request(fs, job_dir, request, savepoint_path=path)

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    options = [f"--storage-option={k}={v}" for k, v in storage.storage_options.items()]
    try:
        result = subprocess.run(
            [str(REPO / "scripts/savepoint-and-rescale.sh"), job_dir, "--running", "-p", "3"]
            + [*options, "--wait", "60", "--", "--master", "local[3]"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stop.set()
        thread.join()
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["savepoint"].startswith(join(job_dir, "savepoints", "savepoint-request-"))
    assert fs.exists(join(lines["savepoint"], "_metadata"))
    command = shlex.split(lines["restart"])
    assert command[-2:] == ["--master", "local[3]"]
    assert command[command.index("--restore") + 1] == lines["savepoint"]
    assert command[command.index("--parallelism") + 1] == "3"
    assert command[command.index("--input") + 1] == str(example.input_dir)


def test_report_of_the_example_job(
    capsys: pytest.CaptureFixture[str],
    spark_local: SparkSession,
    example: ExampleRun,
    tmp_path: Path,
) -> None:
    """``report`` of the real run: its newest checkpoint, its keyed state in exactly the
    key groups of the input's users, split as the job ran, and a page with those plots."""
    status, out, err = cli(capsys, example.storage, "report", example.job_dir, "--json")
    assert status == 0, err
    report = json.loads(out)
    latest = report["latest"]
    assert latest["path"] == example.checkpoint
    assert report["checkpoints"][-1]["checkpoint_id"] == latest["checkpoint_id"]
    assert report["checkpoints"][-1]["retained"] is True
    max_parallelism = latest["max_parallelism"]
    groups = latest["operators"][OPERATOR_ID]["key_groups"]
    users = {assign_to_key_group(user.encode(), max_parallelism) for user in example.expected()}
    assert {g for g, size in enumerate(groups["bytes"]) if size} == users
    split = groups["candidates"][1]  # P = 2, as the job ran
    subtasks = latest["operators"][OPERATOR_ID]["subtasks"]
    assert [s["key_group_range"] for s in subtasks] == [
        [0, max_parallelism // 2 - 1],
        [max_parallelism // 2, max_parallelism - 1],
    ]
    assert sum(split["subtask_bytes"]) == sum(groups["bytes"]) > 0
    # Each batch's state entries written, as the plain-Python count of its input says;
    # with RocksDB, entries held are not counted and its memory is.
    batches = [b for b in report["batches"] if b["records_in"]]
    expected = state_per_batch(example.input_dir, PARTITIONS, BATCH_SIZE)
    assert [b["state_rows_written"] for b in batches] == [written for written, _ in expected]
    assert all(b["state_counted"] and b["state_rows_removed"] == 0 for b in batches)
    assert all(b["state_rows"] is None and b["state_memory_bytes"] > 0 for b in batches)
    page = tmp_path / "report.html"
    status, _, err = cli(capsys, example.storage, "report", example.job_dir, "-o", str(page))
    assert status == 0, err
    shown = figures(page.read_text())
    for plot in ("checkpoint-duration", "checkpoint-size", f"key-groups-{OPERATOR_ID}"):
        assert marks(shown[plot]) > 0, plot
    assert marks(shown["batch-state"]) == 2 * len(report["batches"])  # no timers


def test_savepoint_and_rescale_script_refuses_a_savepoint_off_the_jobs_storage(
    tmp_path: Path,
) -> None:
    """``--to`` a local directory for a job on S3: the restarted job would read its
    savepoint with the job's storage, where it is not; one error before anything runs."""
    result = subprocess.run(
        [str(REPO / "scripts/savepoint-and-rescale.sh"), "s3://bucket/ckpt/job", "-p", "3"]
        + ["--to", str(tmp_path / "sp")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "is not on the job's storage (s3://bucket/ckpt/job)" in result.stderr
    assert "give a s3:// directory" in result.stderr
    assert not (tmp_path / "sp").exists()
