"""Failure injection: a Python worker killed mid-batch, and one that dies with an upload in
the background. State ends exactly-once. (The driver killed at random moments:
``test_runtime_changelog.py``.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from statebackend.spark import tasks
from statebackend.spark.api import KeyedContext, KeyedFunction
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.example import (
    KEY_FIELD,
    OPERATOR_ID,
    UserTotals,
    checkpointed_totals,
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
)
from statebackend.spark.runner import StatefulJob
from statebackend.spark.source import LogSource


def _killing_function(marker: Path, batch_id: int) -> KeyedFunction:
    """UserTotals that SIGKILLs its Python worker once, in batch ``batch_id``, after it
    has changed some state (nested so that Spark ships it by value)."""

    class KillOnce(UserTotals):
        def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Any:
            rows = list(super().process(key, values, ctx))
            if ctx.batch_id == batch_id and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return rows

    return KillOnce()


def test_python_worker_killed_mid_batch(spark_local: SparkSession, tmp_path: Path) -> None:
    generate_events(tmp_path / "input", 1200, 50, 4, 11)
    marker = tmp_path / "killed"
    summary = StatefulJob(
        spark_local,
        job_id="worker-kill",
        source=LogSource(str(tmp_path / "input")),
        operator_id=OPERATOR_ID,
        key_by=KEY_FIELD,
        function=_killing_function(marker, batch_id=3),
        parallelism=2,
        batch_size=50,
        checkpoint_every=2,
        conf=StateBackendConf(
            checkpoint_dir=(tmp_path / "checkpoints").as_uri(), local_dir=str(tmp_path / "local")
        ),
    ).run()
    assert marker.exists()
    assert summary.failures == 1 and summary.rollbacks == 0
    # The failed batch was retried: its subtasks rebuilt from the newest manifest.
    assert any(b > 0 for b in summary.rebuilt_subtasks[1:])
    expected = expected_totals(read_events(tmp_path / "input"))
    assert summary.last_checkpoint is not None
    assert compare_totals(expected, checkpointed_totals(spark_local, summary.last_checkpoint)) == []


def _dying_uploader(marker: Path, batch_id: int) -> KeyedFunction:
    """UserTotals whose Python worker, from batch ``batch_id`` on, dies once while its
    next checkpoint upload is in the background: the upload's ack never gets written."""

    class DieAfterTask(UserTotals):
        def open(self, ctx: KeyedContext) -> None:
            super().open(ctx)
            if ctx.batch_id == batch_id and not marker.exists():
                marker.touch()

                def die(storage: Any, checkpoint_id: int, ack: Any) -> None:  # not acking
                    time.sleep(1.0)  # long after the task has returned its result
                    os.kill(os.getpid(), signal.SIGKILL)

                tasks._acknowledge = die

    return DieAfterTask()


def test_dead_uploader_aborts_checkpoint_early(spark_local: SparkSession, tmp_path: Path) -> None:
    """A worker dying with an upload in flight makes the driver abort that checkpoint after
    the upload stall timeout (3 s here), not after checkpoint.timeout (600 s); the job goes
    on and ends exactly-once."""
    generate_events(tmp_path / "input", 600, 30, 2, 13)
    marker = tmp_path / "died"
    started = time.monotonic()
    summary = StatefulJob(
        spark_local,
        job_id="dead-uploader",
        source=LogSource(str(tmp_path / "input")),
        operator_id=OPERATOR_ID,
        key_by=KEY_FIELD,
        # Batch 0 always takes a checkpoint (none is pending before it); later batches
        # find that one pending and take none until it is aborted.
        function=_dying_uploader(marker, batch_id=0),
        parallelism=1,
        batch_size=100,
        checkpoint_every=1,
        conf=StateBackendConf(
            checkpoint_dir=(tmp_path / "checkpoints").as_uri(),
            local_dir=str(tmp_path / "local"),
            upload_stall_seconds=3.0,
        ),
    ).run()
    assert marker.exists()
    assert summary.aborted == 1
    assert time.monotonic() - started < 120
    expected = expected_totals(read_events(tmp_path / "input"))
    assert summary.last_checkpoint is not None
    assert compare_totals(expected, checkpointed_totals(spark_local, summary.last_checkpoint)) == []
