"""Set-up shared by the Spark runtime tests: the example job (``spark.example``) run over
input appended before each run, and the check of a checkpoint's state against the
plain-Python totals of all the input."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from statebackend.spark import example
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.runner import RunSummary
from statebackend.spark.source import partition_path

SIGNING_KEY = "spark.statebackend.checkpoint.signing-key"


def lose_local_state(root: Path) -> None:
    """Delete the executor-local state under ``root`` as a lost host would, once every
    subtask's lock is free: a Python worker that outlives its task closes its RocksDB on
    a closer thread after the task (writing into the directory), holding the lock."""
    with ExitStack() as held:
        for lock in sorted(root.rglob("*.lock")):
            fd = os.open(lock, os.O_RDWR)
            held.callback(os.close, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        shutil.rmtree(root)


@contextmanager
def streaming_session(
    spark: SparkSession, tmp_path: Path, *pairs: tuple[str, str], local_dir: str | None = None
) -> Iterator[SparkSession]:
    """``spark`` set up for ``transform_with_state`` tests: our checkpoints in
    ``tmp_path/ours``, the local copies in ``local_dir`` (default ``tmp_path/local``), and
    the ``spark.statebackend.*`` pairs; afterwards every key set, and the signing key a
    test may have set, is unset."""
    conf = {
        "spark.statebackend.checkpoint.dir": (tmp_path / "ours").as_uri(),
        "spark.statebackend.local.dir": local_dir or str(tmp_path / "local"),
        **dict(pairs),
    }
    for key, value in conf.items():
        spark.conf.set(key, value)
    try:
        yield spark
    finally:
        for key in (*conf, SIGNING_KEY):
            spark.conf.unset(key)


def settings(tmp_path: Path, *pairs: tuple[str, str]) -> StateBackendConf:
    """A conf of ``spark.statebackend.*`` pairs, with the checkpoints in
    ``tmp_path/checkpoints`` unless the pairs name another directory."""
    default = ("spark.statebackend.checkpoint.dir", (tmp_path / "checkpoints").as_uri())
    return StateBackendConf.from_pairs([default, *pairs])


def run_user_totals(
    spark: SparkSession,
    tmp_path: Path,
    conf: StateBackendConf,
    *,
    job_id: str,
    parallelism: int,
    **options: Any,
) -> RunSummary:
    """One run of the example job over ``tmp_path/input`` (``options``: batch_size,
    checkpoint_every, output_dir, ...)."""
    return example.user_totals_job(
        spark,
        job_id=job_id,
        input_dir=tmp_path / "input",
        parallelism=parallelism,
        conf=conf,
        **options,
    ).run()


def rescale_runs(
    spark: SparkSession,
    tmp_path: Path,
    conf: StateBackendConf,
    parallelisms: Sequence[int],
    events: int,
    *,
    job_id: str,
    **options: Any,
) -> list[RunSummary]:
    """A run at each parallelism, ``events`` events of 40 users in 4 partitions (seed =
    the run's index) appended to ``tmp_path/input`` before each."""
    summaries = []
    for seed, parallelism in enumerate(parallelisms):
        example.generate_events(tmp_path / "input", events, 40, 4, seed)
        summaries.append(
            run_user_totals(
                spark, tmp_path, conf, job_id=job_id, parallelism=parallelism, **options
            )
        )
    return summaries


def assert_matches_python(
    spark: SparkSession,
    tmp_path: Path,
    checkpoint: str | None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """The example's state in ``checkpoint`` is what a plain-Python computation of all of
    ``tmp_path/input`` gives."""
    assert checkpoint is not None
    expected = example.expected_totals(example.read_events(tmp_path / "input"))
    actual = example.checkpointed_totals(spark, checkpoint, storage_options)
    assert example.compare_totals(expected, actual) == []


def state_per_batch(input_dir: Path, partitions: int, batch_size: int) -> list[tuple[int, int]]:
    """Per batch with input, the example job's state entries written and held after it,
    in plain Python: each batch reads the next ``batch_size`` lines of every partition;
    each user of a batch writes its count, total and recent list and one map entry per
    category of its events in the batch, and holds those three and one map entry per
    category it ever had."""
    lines = [
        partition_path(input_dir, p).read_text(encoding="utf-8").splitlines()
        for p in range(partitions)
    ]
    seen: dict[str, set[str]] = {}
    per_batch = []
    for start in range(0, max(map(len, lines)), batch_size):
        batch: dict[str, set[str]] = {}
        for partition in lines:
            for line in partition[start : start + batch_size]:
                event = json.loads(line)
                batch.setdefault(event["user"], set()).add(event["category"])
                seen.setdefault(event["user"], set()).add(event["category"])
        written = sum(3 + len(categories) for categories in batch.values())
        held = sum(3 + len(categories) for categories in seen.values())
        per_batch.append((written, held))
    return per_batch
