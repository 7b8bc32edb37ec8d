"""A restarted ``transform_with_state`` query keeps its ``restore_from`` in its code: the
same savepoint directory, however it is spelled, is not "another location"
(``streaming_commit.check_same_query``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import ConfigurationError
from statebackend.spark.streaming_commit import QUERY_PROPERTY, RESTORED_FROM, check_same_query
from statebackend.spark.streaming_restore import restore_location


def _savepoint(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "_metadata").write_text("{}")  # restore_location only looks for it
    return directory


def test_restore_from_spelled_another_way_on_restart_is_the_same_location(
    tmp_path: Path,
) -> None:
    """The first start named the savepoint as a local path; a restart naming it as a
    ``file://`` URL (or with ``//`` or a trailing ``/``) resumes, as the README says a
    restart ignores ``restore_from``. Another savepoint is still refused."""
    savepoint = _savepoint(tmp_path / "sp")
    other = _savepoint(tmp_path / "other")
    storage = CheckpointStorage(str(tmp_path / "state"), "job")
    query = {"time_mode": "None", "output_mode": "Update", "key": [["user", "string"]]}
    started = {**query, RESTORED_FROM: restore_location(storage, str(savepoint))}
    manifest = ChangelogStorage(storage).commit(
        0, {}, max_parallelism=8, properties={QUERY_PROPERTY: started}
    )
    for spelling in (savepoint.as_uri(), f"{tmp_path}//sp/", str(savepoint)):
        restart = {**query, RESTORED_FROM: restore_location(storage, spelling)}
        check_same_query(manifest, restart, "job")  # no error
    moved = {**query, RESTORED_FROM: restore_location(storage, other.as_uri())}
    with pytest.raises(ConfigurationError, match="applies to a job's first start only"):
        check_same_query(manifest, moved, "job")
