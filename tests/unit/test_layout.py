"""The checkpoint directory layout: paths built, parsed back, and ids validated."""

from __future__ import annotations

import pytest

from statebackend.checkpoint.layout import (
    JobLayout,
    checkpoint_id_of,
    checkpoint_ids,
    join,
    metadata_path,
    parse_ack_name,
    savepoint_id_of,
    validate_id,
)
from statebackend.errors import ConfigurationError


@pytest.fixture
def layout() -> JobLayout:
    return JobLayout("s3://bucket/checkpoints", "job-1")


def test_paths_follow_the_design_layout(layout: JobLayout) -> None:
    assert layout.job_dir == "s3://bucket/checkpoints/job-1"
    assert layout.checkpoint_path(7) == "s3://bucket/checkpoints/job-1/chk-7"
    assert layout.metadata_path(7) == "s3://bucket/checkpoints/job-1/chk-7/_metadata"
    assert layout.exclusive_path(7, "op.0.sst") == "s3://bucket/checkpoints/job-1/chk-7/op.0.sst"
    assert layout.shared_dir == "s3://bucket/checkpoints/job-1/shared"
    assert layout.shared_path("000012.sst") == "s3://bucket/checkpoints/job-1/shared/000012.sst"
    assert layout.acks_dir(7) == "s3://bucket/checkpoints/job-1/chk-7/acks"
    assert layout.ack_path(7, "count-words", 3) == (
        "s3://bucket/checkpoints/job-1/chk-7/acks/count-words-3.json"
    )
    assert layout.savepoints_dir == "s3://bucket/checkpoints/job-1/savepoints"
    assert layout.savepoint_path(7, "abc") == (
        "s3://bucket/checkpoints/job-1/savepoints/savepoint-7-abc"
    )


def test_savepoint_suffix_is_random_unless_given(layout: JobLayout) -> None:
    first, second = layout.savepoint_path(3), layout.savepoint_path(3)
    assert first != second
    assert savepoint_id_of(first) == savepoint_id_of(second) == 3


@pytest.mark.parametrize(
    ("directory", "expected"),
    [
        ("s3://bucket/", "s3://bucket/job"),
        ("s3://bucket", "s3://bucket/job"),
        ("file:///", "file:///job"),
        ("/tmp/cp", "/tmp/cp/job"),
        ("relative", "relative/job"),
    ],
)
def test_job_dir_joins_with_exactly_one_slash(directory: str, expected: str) -> None:
    assert JobLayout(directory, "job").job_dir == expected


def test_metadata_path_of_any_directory() -> None:
    assert metadata_path("s3://b/my-savepoint/") == "s3://b/my-savepoint/_metadata"
    assert join("memory://x", "a", "b") == "memory://x/a/b"


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("chk-0", 0),
        ("chk-12", 12),
        ("s3://b/job/chk-12", 12),
        ("/tmp/job/chk-12/", 12),
        ("chk-012", None),
        ("chk-", None),
        ("chk--1", None),
        ("chk-1x", None),
        ("shared", None),
        ("s3://b/job/chk-12/_metadata", None),
    ],
)
def test_checkpoint_id_of(path: str, expected: int | None) -> None:
    assert checkpoint_id_of(path) == expected


def test_checkpoint_ids_of_a_listing_are_sorted_numerically() -> None:
    names = ["chk-10", "shared", "chk-9", "savepoints", "chk-2", "_metadata.tmp"]
    assert checkpoint_ids(names) == [2, 9, 10]


def test_savepoint_id_of() -> None:
    assert savepoint_id_of("s3://b/job/savepoints/savepoint-4-a1b2c3") == 4
    assert savepoint_id_of("savepoint-4") is None
    assert savepoint_id_of("chk-4") is None


def test_ack_names_round_trip_even_with_dashes_in_the_operator_id(layout: JobLayout) -> None:
    for operator, subtask in [("op", 0), ("count-words-2", 11), ("a.b_c", 5)]:
        assert parse_ack_name(layout.ack_path(1, operator, subtask)) == (operator, subtask)
    assert parse_ack_name("op.json") is None
    assert parse_ack_name("op-1.txt") is None
    assert parse_ack_name("op-01.json") is None


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "a b", "ü", "job:1", 7])
def test_invalid_job_ids_are_rejected_by_name(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="job id") as info:
        JobLayout("s3://b", bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


def test_invalid_operator_ids_and_numbers_are_rejected(layout: JobLayout) -> None:
    with pytest.raises(ConfigurationError, match="operator id 'a/b'"):
        layout.ack_path(1, "a/b", 0)
    with pytest.raises(ConfigurationError, match="subtask index -1"):
        layout.ack_path(1, "op", -1)
    with pytest.raises(ConfigurationError, match="checkpoint id -3"):
        layout.checkpoint_path(-3)
    with pytest.raises(ConfigurationError, match="checkpoint id True"):
        layout.checkpoint_path(True)
    with pytest.raises(ConfigurationError, match="file name '../x'"):
        layout.shared_path("../x")


def test_reserved_names_are_not_exclusive_files(layout: JobLayout) -> None:
    for name in ("_metadata", "acks"):
        with pytest.raises(ConfigurationError, match="reserved"):
            layout.exclusive_path(1, name)


def test_empty_checkpoint_dir_is_rejected() -> None:
    with pytest.raises(ConfigurationError, match="checkpoint directory"):
        JobLayout("", "job")


def test_validate_id_returns_the_id() -> None:
    assert validate_id("job_1.v2-x", "job id") == "job_1.v2-x"
