"""The changelog's part of the checkpoint directory layout: record and manifest paths."""

from __future__ import annotations

import pytest

from statebackend.checkpoint.layout import JobLayout, batch_ids
from statebackend.errors import ConfigurationError


def test_record_and_manifest_paths() -> None:
    layout = JobLayout("s3://bucket/checkpoints", "job-1")
    assert layout.changelog_dir == "s3://bucket/checkpoints/job-1/changelog"
    assert layout.manifests_dir == "s3://bucket/checkpoints/job-1/manifests"
    assert layout.batch_changelog_dir(12) == "s3://bucket/checkpoints/job-1/changelog/12"
    assert layout.changelog_path(12, "count-words", 3, "attempt-7") == (
        "s3://bucket/checkpoints/job-1/changelog/12/count-words-3-attempt-7"
    )
    assert layout.manifest_path(12) == "s3://bucket/checkpoints/job-1/manifests/12"


def test_batch_ids_of_a_listing_skip_temp_files_and_sort_numerically() -> None:
    names = ["10", "9", "0", "11.3f2a.tmp", "x", "010", "-1"]
    assert batch_ids(names) == [0, 9, 10]


@pytest.mark.parametrize(
    ("batch", "operator", "subtask", "attempt"),
    [
        (-1, "op", 0, "a"),
        (1, "o/p", 0, "a"),
        (1, "op", -2, "a"),
        (1, "op", 0, "a/b"),
        (1, "op", 0, ""),
    ],
)
def test_invalid_record_names_are_rejected(
    batch: int, operator: str, subtask: int, attempt: str
) -> None:
    with pytest.raises(ConfigurationError):
        JobLayout("/tmp/x", "job").changelog_path(batch, operator, subtask, attempt)
