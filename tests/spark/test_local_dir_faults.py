"""An executor's local state directory that cannot be used (not writable, or its disk
full) stops the run with one clear error naming it; the checkpoints stay intact, and a
rerun with a usable directory ends with exact state."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statebackend.checkpoint.layout import METRICS_DIR
from statebackend.errors import LocalStateError
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
from statebackend.tools.location import open_checkpoint
from statebackend.tools.verify import verify_checkpoint

JOB = "local-dir"


def _run(spark: SparkSession, tmp_path: Path, local_dir: Path, parallelism: int) -> RunSummary:
    conf = StateBackendConf(
        checkpoint_dir=tmp_path.joinpath("ckpt").as_uri(), local_dir=str(local_dir)
    )
    return user_totals_job(
        spark,
        job_id=JOB,
        input_dir=tmp_path / "input",
        parallelism=parallelism,
        conf=conf,
        batch_size=100,
        checkpoint_every=2,
    ).run()


def _checkpoints(tmp_path: Path) -> dict[str, bytes]:
    """Every checkpoint file and its content (not the metrics history: a failed run
    records its failure there)."""
    root = tmp_path / "ckpt" / JOB
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).parts[0] != METRICS_DIR
    }


def _fails_clearly_then_recovers(
    spark: SparkSession, tmp_path: Path, broken: Path, match: str
) -> None:
    generate_events(tmp_path / "input", 600, 30, 4, seed=1)
    first = _run(spark, tmp_path, tmp_path / "local", 2)
    assert first.last_checkpoint is not None
    generate_events(tmp_path / "input", 300, 30, 4, seed=2)
    before = _checkpoints(tmp_path)

    with pytest.raises(LocalStateError, match=match) as failure:
        _run(spark, tmp_path, broken, 3)

    message = str(failure.value)
    assert "\n" not in message and "spark.statebackend.local.dir" in message
    assert _checkpoints(tmp_path) == before
    assert verify_checkpoint(open_checkpoint(first.last_checkpoint)) == []
    rerun = _run(spark, tmp_path, tmp_path / "local-2", 3)
    assert rerun.restored_from == first.last_checkpoint and rerun.failures == 0
    assert rerun.last_checkpoint is not None
    expected = expected_totals(read_events(tmp_path / "input"))
    assert compare_totals(expected, checkpointed_totals(spark, rerun.last_checkpoint)) == []


def test_an_unwritable_local_dir_is_one_clear_error(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("local.dir must be a directory")
    broken = not_a_directory / "state"

    _fails_clearly_then_recovers(
        spark_local, tmp_path, broken, f"local state directory {broken}/{JOB}/user-totals .*"
    )


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs filled to the last byte (needs the right to mount: root)."""
    mount_point = tmp_path / "full"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with (mount_point / "filler").open("wb") as filler:
            try:
                while True:
                    filler.write(bytes(1 << 16))
                    filler.flush()
            except OSError:
                pass
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_local_disk_is_one_clear_error(
    spark_local: SparkSession, tmp_path: Path, full_disk: Path
) -> None:
    _fails_clearly_then_recovers(
        spark_local, tmp_path, full_disk / "state", "unusable \\(No space left on device\\)"
    )
