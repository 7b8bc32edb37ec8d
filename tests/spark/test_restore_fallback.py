"""Restoring "latest" when the newest completed checkpoint cannot be read: the run falls
back to the previous retained checkpoint, says so, and ends with exact state; an explicit
restore point that cannot be read is one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statebackend.errors import CheckpointUnreadableError
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.example import (
    checkpointed_totals,
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
    user_totals_job,
)
from statebackend.spark.runner import RunSummary

JOB = "fallback"


def _run(spark: SparkSession, tmp_path: Path, parallelism: int, restore: str) -> RunSummary:
    conf = StateBackendConf(
        checkpoint_dir=tmp_path.joinpath("ckpt").as_uri(), local_dir=str(tmp_path / "local")
    )
    return user_totals_job(
        spark,
        job_id=JOB,
        input_dir=tmp_path / "input",
        parallelism=parallelism,
        conf=conf,
        batch_size=100,
        checkpoint_every=1,
        restore=restore,
    ).run()


def _completed(tmp_path: Path) -> list[Path]:
    directories = (tmp_path / "ckpt" / JOB).glob("chk-*")
    return sorted(
        (d for d in directories if (d / "_metadata").exists()), key=lambda d: int(d.name[4:])
    )


def _damage(path: Path) -> None:
    """Flip bytes in the middle of ``path``, keeping its size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def _first_run(spark: SparkSession, tmp_path: Path) -> tuple[Path, Path]:
    generate_events(tmp_path / "input", 800, 40, 4, seed=1)
    _run(spark, tmp_path, 2, "latest")
    *_, previous, latest = _completed(tmp_path)
    generate_events(tmp_path / "input", 400, 40, 4, seed=2)
    return previous, latest


def _check_state(spark: SparkSession, tmp_path: Path, summary: RunSummary) -> None:
    assert summary.last_checkpoint is not None
    expected = expected_totals(read_events(tmp_path / "input"))
    assert compare_totals(expected, checkpointed_totals(spark, summary.last_checkpoint)) == []


def test_a_damaged_state_file_falls_back_to_the_previous_checkpoint(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    previous, latest = _first_run(spark_local, tmp_path)
    _damage(next(latest.glob("user-totals-0-*keyed*")))

    summary = _run(spark_local, tmp_path, 3, "latest")

    assert len(summary.fallbacks) == 1
    assert summary.fallbacks[0].startswith(f"{latest.as_uri()} -> {previous.as_uri()}")
    assert "cannot restore from" in summary.fallbacks[0]
    assert summary.restored_from == previous.as_uri()
    assert "fell back from unreadable" in summary.describe()
    _check_state(spark_local, tmp_path, summary)


def test_unreadable_metadata_falls_back_to_the_previous_checkpoint(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    previous, latest = _first_run(spark_local, tmp_path)
    (latest / "_metadata").write_bytes(b'{"format_version": ')

    summary = _run(spark_local, tmp_path, 1, "latest")

    assert [f.split(" (")[0] for f in summary.fallbacks] == [
        f"{latest.as_uri()} -> {previous.as_uri()}"
    ]
    assert summary.restored_from == previous.as_uri()
    _check_state(spark_local, tmp_path, summary)


def test_an_unreadable_explicit_restore_point_is_one_clear_error(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    _, latest = _first_run(spark_local, tmp_path)
    damaged = next(latest.glob("user-totals-1-*keyed*"))
    _damage(damaged)

    with pytest.raises(CheckpointUnreadableError, match="cannot restore from .*checksum mismatch"):
        _run(spark_local, tmp_path, 2, latest.as_uri())
    assert (latest / "_metadata").exists()
