"""Binding a Spark checkpointLocation to a state job (``streaming_commit.bind``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointError
from statebackend.spark.streaming_commit import SPARK_BINDING_FILE, bind


def test_a_first_start_that_cannot_write_the_job_side_leaves_the_location_unbound(
    tmp_path: Path,
) -> None:
    """The job's storage cannot be written (here its directory is under a file; on S3 a
    missing bucket): the start fails, and the checkpointLocation is not left bound to
    that job, so that a start with the storage corrected binds it."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    location = str(tmp_path / "spark")
    with pytest.raises(CheckpointError, match="could not write"):
        bind(CheckpointStorage((blocker / "ckpt").as_uri(), "job"), location, {})
    assert not (tmp_path / "spark" / SPARK_BINDING_FILE).exists()
    corrected = CheckpointStorage((tmp_path / "ckpt").as_uri(), "job")
    binding = bind(corrected, location, {})
    assert bind(corrected, location, {}) == binding
