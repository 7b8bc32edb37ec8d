"""The example job with ``spark.statebackend.checkpoint.signing-key-file``: its checkpoints
are signed, it restores and rescales from them, and it refuses to restore a checkpoint
whose ``_metadata`` was changed or whose data file was changed, in local[2]."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statebackend.checkpoint.layout import metadata_path
from statebackend.checkpoint.signing import load_signing_key
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointCorruptedError
from statebackend.snapshot.handles import resolve_path
from statebackend.spark.example import generate_events
from statebackend.spark.runner import RunSummary
from tests.spark.jobs import assert_matches_python, run_user_totals, settings


def _run(spark: SparkSession, tmp_path: Path, parallelism: int) -> RunSummary:
    conf = settings(
        tmp_path,
        ("spark.statebackend.checkpoint.signing-key-file", str(tmp_path / "key")),
        ("spark.statebackend.local.dir", str(tmp_path / "local")),
        ("spark.statebackend.checkpoint.max-retries", "1"),
    )
    return run_user_totals(
        spark,
        tmp_path,
        conf,
        job_id="signed",
        parallelism=parallelism,
        batch_size=1000,
        checkpoint_every=2,
    )


def test_a_signed_job_restores_and_refuses_tampering(
    spark_local: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "key").write_text("a signing key of more than 16 bytes\n")
    generate_events(tmp_path / "input", 300, 30, 2, 1)
    _run(spark_local, tmp_path, 2)
    generate_events(tmp_path / "input", 300, 30, 2, 2)
    summary = _run(spark_local, tmp_path, 3)
    last = summary.last_checkpoint
    assert last is not None and summary.restored_bytes[0] > 0
    assert_matches_python(spark_local, tmp_path, last)
    document = json.loads(Path(last.removeprefix("file://"), "_metadata").read_bytes())
    assert document["signature"]["algorithm"] == "hmac-sha256"

    # A changed data file: the restoring subtask refuses it, naming it, before decoding
    # anything; the run falls back to the previous (signed, unchanged) checkpoint.
    key = load_signing_key(key_file=str(tmp_path / "key"))
    storage = CheckpointStorage((tmp_path / "checkpoints").as_uri(), "signed", signing_key=key)
    keyed = storage.load(last).operators["user-totals"].subtasks[0].keyed
    assert keyed is not None
    data_file = Path(resolve_path(last, keyed.files()[0].path).removeprefix("file://"))
    original = data_file.read_bytes()
    data_file.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    generate_events(tmp_path / "input", 50, 30, 2, 3)
    summary = _run(spark_local, tmp_path, 2)
    (fallback,) = summary.fallbacks
    assert fallback.startswith(f"{last} -> ") and "does not match the signed checkpoint" in fallback
    newest = summary.last_checkpoint
    assert newest is not None
    assert_matches_python(spark_local, tmp_path, newest)
    # Its batches were redone from the previous checkpoint: the changed one is deleted.
    assert not Path(last.removeprefix("file://")).exists()
    assert f"deleting checkpoint {last}: it holds batches after" in caplog.text

    # A changed _metadata: refused before anything is restored; the run falls back again.
    metadata_file = Path(metadata_path(newest).removeprefix("file://"))
    document = json.loads(metadata_file.read_bytes())
    document["properties"]["next_batch"] = 0
    metadata_file.write_text(json.dumps(document))
    with pytest.raises(CheckpointCorruptedError, match="signature does not match"):
        storage.load(newest)
    summary = _run(spark_local, tmp_path, 2)
    (fallback,) = summary.fallbacks
    assert fallback.startswith(f"{newest} -> ") and "signature does not match" in fallback
    # Deleted although its _metadata cannot be read: were the change undone, "latest"
    # would otherwise resume the batches this run redid.
    assert not Path(newest.removeprefix("file://")).exists()
    assert summary.last_checkpoint is not None
    assert_matches_python(spark_local, tmp_path, summary.last_checkpoint)
    storage.close()
