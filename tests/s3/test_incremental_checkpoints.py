"""Incremental keyed checkpoints of the RocksDB backend, on file:// and s3://.

Real backends, storage, coordinator and restore; the file system is a real
``CheckpointFileSystem`` that can hold or fail writes to ``shared/``. Expectations come
from a plain-Python model of the state.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from fsspec.utils import get_protocol

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import CheckpointFileSystem, WrittenFile
from statebackend.checkpoint.layout import join
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import (
    HANDLE_DOWNLOADS_AHEAD,
    plan_restore,
    restore_keyed_state,
)
from statebackend.checkpoint.savepoints import copy_checkpoint
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata
from statebackend.checksums import DOCUMENT_CHECKSUM
from statebackend.errors import CheckpointCancelledError, CheckpointCorruptedError, CheckpointError
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import StrSerializer
from statebackend.snapshot import incremental
from statebackend.snapshot.handles import resolve_path
from statebackend.snapshot.incremental import IncrementalKeyedStateHandle
from statebackend.state.interfaces import MapState, ValueState
from statebackend.tools.gc import find_garbage
from statebackend.tools.listing import inspect_checkpoint
from statebackend.tools.location import CheckpointRef
from statebackend.tools.verify import verify_checkpoint
from tests.conftest import S3Endpoint, Storage, raw_fs
from tests.unit.test_bulk_restore import COUNT, TAGS, Model, read_model

M = 128
OPERATOR = "op"
WAIT = 20.0


class InjectedFailure(OSError):
    """The failure the test file system raises instead of writing a shared file."""


class SharedGateFileSystem(CheckpointFileSystem):
    """A checkpoint file system that, once ``shared_allowed`` shared files were written,
    holds the next shared write at ``gate`` (``holding`` set) or fails it (``fail``)."""

    def __init__(self, location: Storage) -> None:
        super().__init__(raw_fs(location))
        self.shared_allowed: int | None = None
        self.fail = False
        self.shared_writes = 0
        self.gate = threading.Event()
        self.holding = threading.Event()

    def write_file(
        self,
        path: str,
        chunks: Iterable[bytes],
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> WrittenFile:
        """``CheckpointFileSystem.write_file``, held or failed as configured."""
        if "/shared/" in path and self.shared_allowed is not None:
            if self.shared_writes >= self.shared_allowed:
                if self.fail:
                    raise InjectedFailure(f"injected failure writing {path}")
                self.holding.set()
                assert self.gate.wait(WAIT), "the test never opened the gate"
            self.shared_writes += 1
        return super().write_file(path, chunks, should_stop=should_stop)


@dataclass
class Job:
    """``parallelism`` RocksDB subtasks checkpointing incrementally, with their model."""

    location: Storage
    storage: CheckpointStorage
    coordinator: CheckpointCoordinator
    backends: list[RocksDBKeyedStateBackend]
    rng: random.Random = field(default_factory=lambda: random.Random(5))
    model: Model = field(default_factory=dict)
    models: dict[int, Model] = field(default_factory=dict)

    def write(self, records: int = 1500, keys: int = 400) -> None:
        """Random count updates, tag puts and clears, mirrored in the model."""
        parallelism = len(self.backends)
        for _ in range(records):
            key = f"key-{self.rng.randrange(keys)}"
            group = assign_to_key_group(StrSerializer().serialize(key), M)
            backend = self.backends[compute_operator_index_for_key_group(M, parallelism, group)]
            backend.set_current_key(key)
            count = cast(ValueState, backend.get_state(COUNT))
            tags = cast(MapState, backend.get_state(TAGS))
            old_count, old_tags = self.model.get(key, (None, {}))
            action = self.rng.randrange(10)
            if action == 0:
                count.clear()
                tags.clear()
                self.model.pop(key, None)
                continue
            if action < 6:
                count.update((old_count or 0) + 1)
                self.model[key] = ((old_count or 0) + 1, old_tags)
            else:
                tag, value = f"t{self.rng.randrange(5)}", self.rng.randrange(10**6)
                tags.put(tag, value)
                self.model[key] = (old_count, {**old_tags, tag: value})

    def snapshot(self, checkpoint_id: int) -> list[Any]:
        """Start every subtask's snapshot of checkpoint N; their futures."""
        return [
            backend.snapshot(
                checkpoint_id,
                self.storage.snapshot_target(checkpoint_id, OPERATOR, i, self.coordinator.run_id),
            )
            for i, backend in enumerate(self.backends)
        ]

    def checkpoint(self) -> int:
        """Take and complete a checkpoint of the current state; its id."""
        checkpoint_id = self.coordinator.trigger({OPERATOR: len(self.backends)})
        for i, future in enumerate(self.snapshot(checkpoint_id)):
            ack = SubtaskAck(
                OPERATOR,
                i,
                len(self.backends),
                future.result(WAIT),
                None,
                self.coordinator.run_id,
            )
            self.storage.write_ack(checkpoint_id, ack)
        assert self.coordinator.poll(checkpoint_id) is not None
        self.models[checkpoint_id] = {k: (c, dict(t)) for k, (c, t) in self.model.items()}
        return checkpoint_id

    def close(self) -> None:
        """Dispose the backends and stop the transfer threads."""
        for backend in self.backends:
            backend.dispose()
        self.storage.close()


def new_job(
    location: Storage,
    local: Path,
    parallelism: int = 1,
    retained: int = 3,
    fs: CheckpointFileSystem | None = None,
    max_concurrent: int = 1,
) -> Job:
    """A job of ``parallelism`` RocksDB subtasks writing incremental checkpoints."""
    storage = CheckpointStorage(
        location.url,
        "job",
        storage_options=location.storage_options,
        incremental=True,
        filesystem=fs,
    )
    coordinator = CheckpointCoordinator(
        storage, max_parallelism=M, retained=retained, max_concurrent=max_concurrent
    )
    backends = [
        RocksDBKeyedStateBackend(
            local / f"subtask-{i}",
            max_parallelism=M,
            key_group_range=compute_key_group_range_for_operator_index(M, parallelism, i),
        )
        for i in range(parallelism)
    ]
    return Job(location, storage, coordinator, backends)


@pytest.fixture
def job(checkpoint_url: Storage, tmp_path: Path) -> Iterator[Job]:
    """A one-subtask incremental job on file:// and on s3://."""
    created = new_job(checkpoint_url, tmp_path / "local")
    yield created
    created.close()


def restore(
    fs: CheckpointFileSystem, directory: str, parallelism: int, local: Path, kind: str = "heap"
) -> Model:
    """The keyed state of the checkpoint in ``directory`` restored at ``parallelism``,
    into heap or RocksDB backends; every key must land in exactly one subtask."""
    metadata = load_metadata(fs, directory)
    restored: Model = {}
    for i in range(parallelism):
        options: dict[str, Any] = {
            "max_parallelism": M,
            "key_group_range": compute_key_group_range_for_operator_index(M, parallelism, i),
        }
        backend: KeyedStateBackend = (
            RocksDBKeyedStateBackend(local / f"restore-{parallelism}-{i}", **options)
            if kind == "rocksdb"
            else HeapKeyedStateBackend(**options)
        )
        restore_keyed_state(backend, fs, directory, metadata, OPERATOR)
        part = read_model(backend)
        backend.dispose()
        assert not part.keys() & restored.keys()
        restored.update(part)
    return restored


def handles(job: Job, checkpoint_id: int) -> list[IncrementalKeyedStateHandle]:
    """The incremental keyed handles of checkpoint N, by subtask."""
    found = []
    for ack in job.storage.load(checkpoint_id).operators[OPERATOR].subtasks:
        assert isinstance(ack.keyed, IncrementalKeyedStateHandle)
        found.append(ack.keyed)
    return found


def shared_names(job: Job) -> set[str]:
    """The files in the job's ``shared/`` directory."""
    return set(job.storage.fs.list_dir(job.storage.layout.shared_dir))


def referenced_shared(job: Job, checkpoint_ids: Iterable[int]) -> set[str]:
    """The names of the shared files the given checkpoints reference."""
    return {
        f.path.rsplit("/", 1)[-1]
        for checkpoint_id in checkpoint_ids
        for handle in handles(job, checkpoint_id)
        for f in handle.shared
    }


def compact(backend: RocksDBKeyedStateBackend) -> None:
    """Force a full compaction: the SST files of the database change."""
    for column in backend._columns.values():
        column.compact_range(None, None)


# -- restore -------------------------------------------------------------------------------------


@pytest.mark.parametrize("old", [1, 2, 3])
@pytest.mark.parametrize("new", [1, 2, 4])
def test_restore_at_any_parallelism(
    checkpoint_url: Storage, tmp_path: Path, old: int, new: int
) -> None:
    """P -> P': both of two incremental checkpoints (the second reusing SSTs of the first)
    restore to the model at P' (into RocksDB backends for P'=2, heap ones otherwise);
    the plan reads whole handles."""
    job = new_job(checkpoint_url, tmp_path / "local", old)
    try:
        job.write(3000)
        first = job.checkpoint()
        job.write(1000)
        second = job.checkpoint()
        kind = "rocksdb" if new == 2 else "heap"
        for checkpoint_id in (first, second):
            directory = job.storage.resolve(checkpoint_id)
            restored = restore(job.storage.fs, directory, new, tmp_path / str(checkpoint_id), kind)
            assert restored == job.models[checkpoint_id]
        metadata = job.storage.load(second)
        sizes = {h.key_group_range.start: h.size for h in handles(job, second)}
        for plan in plan_restore(metadata, OPERATOR, new):
            assert plan.keyed_bytes == sum(
                sizes[h.key_group_range.start]
                for h in handles(job, second)
                if h.key_group_range.intersection(plan.key_group_range)
            )
    finally:
        job.close()


class DownloadCountingFileSystem(CheckpointFileSystem):
    """Reads like ``CheckpointFileSystem``; records the most old subtasks whose shared
    files were being read at the same time (each stream counts until it is closed)."""

    def __init__(self, location: Storage) -> None:
        super().__init__(raw_fs(location))
        self._lock = threading.Lock()
        self._reading: dict[str, int] = {}
        self.most_at_once = 0

    def open_read(self, path: str) -> Any:
        """``CheckpointFileSystem.open_read``, counted while open."""
        stream = super().open_read(path)
        if "/shared/" not in path:
            return stream
        subtask = path.rsplit("/", 1)[-1].split("-")[1]  # <op>-<subtask>-...
        with self._lock:
            self._reading[subtask] = self._reading.get(subtask, 0) + 1
            self.most_at_once = max(self.most_at_once, len(self._reading))
        close = stream.close

        def closed() -> None:
            close()
            with self._lock:
                self._reading[subtask] -= 1
                if not self._reading[subtask]:
                    del self._reading[subtask]

        stream.close = closed
        return stream


def test_a_restore_downloads_at_most_two_old_subtasks_ahead(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """4 -> 1 into RocksDB: one old subtask's database is adopted, three are copied; the
    downloads run ahead of the loading, never more than HANDLE_DOWNLOADS_AHEAD old
    subtasks at once, and the state is the model's."""
    job = new_job(checkpoint_url, tmp_path / "local", 4)
    try:
        job.write(3000)
        checkpoint_id = job.checkpoint()
        fs = DownloadCountingFileSystem(checkpoint_url)
        directory = job.storage.resolve(checkpoint_id)
        restored = restore(fs, directory, 1, tmp_path / "restored", "rocksdb")
        assert restored == job.models[checkpoint_id]
        assert 1 <= fs.most_at_once <= HANDLE_DOWNLOADS_AHEAD == 2
    finally:
        job.close()


def test_the_heap_backend_falls_back_to_the_full_format(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """An incremental storage with a heap backend writes (and restores) the full format."""
    storage = CheckpointStorage(
        checkpoint_url.url, "job", storage_options=checkpoint_url.storage_options, incremental=True
    )
    backend = HeapKeyedStateBackend(
        max_parallelism=M, key_group_range=compute_key_group_range_for_operator_index(M, 1, 0)
    )
    backend.set_current_key("a")
    cast(ValueState, backend.get_state(COUNT)).update(3)
    handle = backend.snapshot(1, storage.snapshot_target(1, OPERATOR, 0)).result(WAIT)
    assert not isinstance(handle, IncrementalKeyedStateHandle)
    storage.close()


# -- uploads -------------------------------------------------------------------------------------


def test_unchanged_sst_files_are_uploaded_once(job: Job) -> None:
    """A checkpoint without changes uploads no SST file and references the same shared
    files; after more writes only the new SST files are uploaded."""
    job.write(4000)
    first = job.checkpoint()
    (one,) = handles(job, first)
    assert one.shared and all(f.path.startswith("../shared/") for f in one.shared)
    assert {f.name for f in one.private} >= {"CURRENT", "rocksdict-config.json"}

    before = job.storage.fs.bytes_written
    second = job.checkpoint()
    uploaded = job.storage.fs.bytes_written - before
    (two,) = handles(job, second)
    assert two.shared == one.shared
    assert all(f.inline is not None for f in two.private)  # all smaller than INLINE_LIMIT
    inline_json = sum(len(json.dumps(f.to_json())) for f in two.private)
    # the private files inline in the ack and in _metadata, the rest of both, and the
    # coordinator's _pending and _checkpoint_id
    assert uploaded < 2 * inline_json + 8192
    assert shared_names(job) == referenced_shared(job, [first])

    job.write(500)
    before = job.storage.fs.bytes_written
    third = job.checkpoint()
    uploaded = job.storage.fs.bytes_written - before
    (three,) = handles(job, third)
    old = {f.name: f for f in one.shared}
    reused = [f for f in three.shared if f.name in old]
    new = [f for f in three.shared if f.name not in old]
    assert reused and new
    assert all(f == old[f.name] for f in reused)
    inline_json = sum(len(json.dumps(f.to_json())) for f in three.private)
    assert uploaded < sum(f.size for f in new) + 2 * inline_json + 8192
    assert job.models[third] != job.models[first]
    for checkpoint_id in (first, second, third):
        restored = restore(job.storage.fs, job.storage.resolve(checkpoint_id), 1, Path("unused"))
        assert restored == job.models[checkpoint_id]


def test_retention_deletes_only_unreferenced_shared_files(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """retained=2 over five checkpoints (a full compaction in between): after each, the
    shared directory holds exactly the files the retained checkpoints reference, some
    were deleted, and every retained checkpoint restores."""
    job = new_job(checkpoint_url, tmp_path / "local", parallelism=2, retained=2)
    try:
        for round_ in range(5):
            job.write(1500)
            if round_ == 3:
                for backend in job.backends:
                    compact(backend)
            job.checkpoint()
            retained = job.storage.completed_checkpoint_ids()
            assert retained == list(range(max(1, round_), round_ + 2))
            assert shared_names(job) == referenced_shared(job, retained)
        assert job.coordinator.registry.deletions > 0
        for checkpoint_id in job.storage.completed_checkpoint_ids():
            restored = restore(job.storage.fs, job.storage.resolve(checkpoint_id), 3, tmp_path)
            assert restored == job.models[checkpoint_id]

        # A restarted driver computes the references from _metadata alone.
        job.coordinator = CheckpointCoordinator(job.storage, max_parallelism=M, retained=2)
        job.write(1500)
        for backend in job.backends:
            compact(backend)
        job.checkpoint()
        retained = job.storage.completed_checkpoint_ids()
        assert shared_names(job) == referenced_shared(job, retained)
        for checkpoint_id in retained:
            restored = restore(job.storage.fs, job.storage.resolve(checkpoint_id), 1, tmp_path)
            assert restored == job.models[checkpoint_id]
    finally:
        job.close()


@pytest.mark.parametrize("how", ["cancel", "failure"])
def test_cancel_or_failure_leaves_no_new_shared_file(
    checkpoint_url: Storage, tmp_path: Path, how: str
) -> None:
    """A snapshot cancelled or failing after it uploaded a new shared file: that file is
    deleted, the earlier checkpoint's shared files stay and it restores; after the
    abort the next checkpoint completes."""
    fs = SharedGateFileSystem(checkpoint_url)
    job = new_job(checkpoint_url, tmp_path / "local", fs=fs)
    try:
        job.write(3000)
        good = job.checkpoint()
        before = shared_names(job)
        job.write(3000)  # new SST files in both column families
        fs.shared_writes, fs.shared_allowed, fs.fail = 0, 1, how == "failure"
        checkpoint_id = job.coordinator.trigger({OPERATOR: 1})
        (future,) = job.snapshot(checkpoint_id)
        if how == "cancel":
            assert fs.holding.wait(WAIT)
            assert future.cancel() is True
            fs.gate.set()
        with pytest.raises(CheckpointError) as info:
            future.result(WAIT)
        assert isinstance(info.value, CheckpointCancelledError) == (how == "cancel")
        assert fs.shared_writes >= 1
        assert shared_names(job) == before
        # Only the pending marker, until the coordinator aborts the checkpoint.
        assert job.storage.fs.list_dir(job.storage.resolve(checkpoint_id)) == ["_pending"]
        job.coordinator.abort(checkpoint_id)
        assert shared_names(job) == before
        directory = job.storage.resolve(good)
        assert restore(job.storage.fs, directory, 2, tmp_path) == job.models[good]

        fs.shared_allowed = None
        after = job.checkpoint()
        directory = job.storage.resolve(after)
        assert restore(job.storage.fs, directory, 2, tmp_path) == job.models[after]
    finally:
        job.close()


# -- savepoints, verify, gc --------------------------------------------------------------------


@pytest.fixture
def elsewhere(request: pytest.FixtureRequest, checkpoint_url: Storage, tmp_path: Path) -> Storage:
    """Another location on the same kind of storage."""
    if checkpoint_url.url.startswith("s3://"):
        endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
        return endpoint.new_storage()
    return Storage((tmp_path / "elsewhere").as_uri())


def test_savepoint_restores_after_the_job_dir_is_gone(job: Job, elsewhere: Storage) -> None:
    """A savepoint of an incremental checkpoint copies the shared files in: its metadata
    references nothing outside it, and it restores once the job directory is deleted."""
    job.write(3000)
    job.checkpoint()
    job.write(1000)
    checkpoint_id = job.checkpoint()
    target = join(elsewhere.url, "savepoint-1")
    copy_checkpoint(job.storage.fs, job.storage.resolve(checkpoint_id), job.storage.fs, target)
    job.storage.fs.delete(job.storage.layout.job_dir, recursive=True)
    savepoint = load_metadata(job.storage.fs, target)
    assert savepoint.is_savepoint
    assert all(not f.path.startswith("..") for f in savepoint.files())
    assert any(f.path.startswith("shared/") for f in savepoint.files())
    assert restore(job.storage.fs, target, 2, Path("unused")) == job.models[checkpoint_id]
    assert verify_checkpoint(CheckpointRef(job.storage.fs, target, savepoint)) == []


def test_verify_and_restore_catch_a_damaged_shared_file(job: Job) -> None:
    """A flipped byte in a shared SST file: verify names it, restore fails naming it."""
    job.write(3000)
    checkpoint_id = job.checkpoint()
    directory = job.storage.resolve(checkpoint_id)
    ref = CheckpointRef(job.storage.fs, directory, job.storage.load(checkpoint_id))
    assert verify_checkpoint(ref) == []
    (handle,) = handles(job, checkpoint_id)
    damaged = join(job.storage.layout.shared_dir, handle.shared[0].path.rsplit("/", 1)[-1])
    fs = raw_fs(job.location)
    data = bytearray(fs.cat_file(damaged))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(damaged, bytes(data))

    problems = verify_checkpoint(ref)
    assert [p.path for p in problems] == [damaged]
    assert "checksum" in problems[0].message
    with pytest.raises(CheckpointCorruptedError, match=damaged.rsplit("/", 1)[-1]):
        restore(job.storage.fs, directory, 1, Path("unused"))


def test_a_shared_file_far_larger_than_declared_is_refused_without_reading_it_all(
    job: Job,
) -> None:
    """A shared SST file replaced by one many chunks larger than the _metadata declares:
    restore stops reading one chunk past the declared size (it read it all to local disk
    before checking, which a crafted file the size of the disk would fill)."""
    job.write(3000)
    checkpoint_id = job.checkpoint()
    directory = job.storage.resolve(checkpoint_id)
    (handle,) = handles(job, checkpoint_id)
    damaged = join(job.storage.layout.shared_dir, handle.shared[0].path.rsplit("/", 1)[-1])
    fs = raw_fs(job.location)
    extra = 4 * incremental.CHUNK_BYTES
    fs.pipe_file(damaged, fs.cat_file(damaged) + bytes(extra))

    before = job.storage.fs.bytes_read
    with pytest.raises(CheckpointCorruptedError, match="larger than the"):
        restore(job.storage.fs, directory, 1, Path("unused"))
    assert job.storage.fs.bytes_read - before < handle.size + 2 * incremental.CHUNK_BYTES


def edit_inline_file(
    job: Job, checkpoint_id: int, prefix: str, edit: Callable[[dict[str, Any]], None]
) -> str:
    """Apply ``edit`` to the JSON of the first inline private file whose name starts with
    ``prefix`` in checkpoint N's ``_metadata`` (one subtask), written back without the
    document's own checksum (as a release before it wrote it), so that what is checked
    is the inline file's own size and checksum; its name."""
    path = join(job.storage.resolve(checkpoint_id), "_metadata")
    fs = raw_fs(job.location)
    document = json.loads(fs.cat_file(path))
    del document[DOCUMENT_CHECKSUM]
    (ack,) = document["operators"][OPERATOR]["subtasks"]
    file = next(f for f in ack["keyed"]["private"] if f["name"].startswith(prefix))
    edit(file)
    fs.pipe_file(path, json.dumps(document).encode())
    return str(file["name"])


def test_small_private_files_are_inline_and_larger_ones_stored(
    job: Job, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The native checkpoint's private files below INLINE_LIMIT (all of them here) are
    kept in the handle: the checkpoint directory stores none of them, and the handle
    round-trips through JSON. With a limit of 0 they are stored files. Both restore."""
    job.write(3000)
    inline = job.checkpoint()
    monkeypatch.setattr(incremental, "INLINE_LIMIT", 0)
    job.write(1000)
    stored = job.checkpoint()

    (small,) = handles(job, inline)
    assert {f.name for f in small.private} >= {"CURRENT", "rocksdict-config.json"}
    assert all(f.path is None and len(f.inline or b"") == f.size for f in small.private)
    assert all(f.path.startswith("../shared/") for f in job.storage.load(inline).files())
    assert IncrementalKeyedStateHandle.from_json(json.loads(json.dumps(small.to_json()))) == small
    (large,) = handles(job, stored)
    assert all(f.inline is None and f.path for f in large.private)
    private_paths = {f.path for f in job.storage.load(stored).files()} - {
        f.path for f in large.shared
    }
    assert len(private_paths) == len(large.private)
    for checkpoint_id, inline_bytes in ((inline, sum(f.size for f in small.private)), (stored, 0)):
        metadata = job.storage.load(checkpoint_id)
        ref = CheckpointRef(job.storage.fs, job.storage.resolve(checkpoint_id), metadata)
        assert inspect_checkpoint(ref)["inline_bytes"] == inline_bytes
    for checkpoint_id in (inline, stored):
        directory = job.storage.resolve(checkpoint_id)
        restored = restore(job.storage.fs, directory, 2, Path(f"unused-{checkpoint_id}"))
        assert restored == job.models[checkpoint_id]
        rocksdb = restore(job.storage.fs, directory, 1, tmp_path / str(checkpoint_id), "rocksdb")
        assert rocksdb == job.models[checkpoint_id]


def test_verify_and_restore_catch_a_damaged_inline_file(job: Job) -> None:
    """A flipped byte in a private file inline in ``_metadata``: verify names the file
    and the subtask, restore fails naming the file."""
    job.write(3000)
    checkpoint_id = job.checkpoint()

    def flip(file: dict[str, Any]) -> None:
        data = bytearray(base64.b64decode(file["inline"]))
        data[len(data) // 2] ^= 0x01
        file["inline"] = base64.b64encode(bytes(data)).decode()

    name = edit_inline_file(job, checkpoint_id, "OPTIONS", flip)
    directory = job.storage.resolve(checkpoint_id)
    ref = CheckpointRef(job.storage.fs, directory, job.storage.load(checkpoint_id))
    problems = verify_checkpoint(ref)
    assert len(problems) == 1 and name in problems[0].path
    assert f"{OPERATOR} subtask 0" in problems[0].path and "checksum" in problems[0].message
    with pytest.raises(CheckpointCorruptedError, match=name):
        restore(job.storage.fs, directory, 1, Path("unused"))


def test_an_inline_file_of_the_wrong_size_is_refused_on_load(job: Job) -> None:
    """``_metadata`` whose inline file is not as long as its size: a clear load error."""
    job.write(500)
    checkpoint_id = job.checkpoint()

    def grow(file: dict[str, Any]) -> None:
        file["size"] += 1

    edit_inline_file(job, checkpoint_id, "CURRENT", grow)
    with pytest.raises(CheckpointCorruptedError, match="inline file CURRENT has"):
        job.storage.load(checkpoint_id)


def test_gc_lists_only_unreferenced_shared_files(job: Job) -> None:
    """gc never lists a shared file a retained checkpoint references; it lists a stray one
    written before the newest checkpoint was triggered (see also tests/s3/test_gc.py)."""
    for _ in range(2):
        job.write(2000)
        job.checkpoint()
    stray = join(job.storage.layout.shared_dir, "op-0-stray-000001.sst")
    job.storage.fs.write_atomic(stray, b"left behind by a crashed upload")
    time.sleep(1.1 if get_protocol(job.location.url) == "s3" else 0.02)  # s3: whole seconds
    job.write(2000)
    job.checkpoint()
    garbage = find_garbage(job.storage.fs, job.storage.layout.job_dir, grace_seconds=0)
    assert [g.path for g in garbage] == [stray]
    assert "shared file" in garbage[0].reason


# -- task attempts ---------------------------------------------------------------------------


class LookupCountingFileSystem(CheckpointFileSystem):
    """``CheckpointFileSystem`` counting the existence checks of shared files."""

    def __init__(self, location: Storage) -> None:
        super().__init__(raw_fs(location))
        self.shared_lookups = 0

    def exists(self, path: str) -> bool:
        """``CheckpointFileSystem.exists``, counted for paths in ``shared/``."""
        self.shared_lookups += "/shared/" in path
        return super().exists(path)


def fill(backend: RocksDBKeyedStateBackend, model: Model) -> None:
    """Write ``model`` into a backend."""
    count = cast(ValueState, backend.get_state(COUNT))
    tags = cast(MapState, backend.get_state(TAGS))
    for key, (value, key_tags) in model.items():
        backend.set_current_key(key)
        if value is not None:
            count.update(value)
        for tag, tag_value in key_tags.items():
            tags.put(tag, tag_value)


def ack_of(job: Job, handle: Any, attempt: str) -> SubtaskAck:
    """Subtask 0's acknowledgement, by task attempt ``attempt``, of ``handle``."""
    return SubtaskAck(OPERATOR, 0, 1, handle, None, job.coordinator.run_id, attempt)


def two_attempts(job: Job, local: Path) -> tuple[RocksDBKeyedStateBackend, Any]:
    """Two attempts of subtask 0 ("a": the job's backend; "b": a copy of its state in
    ``local``) both snapshot checkpoint K, each uploading its own shared files; K takes
    a's ack and deletes b's shared files. Returns b's backend (with the job's, disposed
    with the job) and b's handle of K."""
    first = job.backends[0]
    second = RocksDBKeyedStateBackend(
        local,
        max_parallelism=M,
        key_group_range=compute_key_group_range_for_operator_index(M, 1, 0),
    )
    job.backends.append(second)
    fill(second, job.model)
    assert read_model(second) == read_model(first) == job.model

    k = job.coordinator.trigger({OPERATOR: 1})
    run = job.coordinator.run_id
    by_attempt = {
        attempt: backend.snapshot(
            k, job.storage.snapshot_target(k, OPERATOR, 0, run, attempt)
        ).result(WAIT)
        for attempt, backend in (("a", first), ("b", second))
    }
    for attempt, handle in by_attempt.items():
        job.storage.write_ack(k, ack_of(job, handle, attempt))
    assert job.coordinator.poll(k) is not None
    (taken,) = job.storage.load(k).operators[OPERATOR].subtasks
    assert taken.attempt == "a"  # the first ack read (acks are read in name order)
    deleted = {f.path.rsplit("/", 1)[-1] for f in by_attempt["b"].shared}
    assert deleted and not deleted & shared_names(job)
    return second, by_attempt["b"]


def test_a_later_checkpoint_never_reuses_the_files_of_an_attempt_not_taken(
    job: Job, tmp_path: Path
) -> None:
    """After ``two_attempts``, the next checkpoint M, from b's local copy (e.g. the retried
    attempt committed it) with more writes, references only files that exist (it uploads
    b's SSTs again) and restores to the model."""
    job.write(3000)
    second, _ = two_attempts(job, tmp_path / "attempt-b")
    extra = {f"key-b{i}": (i, {}) for i in range(50)}
    fill(second, extra)
    job.model.update(extra)
    later = job.coordinator.trigger({OPERATOR: 1})
    target = job.storage.snapshot_target(later, OPERATOR, 0, job.coordinator.run_id, "c")
    handle = second.snapshot(later, target).result(WAIT)
    job.storage.write_ack(later, ack_of(job, handle, "c"))
    assert job.coordinator.poll(later) is not None

    directory = job.storage.resolve(later)
    referenced = [resolve_path(directory, f.path) for f in job.storage.load(later).files()]
    assert referenced and [p for p in referenced if not job.storage.fs.exists(p)] == []
    assert restore(job.storage.fs, directory, 2, tmp_path / "restored") == job.model


def test_the_files_a_completed_checkpoint_holds_are_read_once(job: Job) -> None:
    """``completed_files``: None for a pending checkpoint; a completed one's ``_metadata``
    is read at the first call only (each incremental snapshot asks for it)."""
    job.write(100)
    pending = job.coordinator.trigger({OPERATOR: 1})
    assert job.storage.completed_files(pending) is None
    job.coordinator.abort(pending)
    completed = job.checkpoint()
    fs = job.storage.fs
    before = fs.bytes_read
    held = job.storage.completed_files(completed)
    assert held == {f.path for f in job.storage.load(completed).files()}
    after = fs.bytes_read
    assert after > before
    assert job.storage.completed_files(completed) == held
    assert fs.bytes_read == after


def test_a_checkpoint_referencing_deleted_shared_files_is_aborted(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """Checkpoints that reuse the newest one's shared files and upload the rest look up
    no shared file on completion. After ``two_attempts``, an ack of M by attempt "c"
    referencing b's deleted files (as a snapshot trusting b's upload record would) makes
    M fail and be aborted, not complete; the next checkpoint completes and restores."""
    fs = LookupCountingFileSystem(checkpoint_url)
    job = new_job(checkpoint_url, tmp_path / "local", fs=fs)
    try:
        job.write(3000)
        job.checkpoint()
        job.write(500)
        job.checkpoint()
        assert fs.shared_lookups == 0

        second, stale = two_attempts(job, tmp_path / "attempt-b")
        later = job.coordinator.trigger({OPERATOR: 1})
        job.storage.write_ack(later, ack_of(job, stale, "c"))
        with pytest.raises(CheckpointError, match="references shared files that were deleted"):
            job.coordinator.poll(later)
        assert not job.storage.is_completed(later)
        assert later not in job.coordinator.pending

        job.backends.remove(second)
        second.dispose()
        after = job.checkpoint()
        assert restore(fs, job.storage.resolve(after), 1, tmp_path) == job.models[after]
    finally:
        job.close()


def test_a_late_ack_deletes_the_files_its_snapshot_uploaded(job: Job, tmp_path: Path) -> None:
    """An upload that finishes after its checkpoint was aborted: ``write_ack`` writes no
    ack and deletes the shared files that snapshot uploaded itself (nothing can reference
    them), not those it reuses from the completed checkpoint before, which still
    restores to its model."""
    job.write(3000)
    completed = job.checkpoint()
    job.write(500)
    late = job.coordinator.trigger({OPERATOR: 1})
    target = job.storage.snapshot_target(late, OPERATOR, 0, job.coordinator.run_id, "late")
    handle = job.backends[0].snapshot(late, target).result(WAIT)
    job.coordinator.abort(late)
    ack = ack_of(job, handle, "late")
    directory = job.storage.resolve(late)
    shared = [p for f in ack.files() if "/shared/" in (p := resolve_path(directory, f.path))]
    own = [p for p in shared if "-late-" in p.rpartition("/")[2]]
    reused = [p for p in shared if p not in own]
    assert own and reused, shared
    assert all(job.storage.fs.exists(p) for p in shared)
    assert not job.storage.write_ack(late, ack)
    assert [p for p in own if job.storage.fs.exists(p)] == []
    assert all(job.storage.fs.exists(p) for p in reused)
    assert not job.storage.fs.exists(job.storage.layout.acks_dir(late))
    restored = restore(job.storage.fs, job.storage.resolve(completed), 1, tmp_path / "restored")
    assert restored == job.models[completed]


def test_a_late_ack_without_a_task_attempt_keeps_the_files_it_reuses(
    job: Job, tmp_path: Path
) -> None:
    """The same as the test above, by a subtask acknowledging without a task attempt
    (``attempt=None``, as ``Job.checkpoint`` and the README do): the late ack deletes only
    the files its own snapshot uploaded, not the shared SSTs the same subtask uploaded for
    the completed checkpoint and the late snapshot reuses (without the checkpoint id in
    the files' names, ``written_by`` took those for its own)."""
    job.write(3000)
    completed = job.checkpoint()
    job.write(500)
    late = job.coordinator.trigger({OPERATOR: 1})
    target = job.storage.snapshot_target(late, OPERATOR, 0, job.coordinator.run_id)
    handle = job.backends[0].snapshot(late, target).result(WAIT)
    job.coordinator.abort(late)
    ack = SubtaskAck(OPERATOR, 0, 1, handle, None, job.coordinator.run_id)
    held = job.storage.load(completed).files()
    directory = job.storage.resolve(completed)
    held_shared = [p for f in held if "/shared/" in (p := resolve_path(directory, f.path))]
    assert held_shared and all(job.storage.fs.exists(p) for p in held_shared)
    assert not job.storage.write_ack(late, ack)
    assert [p for p in held_shared if not job.storage.fs.exists(p)] == []
    restored = restore(job.storage.fs, job.storage.resolve(completed), 1, tmp_path / "restored")
    assert restored == job.models[completed]


def test_after_a_late_ack_without_a_task_attempt_the_next_checkpoint_restores(
    job: Job, tmp_path: Path
) -> None:
    """After such a late ack, the next checkpoint (which reuses the completed one's SSTs
    and is not checked for them: ``registry.reused_by`` trusts the subtask's own names)
    references no missing file and restores."""
    job.write(3000)
    job.checkpoint()
    job.write(500)
    late = job.coordinator.trigger({OPERATOR: 1})
    target = job.storage.snapshot_target(late, OPERATOR, 0, job.coordinator.run_id)
    handle = job.backends[0].snapshot(late, target).result(WAIT)
    job.coordinator.abort(late)
    job.storage.write_ack(late, SubtaskAck(OPERATOR, 0, 1, handle, None, job.coordinator.run_id))
    after = job.checkpoint()  # completes: nothing noticed
    directory = job.storage.resolve(after)
    referenced = [resolve_path(directory, f.path) for f in job.storage.load(after).files()]
    assert [p for p in referenced if not job.storage.fs.exists(p)] == []
    assert restore(job.storage.fs, directory, 1, tmp_path / "restored") == job.models[after]
