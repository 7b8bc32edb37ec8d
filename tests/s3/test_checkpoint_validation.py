"""A checkpoint's location and ``_metadata`` are checked before anything is restored,
on file:// and s3://: a URL with ``//`` in its path restores, and a ``_metadata`` that
lost a subtask, repeats one, leaves key groups uncovered or holds a malformed handle is
refused by restore, ``verify`` and every command, naming the file and the fault.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from statebackend.checkpoint.layout import metadata_path
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.checksums import DOCUMENT_CHECKSUM
from statebackend.errors import CheckpointCorruptedError, CheckpointError
from tests.conftest import Storage, raw_fs
from tests.s3.test_checkpoint_storage import (
    OPERATOR,
    Job,
    P,
    assert_restores,
    new_job,
    restore_all,
)
from tests.s3.test_cli import cli


@pytest.fixture
def job(checkpoint_url: Storage) -> Iterator[Job]:
    created = new_job(checkpoint_url)
    yield created
    created.close()


def test_a_url_with_double_slashes_restores(checkpoint_url: Storage) -> None:
    """Defect 6: ``<dir>/team//ckpts`` completed checkpoints that restore said "missing"."""
    location = Storage(f"{checkpoint_url.url}/team//ckpts/", checkpoint_url.storage_options)
    job = new_job(location)
    try:
        first, _ = job.checkpoint()
        second, directory = job.checkpoint()
        assert "//" not in directory.split("://", 1)[1]
        assert_restores(job, first)
        assert_restores(job, second)
        # A second run given the same URL, spelled either way, finds and restores them.
        for url in (location.url, f"{checkpoint_url.url}/team/ckpts"):
            again = CheckpointStorage(url, "job", storage_options=location.storage_options)
            assert again.completed_checkpoint_ids() == [first, second]
            assert again.resolve(f"{url}/job/chk-{second}/_metadata") == directory
            keyed, _ = restore_all(again.fs, again.resolve(second))
            assert keyed == job.models[second]
            again.close()
    finally:
        job.close()


def test_the_cli_takes_a_url_with_double_slashes(
    checkpoint_url: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    location = Storage(f"{checkpoint_url.url}//team//ckpts", checkpoint_url.storage_options)
    job = new_job(location)
    try:
        checkpoint_id, _ = job.checkpoint()
        spelled = f"{location.url}/job//chk-{checkpoint_id}/"
        status, out, err = cli(capsys, location, "verify", spelled)
        assert status == 0, err
        status, out, err = cli(
            capsys, location, "read", spelled, "--operator", OPERATOR, "--state", "count"
        )
        assert status == 0, err
        counts = {r["key"]: r["value"] for r in map(json.loads, out.splitlines())}
        assert counts == {k: c for k, (c, _) in job.models[checkpoint_id].items()}
        status, out, err = cli(capsys, location, "list", f"{location.url}/job/", "--json")
        assert status == 0, err
        (listed,) = json.loads(out)
        assert [c["checkpoint_id"] for c in listed["checkpoints"]] == [checkpoint_id]
    finally:
        job.close()


Document = dict[str, Any]


def _subtasks(document: Document) -> list[Document]:
    subtasks: list[Document] = document["operators"][OPERATOR]["subtasks"]
    return subtasks


def _drop_subtask(document: Document) -> None:
    del _subtasks(document)[1]


def _repeat_subtask(document: Document) -> None:
    _subtasks(document)[1] = _subtasks(document)[0]


def _more_parallelism(document: Document) -> None:
    document["operators"][OPERATOR]["parallelism"] = 3


def _key_group_gap(document: Document) -> None:
    keyed = _subtasks(document)[1]["keyed"]
    keyed["key_group_range"][0] += 1
    keyed["key_groups"] = [g for g in keyed["key_groups"] if g[0] >= keyed["key_group_range"][0]]


def _overlap(document: Document) -> None:
    _subtasks(document)[1]["keyed"]["key_group_range"][0] -= 1


def _path_outside(document: Document) -> None:
    _subtasks(document)[0]["keyed"]["path"] = "../../../../etc/passwd"


def _absolute_path(document: Document) -> None:
    _subtasks(document)[0]["keyed"]["path"] = "/etc/passwd"


def _negative_size(document: Document) -> None:
    _subtasks(document)[0]["keyed"]["size"] = -1


def _bad_checksum(document: Document) -> None:
    _subtasks(document)[0]["keyed"]["checksum"] = "crc32:xyz"


def _index_beyond_file(document: Document) -> None:
    keyed = _subtasks(document)[0]["keyed"]
    keyed["key_groups"][-1][2] += keyed["size"]


def _span_beyond_blob(document: Document) -> None:
    state = _subtasks(document)[0]["operator_state"]
    state["states"]["offsets"]["elements"][0][0] = state["size"]


def _index_length_digit(document: Document) -> None:
    """One digit of a key group's length changed, the checksum kept: JSON still valid."""
    _subtasks(document)[0]["keyed"]["key_groups"][0][2] -= 1


def _version_digit(document: Document) -> None:
    """The format version changed, the checksum kept: damage, not a newer format."""
    document["format_version"] = 3


def _key_serializer_type(document: Document) -> None:
    _subtasks(document)[0]["keyed"]["key_serializer"] = 1.5


def _state_name_type(document: Document) -> None:
    _subtasks(document)[0]["keyed"]["states"][0]["name"] = {}


MUTATIONS: dict[str, tuple[Callable[[Document], None], str]] = {
    "dropped subtask": (_drop_subtask, "has subtasks [0], but parallelism 2 needs each of 0..1"),
    "repeated subtask": (_repeat_subtask, "has subtasks [0, 0]"),
    "parallelism": (_more_parallelism, "parallelism 3 needs each of 0..2 once"),
    "key-group gap": (_key_group_gap, "do not cover 0..127 exactly"),
    "key-group overlap": (_overlap, "do not cover 0..127 exactly"),
    "path outside": (_path_outside, "leads outside the checkpoint"),
    "absolute path": (_absolute_path, "is not relative to the checkpoint directory"),
    "negative size": (_negative_size, "negative size -1"),
    "bad checksum": (_bad_checksum, "malformed checksum 'crc32:xyz'"),
    "index beyond the file": (_index_beyond_file, "index entry of key group"),
    "span beyond the blob": (_span_beyond_blob, "lies outside its"),
    "index length digit": (_index_length_digit, "does not match its checksum"),
    "version digit": (_version_digit, "does not match its checksum"),
    "key serializer type": (_key_serializer_type, "1.5 is no serializer config"),
    "state name type": (_state_name_type, "state name {} is not a string"),
}
CHECKSUMMED = {"index length digit", "version digit"}
"""Faults left with the document's checksum; the others are structural faults checked in a
document without one (as a release before the checksum wrote it, or a hand edit)."""


@pytest.mark.parametrize("fault", sorted(MUTATIONS))
def test_invalid_metadata_is_refused_everywhere(
    job: Job, fault: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect 8: a ``_metadata`` that lost a subtask restored half the keys silently; a
    changed digit of an index entry went unnoticed by ``verify``."""
    mutate, reason = MUTATIONS[fault]
    checkpoint_id, directory = job.checkpoint()
    assert_restores(job, checkpoint_id)
    path = metadata_path(directory)
    fs = raw_fs(job.location)
    document = json.loads(fs.cat_file(path))
    if fault not in CHECKSUMMED:
        del document[DOCUMENT_CHECKSUM]
    mutate(document)
    fs.pipe_file(path, json.dumps(document).encode())

    with pytest.raises(CheckpointCorruptedError) as caught:
        job.storage.load(checkpoint_id)
    assert path in str(caught.value) and reason in str(caught.value)
    with pytest.raises(CheckpointCorruptedError, match=re.escape(reason)):
        restore_all(job.storage.fs, directory)
    for argv in (
        ("verify", directory),
        ("inspect", directory),
        ("plan", directory, "-p", "3"),
        ("read", directory, "--operator", OPERATOR, "--state", "count"),
        ("savepoint", "create", "--from", directory, "--to", f"{job.location.url}/sp"),
    ):
        status, out, err = cli(capsys, job.location, *argv)
        assert status == 1 and out == "", (argv, out, err)
        assert err.count("\n") == 1 and path in err and reason in err, (argv, err)
    status, out, _ = cli(capsys, job.location, "list", job.storage.layout.job_dir)
    assert status == 0 and "unreadable" in out and reason in out


def write_foreign_ack(job: Job, checkpoint_id: int, keyed_path: str) -> None:
    """Write, beside subtask 0's ack of pending checkpoint N, a copy from another run whose
    keyed handle names ``keyed_path`` (the coordinator deletes the files of such acks once
    N completed)."""
    evil = job.storage.read_acks(checkpoint_id)[0].to_json()
    evil["run"] = "another-run"
    evil["keyed"]["path"] = keyed_path
    path = job.storage.layout.ack_path(checkpoint_id, OPERATOR, 0, "evil")
    raw_fs(job.location).pipe_file(path, json.dumps(evil).encode())


def test_malformed_acks_are_ignored_and_their_files_never_deleted(job: Job) -> None:
    """Acknowledgements are written by executors: one that is no ack, and one naming a
    file outside the checkpoint (``../../victim``, from another run, so the coordinator
    deletes its files once the checkpoint completed), are left out with a warning. The
    checkpoint completes from the good acks and restores; the file outside is kept."""
    job.checkpoint()
    victim = f"{job.location.url.rstrip('/')}/victim"
    raw = raw_fs(job.location)
    raw.pipe_file(victim, b"not the job's")
    job.process()
    checkpoint_id = job.coordinator.trigger({OPERATOR: P})
    job.snapshot_and_ack(checkpoint_id)
    write_foreign_ack(job, checkpoint_id, "../../victim")
    layout = job.storage.layout
    raw.pipe_file(layout.ack_path(checkpoint_id, OPERATOR, 1, "junk"), b'["not", "an ack"]')
    job.remember(checkpoint_id)
    assert job.coordinator.poll(checkpoint_id) is not None
    assert raw.cat_file(victim) == b"not the job's"
    assert_restores(job, checkpoint_id)


def _infinite_id(document: Document) -> None:
    document["checkpoint_id"] = float("inf")  # JSON's Infinity, which json.loads takes


def _huge_timestamp(document: Document) -> None:
    document["completed_at"] = 10**400


def _nan_timestamp(document: Document) -> None:
    document["triggered_at"] = float("nan")  # JSON's NaN, which json.loads takes


def _negative_id(document: Document) -> None:
    document["checkpoint_id"] = -1


def _empty_key_group_range(document: Document) -> None:
    _subtasks(document)[0]["keyed"]["key_group_range"] = []


def _unknown_handle_type(document: Document) -> None:
    _subtasks(document)[0]["keyed"]["type"] = "keyed-other"


MISSHAPEN: dict[str, Callable[[Document], None]] = {
    "infinite id": _infinite_id,
    "huge timestamp": _huge_timestamp,
    "NaN timestamp": _nan_timestamp,
    "negative id": _negative_id,
    "empty key-group range": _empty_key_group_range,
    "unknown handle type": _unknown_handle_type,
}


@pytest.mark.parametrize("fault", sorted(MISSHAPEN))
def test_misshapen_metadata_is_one_corruption_error_naming_it(
    job: Job, fault: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A number no integer or float holds, a range without bounds, an unknown handle type
    came out as a raw OverflowError or IndexError, or as an error not naming the file."""
    checkpoint_id, directory = job.checkpoint()
    path = metadata_path(directory)
    fs = raw_fs(job.location)
    document = json.loads(fs.cat_file(path))
    del document[DOCUMENT_CHECKSUM]
    MISSHAPEN[fault](document)
    fs.pipe_file(path, json.dumps(document).encode())

    with pytest.raises(CheckpointCorruptedError, match=re.escape(path)):
        job.storage.load(checkpoint_id)
    status, out, err = cli(capsys, job.location, "inspect", directory)
    assert status == 1 and out == "" and err.count("\n") == 1 and path in err, err


def test_misshapen_acks_are_ignored(job: Job) -> None:
    """An ack whose key-group range has no bounds or whose subtask is infinite raised a
    raw IndexError or OverflowError where the coordinator and gc read acks."""
    job.checkpoint()
    job.process()
    checkpoint_id = job.coordinator.trigger({OPERATOR: P})
    job.snapshot_and_ack(checkpoint_id, range(1))
    good = job.storage.read_acks(checkpoint_id)[0].to_json()
    raw = raw_fs(job.location)
    layout = job.storage.layout
    for n, mutate in enumerate((_empty_range_ack, _infinite_subtask_ack)):
        evil = json.loads(json.dumps(good))
        mutate(evil)
        raw.pipe_file(
            layout.ack_path(checkpoint_id, OPERATOR, 1, f"evil{n}"), json.dumps(evil).encode()
        )
    assert [ack.to_json() for ack in job.storage.read_acks(checkpoint_id)] == [good]


def _empty_range_ack(ack: Document) -> None:
    ack["keyed"]["key_group_range"] = []


def _infinite_subtask_ack(ack: Document) -> None:
    ack["subtask"] = float("inf")


def test_an_ack_naming_the_checkpoints_metadata_is_ignored(job: Job) -> None:
    """An ack of another run whose handle named ``_metadata`` made the coordinator, which
    deletes the files of the acks it did not take once the checkpoint completed, delete
    the ``_metadata`` it had just written: the completed checkpoint was gone."""
    job.checkpoint()
    job.process()
    checkpoint_id = job.coordinator.trigger({OPERATOR: P})
    job.snapshot_and_ack(checkpoint_id)
    write_foreign_ack(job, checkpoint_id, "_metadata")
    job.remember(checkpoint_id)
    assert job.coordinator.poll(checkpoint_id) is not None
    job.coordinator.trigger({OPERATOR: P})  # the work after the completion is done by now
    assert job.storage.completed_checkpoint_ids()[-1] == checkpoint_id
    assert job.storage.read_acks(checkpoint_id + 1) == []
    assert_restores(job, checkpoint_id)


def test_acks_that_make_an_invalid_checkpoint_abort_it(job: Job) -> None:
    """An ack of the coordinator's own run (read first: its file name sorts first) whose
    key-group range overlaps another subtask's: the coordinator wrote a ``_metadata`` that
    every load refuses, and as the newest completed checkpoint it replaced the restorable
    ones (a restore of the latest failed, retention discarded the older ones)."""
    first, _ = job.checkpoint()
    job.process()
    checkpoint_id = job.coordinator.trigger({OPERATOR: P})
    job.snapshot_and_ack(checkpoint_id, range(1))
    copy = job.storage.read_acks(checkpoint_id)[0].to_json()
    copy["subtask"] = 1  # subtask 0's handles, key groups 0..63, as subtask 1's
    layout = job.storage.layout
    path = layout.ack_path(checkpoint_id, OPERATOR, 1, "early")
    raw_fs(job.location).pipe_file(path, json.dumps(copy).encode())
    job.snapshot_and_ack(checkpoint_id, range(1, P))
    with pytest.raises(CheckpointError, match="do not cover 0..127 exactly"):
        job.coordinator.poll(checkpoint_id)
    assert job.storage.completed_checkpoint_ids() == [first]
    assert checkpoint_id not in job.coordinator.pending
    assert_restores(job, first)


@pytest.mark.parametrize("content", [b"12x", b"9" * 5000], ids=["not a number", "5000 digits"])
def test_a_misshapen_checkpoint_id_mark_is_one_corruption_error(job: Job, content: bytes) -> None:
    """``_checkpoint_id`` of 5000 digits raised a raw ValueError (Python's 4300-digit
    limit) from every trigger, where other damage is a CheckpointCorruptedError naming it."""
    job.checkpoint()
    path = job.storage.layout.checkpoint_id_path
    raw_fs(job.location).pipe_file(path, content)
    with pytest.raises(CheckpointCorruptedError, match=re.escape(path)):
        job.coordinator.trigger({OPERATOR: P})


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"run": ' + b"[" * 100_000])
def test_a_misshapen_leader_claim_is_one_corruption_error(job: Job, content: bytes) -> None:
    """The newest ``_leader/epoch-<E>.json`` that is no claim raised a raw JSONDecodeError,
    TypeError or RecursionError from every trigger, naming no file."""
    job.checkpoint()
    epoch = max(job.storage.leader_epochs()) + 1
    path = job.storage.layout.leader_path(epoch)
    raw_fs(job.location).pipe_file(path, content)
    with pytest.raises(CheckpointCorruptedError, match=re.escape(path)):
        job.coordinator.trigger({OPERATOR: P})
