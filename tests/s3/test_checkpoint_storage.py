"""Checkpoint storage and coordination on file:// and s3://: pending limits, numbering,
retention, timeouts, crash safety, self-contained savepoints, and bad input.

Every scenario runs a small real job (two subtasks of one operator with keyed and
operator state) and compares what a restore returns with a plain-Python model.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.checkpoint import metadata as metadata_module
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import CheckpointFileSystem, open_filesystem
from statebackend.checkpoint.layout import join
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.restore import (
    check_max_parallelism,
    check_operators,
    restore_keyed_state,
    restore_operator_state,
)
from statebackend.checkpoint.savepoints import copy_checkpoint
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata
from statebackend.cli import main as cli_main
from statebackend.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointUnreadableError,
    ConfigurationError,
    IncompatibleStateError,
)
from statebackend.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.snapshot.keyed_format import FullKeyedStateHandle, read_keyed_entries
from statebackend.state.descriptors import ListStateDescriptor, ValueStateDescriptor
from statebackend.state.interfaces import ListState, ValueState
from statebackend.tools.listing import summarize
from tests.conftest import S3Endpoint, Storage, raw_fs

M = 128
P = 2
OPERATOR = "counter"
COUNT = ValueStateDescriptor("count", IntSerializer())
HISTORY = ListStateDescriptor("history", IntSerializer())


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Job:
    """A two-subtask job writing checkpoints to one location, with its model.

    ``models[N]`` is the keyed state (key -> (count, history)) at checkpoint N and
    ``offsets[N]`` the split operator state per subtask at checkpoint N.
    """

    location: Storage
    storage: CheckpointStorage
    coordinator: CheckpointCoordinator
    clock: FakeClock
    backends: list[KeyedStateBackend]
    rng: random.Random = field(default_factory=lambda: random.Random(42))
    model: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    position: list[int] = field(default_factory=lambda: [0] * P)
    models: dict[int, dict[str, tuple[int, list[int]]]] = field(default_factory=dict)
    offsets: dict[int, list[list[int]]] = field(default_factory=dict)

    def process(self, records: int = 200) -> None:
        """Count ``records`` random records per key and remember them (last 3) in the list."""
        for _ in range(records):
            key = f"key-{self.rng.randrange(60)}"
            group = assign_to_key_group(key.encode(), M)
            subtask = compute_operator_index_for_key_group(M, P, group)
            backend = self.backends[subtask]
            backend.set_current_key(key)
            value = self.rng.randrange(1000)
            count = cast(ValueState, backend.get_state(COUNT))
            history = cast(ListState, backend.get_state(HISTORY))
            count.update((count.value() or 0) + 1)
            history.update([*history.get(), value][-3:])
            old_count, old_history = self.model.get(key, (0, []))
            self.model[key] = (old_count + 1, [*old_history, value][-3:])
            self.position[subtask] += 1

    def snapshot_and_ack(self, checkpoint_id: int, subtasks: range | None = None) -> None:
        """Snapshot the given subtasks (all by default) and write their acks."""
        for i in subtasks if subtasks is not None else range(P):
            target = self.storage.snapshot_target(checkpoint_id, OPERATOR, i)
            keyed = self.backends[i].snapshot(checkpoint_id, target)
            ops = OperatorStateBackend()
            ops.get_list_state("offsets", IntSerializer()).add_all(
                range(self.position[i] - 3, self.position[i])
            )
            operator = target.write_operator_snapshot(checkpoint_id, ops.sync_cut())
            self.storage.write_ack(
                checkpoint_id,
                SubtaskAck(
                    OPERATOR, i, P, keyed.result(), operator.result(), self.coordinator.run_id
                ),
            )

    def remember(self, checkpoint_id: int) -> None:
        """Record the model as the expected content of ``checkpoint_id``."""
        self.models[checkpoint_id] = {k: (c, list(h)) for k, (c, h) in self.model.items()}
        self.offsets[checkpoint_id] = [list(range(p - 3, p)) for p in self.position]

    def checkpoint(self, savepoint_dir: str | None = None) -> tuple[int, str]:
        """Process some records, then take and complete a checkpoint; (id, directory)."""
        self.process()
        checkpoint_id = self.coordinator.trigger({OPERATOR: P}, savepoint_dir=savepoint_dir)
        self.snapshot_and_ack(checkpoint_id)
        self.remember(checkpoint_id)
        directory = self.coordinator.poll(checkpoint_id)
        assert directory is not None
        return checkpoint_id, directory

    def close(self) -> None:
        """Dispose the backends and stop the transfer threads."""
        for backend in self.backends:
            backend.dispose()
        self.storage.close()


def new_job(location: Storage, **coordinator_options: Any) -> Job:
    """A job writing to ``location`` with a fake clock."""
    storage = CheckpointStorage(location.url, "job", storage_options=location.storage_options)
    clock = FakeClock()
    coordinator = CheckpointCoordinator(
        storage, max_parallelism=M, clock=clock, **coordinator_options
    )
    backends: list[KeyedStateBackend] = [
        HeapKeyedStateBackend(
            max_parallelism=M,
            key_group_range=compute_key_group_range_for_operator_index(M, P, i),
        )
        for i in range(P)
    ]
    return Job(location, storage, coordinator, clock, backends)


@pytest.fixture
def job(checkpoint_url: Storage) -> Iterator[Job]:
    """A fresh job on file:// and on s3://."""
    created = new_job(checkpoint_url)
    yield created
    created.close()


def restore_all(
    fs: CheckpointFileSystem, directory: str, new_parallelism: int = 3
) -> tuple[dict[str, tuple[int, list[int]]], list[int]]:
    """Restore the checkpoint or savepoint in ``directory`` at ``new_parallelism``:
    the keyed state as the model's dict, and all split offsets in subtask order."""
    metadata = load_metadata(fs, directory)
    keyed: dict[str, tuple[int, list[int]]] = {}
    offsets: list[int] = []
    for i in range(new_parallelism):
        backend = HeapKeyedStateBackend(
            max_parallelism=M,
            key_group_range=compute_key_group_range_for_operator_index(M, new_parallelism, i),
        )
        restore_keyed_state(backend, fs, directory, metadata, OPERATOR)
        count = cast(ValueState, backend.get_state(COUNT))
        history = cast(ListState, backend.get_state(HISTORY))
        for key in backend.keys("count"):
            backend.set_current_key(key)
            assert key not in keyed
            keyed[key] = (count.value(), history.get())
        ops = restore_operator_state(fs, directory, metadata, OPERATOR, i, new_parallelism)
        offsets.extend(ops.get_list_state("offsets", IntSerializer()).get())
    return keyed, offsets


def assert_restores(job: Job, checkpoint_id: int, directory: str | None = None) -> None:
    """Checkpoint ``checkpoint_id`` (or the copy in ``directory``) restores to its model."""
    where = directory or job.storage.resolve(checkpoint_id)
    keyed, offsets = restore_all(job.storage.fs, where)
    assert keyed == job.models[checkpoint_id]
    assert offsets == [o for subtask in job.offsets[checkpoint_id] for o in subtask]


def files_under(location: Storage, directory: str) -> dict[str, bytes]:
    """Every file below ``directory`` and its bytes, by path relative to it."""
    fs = raw_fs(location)
    fs.invalidate_cache()
    root = fs._strip_protocol(directory).rstrip("/")
    return {path[len(root) + 1 :]: fs.cat_file(path) for path in fs.find(root)}


def copy_tree(location: Storage, source: str, target: str) -> None:
    """Copy every file below ``source`` to ``target`` with plain fsspec (a user's copy)."""
    fs = raw_fs(location)
    for relative, data in files_under(location, source).items():
        fs.pipe_file(join(target, relative), data)


def keyed_handle(job: Job, checkpoint_id: int, subtask: int = 0) -> FullKeyedStateHandle:
    """Subtask ``subtask``'s keyed handle in checkpoint ``checkpoint_id``."""
    handle = job.storage.load(checkpoint_id).operators[OPERATOR].subtasks[subtask].keyed
    assert handle is not None
    return handle


# -- coordination ---------------------------------------------------------------------------


def test_at_most_one_pending_checkpoint_by_default(job: Job) -> None:
    """A second trigger while one is pending is refused, then allowed once it completes;
    with max_concurrent=2 two may be pending."""
    first = job.coordinator.trigger({OPERATOR: P})
    with pytest.raises(CheckpointError, match=f"checkpoint {first} is still pending"):
        job.coordinator.trigger({OPERATOR: P})
    job.snapshot_and_ack(first)
    job.remember(first)
    assert job.coordinator.poll(first) is not None
    second = job.coordinator.trigger({OPERATOR: P})
    assert second == first + 1

    other = new_job(job.location, max_concurrent=2)
    a = other.coordinator.trigger({OPERATOR: P})
    b = other.coordinator.trigger({OPERATOR: P})
    assert b == a + 1
    with pytest.raises(CheckpointError):
        other.coordinator.trigger({OPERATOR: P})
    other.close()


def test_numbering_continues_after_a_restart(job: Job) -> None:
    """A new coordinator on the same directory numbers on after the highest checkpoint
    directory, complete or not, so no directory is ever reused."""
    job.checkpoint()
    job.checkpoint()
    crashed = job.coordinator.trigger({OPERATOR: P})
    job.snapshot_and_ack(crashed, range(1))  # the driver dies before the checkpoint completes
    assert crashed == 3

    restarted = CheckpointCoordinator(job.storage, max_parallelism=M, clock=job.clock)
    assert restarted.pending == {}
    job.coordinator = restarted
    number, _ = job.checkpoint()
    assert number == 4
    # The crashed attempt is an older incomplete directory: removed once 4 completed.
    assert job.storage.checkpoint_ids() == [1, 2, 4]
    assert_restores(job, 4)


def test_retention_keeps_the_last_three_and_never_a_savepoint(job: Job) -> None:
    """After six checkpoints only 4, 5, 6 remain; the savepoint taken at 2 survives them,
    restores, and is marked as a savepoint."""
    savepoint_dir = join(job.storage.layout.savepoints_dir, "before-upgrade")
    job.checkpoint()
    number, returned = job.checkpoint(savepoint_dir=savepoint_dir)
    assert returned == savepoint_dir
    for _ in range(4):
        job.checkpoint()
    assert job.storage.completed_checkpoint_ids() == [4, 5, 6]
    assert job.storage.checkpoint_ids() == [4, 5, 6]
    for gone in (1, 2, 3):
        assert files_under(job.location, job.storage.resolve(gone)) == {}
    savepoint = job.storage.load(savepoint_dir)
    assert savepoint.is_savepoint and savepoint.checkpoint_id == number
    assert_restores(job, number, savepoint_dir)
    for kept in (4, 5, 6):
        assert_restores(job, kept)


def test_retention_is_configurable(checkpoint_url: Storage) -> None:
    """retained=1 keeps only the newest checkpoint."""
    job = new_job(checkpoint_url, retained=1)
    for _ in range(3):
        job.checkpoint()
    assert job.storage.checkpoint_ids() == [3]
    assert_restores(job, 3)
    job.close()


def test_timeout_aborts_and_deletes_files(job: Job) -> None:
    """One subtask acknowledged, the other never does: after the timeout, poll aborts
    the checkpoint, deletes its files, and the previous one is still the latest."""
    good, _ = job.checkpoint()
    job.process()
    late = job.coordinator.trigger({OPERATOR: P})
    job.snapshot_and_ack(late, range(1))
    assert job.coordinator.poll(late) is None
    assert files_under(job.location, job.storage.resolve(late)) != {}

    job.clock.now += job.coordinator.timeout_seconds / 2
    assert job.coordinator.poll(late) is None  # not yet
    job.clock.now += job.coordinator.timeout_seconds
    with pytest.raises(CheckpointError, match=rf"checkpoint {late} timed out.*\('counter', 1\)"):
        job.coordinator.poll(late)

    assert late not in job.coordinator.pending
    assert files_under(job.location, job.storage.resolve(late)) == {}
    assert job.storage.latest_completed() == job.storage.resolve(good)
    assert_restores(job, good)
    assert job.checkpoint()[0] == late + 1


def test_a_checkpoint_without_metadata_is_never_completed(job: Job) -> None:
    """All subtasks acknowledged and every file is written, but ``_metadata`` never was
    (the driver died, or its temp file is all that was written): the checkpoint is not
    listed, not the latest, and cannot be loaded."""
    good, _ = job.checkpoint()
    job.process()
    crashed = job.coordinator.trigger({OPERATOR: P})
    job.snapshot_and_ack(crashed)
    directory = job.storage.resolve(crashed)
    raw_fs(job.location).pipe_file(
        join(directory, f"_metadata.{uuid.uuid4().hex}.tmp"), b'{"format_version": 1, "jo'
    )

    assert job.storage.checkpoint_ids() == [good, crashed]
    assert job.storage.completed_checkpoint_ids() == [good]
    assert job.storage.latest_completed() == job.storage.resolve(good)
    with pytest.raises(CheckpointNotFoundError, match=f"chk-{crashed}"):
        job.storage.load(crashed)
    with pytest.raises(CheckpointNotFoundError):
        load_metadata(job.storage.fs, directory)
    assert_restores(job, good)


# -- savepoints -----------------------------------------------------------------------------


def other_location(location: Storage, s3_endpoint: S3Endpoint | None, tmp: Any) -> Storage:
    """Another place of the same kind: another bucket on S3, another directory locally."""
    if s3_endpoint is None:
        return Storage((tmp / f"elsewhere-{uuid.uuid4().hex[:6]}").as_uri())
    import boto3

    bucket = f"other-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint.endpoint_url).create_bucket(Bucket=bucket)
    return Storage(f"s3://{bucket}/moved", s3_endpoint.storage_options)


@pytest.fixture
def elsewhere(
    checkpoint_url: Storage, request: pytest.FixtureRequest, tmp_path_factory: Any
) -> Storage:
    """A location in another bucket or directory than ``checkpoint_url``."""
    endpoint = (
        request.getfixturevalue("s3_endpoint") if checkpoint_url.url.startswith("s3") else None
    )
    return other_location(checkpoint_url, endpoint, tmp_path_factory.mktemp("elsewhere"))


def test_copied_savepoint_is_self_contained(job: Job, elsewhere: Storage) -> None:
    """copy_checkpoint to another bucket/directory; the whole job directory is deleted;
    the savepoint restores (and restores again after a plain copy to a third place)."""
    number, directory = job.checkpoint()
    job.checkpoint()
    target_fs = open_filesystem(elsewhere.url, elsewhere.storage_options)
    savepoint_dir = join(elsewhere.url, "sp")
    progress: list[int] = []
    assert (
        copy_checkpoint(job.storage.fs, directory, target_fs, savepoint_dir, progress.append)
        == savepoint_dir
    )
    assert sum(progress) == job.storage.load(number).state_bytes()
    with pytest.raises(CheckpointError, match="already holds"):
        copy_checkpoint(job.storage.fs, directory, target_fs, savepoint_dir)

    raw_fs(job.location).rm(job.storage.layout.job_dir, recursive=True)
    assert files_under(job.location, job.storage.layout.job_dir) == {}
    assert load_metadata(target_fs, savepoint_dir).is_savepoint
    keyed, offsets = restore_all(target_fs, savepoint_dir)
    assert keyed == job.models[number]
    assert offsets == [o for subtask in job.offsets[number] for o in subtask]

    moved = join(elsewhere.url, "moved-again")
    copy_tree(elsewhere, savepoint_dir, moved)
    raw_fs(elsewhere).rm(raw_fs(elsewhere)._strip_protocol(savepoint_dir), recursive=True)
    assert restore_all(target_fs, moved, new_parallelism=1) == (keyed, offsets)


def test_triggered_savepoint_survives_deleting_the_checkpoints(
    job: Job, elsewhere: Storage
) -> None:
    """trigger(savepoint_dir=...): the savepoint directory, copied elsewhere by a user,
    restores after the job's checkpoint directory is gone."""
    savepoint_dir = join(job.storage.layout.savepoints_dir, "sp-1")
    number, returned = job.checkpoint(savepoint_dir=savepoint_dir)
    assert returned == savepoint_dir
    assert job.storage.completed_checkpoint_ids() == [number]
    copy_tree(job.location, savepoint_dir, join(elsewhere.url, "copy"))
    raw_fs(job.location).rm(job.storage.layout.job_dir, recursive=True)

    storage = CheckpointStorage(
        elsewhere.url, "unrelated", storage_options=elsewhere.storage_options
    )
    metadata = storage.load(join(elsewhere.url, "copy", "_metadata"))
    assert metadata.is_savepoint and metadata.checkpoint_id == number
    keyed, offsets = restore_all(storage.fs, join(elsewhere.url, "copy"), new_parallelism=4)
    assert keyed == job.models[number]
    assert offsets == [o for subtask in job.offsets[number] for o in subtask]


# -- bad input ------------------------------------------------------------------------------


@pytest.fixture
def two_checkpoints(job: Job) -> tuple[Job, int, int]:
    """The job with checkpoints 1 (the fallback) and 2 (the one the test damages)."""
    first, _ = job.checkpoint()
    second, _ = job.checkpoint()
    return job, first, second


def assert_untouched_and_fallback(
    job: Job, damaged: int, before: dict[str, bytes], fallback: int
) -> None:
    """The failed restore changed nothing in the damaged checkpoint, and the previous
    checkpoint still restores to its model."""
    assert files_under(job.location, job.storage.resolve(damaged)) == before
    assert job.storage.completed_checkpoint_ids() == [fallback, damaged]
    assert_restores(job, fallback)


def assert_restore_refused(job: Job, fallback: int, damaged: int, match: str) -> None:
    """Restoring the damaged checkpoint raises CheckpointCorruptedError matching ``match``
    and changes none of its files; the previous checkpoint still restores."""
    before = files_under(job.location, job.storage.resolve(damaged))
    with pytest.raises(CheckpointCorruptedError, match=match):
        restore_all(job.storage.fs, job.storage.resolve(damaged))
    assert_untouched_and_fallback(job, damaged, before, fallback)


def test_missing_keyed_file(two_checkpoints: tuple[Job, int, int]) -> None:
    """A deleted keyed file: CheckpointCorruptedError naming it."""
    job, first, second = two_checkpoints
    handle = keyed_handle(job, second)
    path = join(job.storage.resolve(second), handle.path)
    job.storage.fs.delete(path)
    assert_restore_refused(job, first, second, f"{handle.path}.*missing")


def test_truncated_keyed_file(two_checkpoints: tuple[Job, int, int]) -> None:
    """A keyed file cut short: CheckpointCorruptedError naming it."""
    job, first, second = two_checkpoints
    handle = keyed_handle(job, second, 1)
    path = join(job.storage.resolve(second), handle.path)
    data = job.storage.fs.read_file(path)
    job.storage.fs.write_atomic(path, data[: len(data) * 2 // 3])
    assert_restore_refused(job, first, second, f"{handle.path}.*truncated")


def test_flipped_byte_in_keyed_file(two_checkpoints: tuple[Job, int, int]) -> None:
    """One flipped payload byte: checksum mismatch, CheckpointCorruptedError naming it."""
    job, first, second = two_checkpoints
    handle = keyed_handle(job, second)
    path = join(job.storage.resolve(second), handle.path)
    data = bytearray(job.storage.fs.read_file(path))
    # The middle of the first key group's first frame's payload (after its 13-byte header).
    _, offset, length = handle.key_groups[0]
    data[offset + 13 + (length - 13) // 2] ^= 0x40
    job.storage.fs.write_atomic(path, bytes(data))
    assert_restore_refused(job, first, second, f"{handle.path}.*checksum mismatch")


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_every_flipped_byte_is_detected_or_harmless(compression: str, tmp_path: Any) -> None:
    """Flip each byte of a small keyed file in turn: reading it either raises
    CheckpointCorruptedError naming the file or yields exactly the original entries —
    never other entries, never another exception."""
    location = Storage(tmp_path.as_uri())
    storage = CheckpointStorage(location.url, "job", compression=compression)
    backend = HeapKeyedStateBackend(max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1))
    state = cast(ValueState, backend.get_state(ValueStateDescriptor("v", StrSerializer())))
    for n in range(12):
        backend.set_current_key(f"k{n}")
        state.update("abc" * 40 + str(n))  # compressible, so lz4/zstd frames are compressed
    handle = backend.snapshot(1, storage.snapshot_target(1, "op", 0)).result()
    path = join(storage.resolve(1), handle.path)
    original = storage.fs.read_file(path)

    def read(data: bytes) -> list[Any]:
        return list(
            read_keyed_entries(
                lambda _p, s, n: data[s : s + n], path, handle, KeyGroupRange(0, M - 1)
            )
        )

    expected = read(original)
    assert len(expected) == 12
    rng = random.Random(compression)
    for position, mask in [
        (p, m) for p in range(len(original)) for m in (1, rng.randrange(2, 256))
    ]:
        damaged = bytearray(original)
        damaged[position] ^= mask
        try:
            got = read(bytes(damaged))
        except CheckpointCorruptedError as exc:
            assert handle.path in str(exc)
        else:
            assert got == expected, f"flip {mask:#x} at byte {position} changed the entries"
    backend.dispose()
    storage.close()


def test_metadata_of_a_future_format_version(
    two_checkpoints: tuple[Job, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_metadata`` written by a newer release (its checksum intact): IncompatibleStateError
    naming the file."""
    job, first, second = two_checkpoints
    path = job.storage.layout.metadata_path(second)
    metadata = job.storage.load(second)
    with monkeypatch.context() as newer_release:
        newer_release.setattr(metadata_module, "_UNSIGNED_VERSION", 99)
        job.storage.fs.write_atomic(path, metadata.to_bytes())
    before = files_under(job.location, job.storage.resolve(second))
    with pytest.raises(IncompatibleStateError, match=f"chk-{second}/_metadata.*version 99"):
        job.storage.load(second)
    assert_untouched_and_fallback(job, second, before, first)


def test_a_path_that_is_not_a_checkpoint(two_checkpoints: tuple[Job, int, int]) -> None:
    """A directory without ``_metadata``, a missing directory, and a file that is not
    metadata: each a clear error naming the path."""
    job, first, second = two_checkpoints
    elsewhere = join(job.location.url, "not-a-checkpoint")
    raw_fs(job.location).pipe_file(join(elsewhere, "data.bin"), b"hello")
    with pytest.raises(CheckpointNotFoundError, match="not-a-checkpoint"):
        job.storage.load(elsewhere)
    with pytest.raises(CheckpointNotFoundError, match="does-not-exist"):
        job.storage.load(join(job.location.url, "does-not-exist"))
    raw_fs(job.location).pipe_file(join(elsewhere, "_metadata"), b"\x00garbage")
    with pytest.raises(CheckpointCorruptedError, match="not-a-checkpoint/_metadata"):
        job.storage.load(elsewhere)
    assert job.storage.completed_checkpoint_ids() == [first, second]
    assert_restores(job, second)


def test_a_metadata_that_cannot_be_read_is_unreadable_not_missing(
    two_checkpoints: tuple[Job, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``_metadata`` that exists but cannot be read (permissions, storage failing past
    its retries) was taken for a missing one: ``list`` showed the checkpoint as pending
    and the shared-file registry as referencing nothing. Now it is unreadable."""
    job, first, second = two_checkpoints
    path = job.storage.layout.metadata_path(second)
    read_file = job.storage.fs.read_file

    def permission_denied(name: str, *args: Any, **kwargs: Any) -> bytes:
        if name == path:
            raise CheckpointError(f"{name}: [Errno 13] Permission denied")
        return read_file(name, *args, **kwargs)

    monkeypatch.setattr(job.storage.fs, "read_file", permission_denied)
    with pytest.raises(CheckpointUnreadableError, match=f"cannot read {path}"):
        job.storage.load(second)
    summary = summarize(job.storage.fs, job.storage.resolve(second), second)
    assert summary.status.startswith(f"unreadable: cannot read {path}")


def test_max_parallelism_mismatch(two_checkpoints: tuple[Job, int, int]) -> None:
    """Restoring into backends with another max parallelism: IncompatibleStateError."""
    job, first, second = two_checkpoints
    metadata = job.storage.load(second)
    assert check_max_parallelism(metadata, None) == M
    backend = HeapKeyedStateBackend(max_parallelism=256, key_group_range=KeyGroupRange(0, 255))
    before = files_under(job.location, job.storage.resolve(second))
    with pytest.raises(IncompatibleStateError, match="max parallelism 128.*256"):
        restore_keyed_state(
            backend, job.storage.fs, job.storage.resolve(second), metadata, OPERATOR
        )
    with pytest.raises(IncompatibleStateError, match="256"):
        check_max_parallelism(metadata, 256)
    assert_untouched_and_fallback(job, second, before, first)


def test_incompatible_serializer_names_the_state(two_checkpoints: tuple[Job, int, int]) -> None:
    """Reading int state with a str serializer: IncompatibleStateError naming the state,
    for keyed and for operator state."""
    job, first, second = two_checkpoints
    metadata = job.storage.load(second)
    directory = job.storage.resolve(second)
    before = files_under(job.location, directory)
    backend = HeapKeyedStateBackend(max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1))
    restore_keyed_state(backend, job.storage.fs, directory, metadata, OPERATOR)
    with pytest.raises(IncompatibleStateError, match="'count'"):
        backend.get_state(ValueStateDescriptor("count", StrSerializer()))
    with pytest.raises(IncompatibleStateError, match="'history'"):
        backend.get_state(ListStateDescriptor("history", StrSerializer()))
    ops = restore_operator_state(job.storage.fs, directory, metadata, OPERATOR, 0, 1)
    with pytest.raises(IncompatibleStateError, match="'offsets'"):
        ops.get_list_state("offsets", StrSerializer())
    # The right serializers still work on the same restored backend.
    assert backend.get_state(COUNT) is not None
    assert_untouched_and_fallback(job, second, before, first)


def test_state_of_an_operator_the_job_lacks(two_checkpoints: tuple[Job, int, int]) -> None:
    """A job without the checkpoint's operator: IncompatibleStateError naming it, unless
    non-restored state is allowed; the command it gives writes a savepoint without it."""
    job, first, second = two_checkpoints
    metadata: CheckpointMetadata = job.storage.load(second)
    where = job.storage.resolve(second)
    with pytest.raises(IncompatibleStateError, match=OPERATOR) as refused:
        check_operators(metadata, {"renamed"}, allow_non_restored_state=False, where=where)
    command = re.search(r"`statebackend (savepoint transform [^`]*)`", str(refused.value))
    assert command is not None
    dropped = f"{job.location.url}/dropped"
    argv = command.group(1).replace("NEW_DIR", dropped).split()
    options = [f"--storage-option={k}={v}" for k, v in job.location.storage_options.items()]
    assert cli_main([*argv, *options]) == 0
    without = load_metadata(job.storage.fs, dropped)
    assert set(metadata.operators) - set(without.operators) == {OPERATOR}
    check_operators(without, {"renamed"}, allow_non_restored_state=False)
    check_operators(metadata, {"renamed"}, allow_non_restored_state=True)
    check_operators(metadata, {OPERATOR, "new-one"}, allow_non_restored_state=False)
    assert_restores(job, second)
    assert_restores(job, first)


def test_a_job_id_differing_only_in_case_from_another_jobs_is_refused_at_start(
    checkpoint_url: Storage,
) -> None:
    """Job ``Users`` beside job ``users``: one directory on a case-insensitive file system,
    so a driver starting ``Users`` is refused, naming ``users``, on every storage; two such
    jobs that both exist already (on S3, say) go on, as do ids in another case only."""

    def storage(job_id: str) -> CheckpointStorage:
        options = checkpoint_url.storage_options
        return CheckpointStorage(checkpoint_url.url, job_id, storage_options=options)

    existing = storage("users")
    existing.fs.write_atomic(join(existing.layout.job_dir, "_checkpoint_id"), b"1")
    existing.check_job_id_case()
    storage("other").check_job_id_case()
    with pytest.raises(
        ConfigurationError, match="'Users' differs only in case from the job 'users'"
    ):
        storage("Users").check_job_id_case()
    both = storage("Users")
    both.fs.write_atomic(join(both.layout.job_dir, "_checkpoint_id"), b"1")
    both.check_job_id_case()
    existing.check_job_id_case()
