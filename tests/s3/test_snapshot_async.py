"""The asynchronous part of a snapshot, on file:// and s3://.

The upload is slowed or stopped by a real ``CheckpointFileSystem`` subclass whose
``write_file`` holds the chunk stream at a gate, or fails it after N bytes; everything
else (backends, cut, encoding, storage, coordinator, restore) is the real code.
Expectations come from plain-Python models of the state.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast
from unittest.mock import ANY

import boto3
import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import CheckpointFileSystem, WrittenFile
from statebackend.checkpoint.layout import PENDING_FILE
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state, restore_operator_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import (
    CheckpointCancelledError,
    CheckpointError,
    CheckpointNotFoundError,
)
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import BytesSerializer, IntSerializer, StrSerializer
from statebackend.snapshot.future import SnapshotFuture
from statebackend.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)
from statebackend.state.interfaces import ListState, MapState, ValueState
from tests.conftest import Storage, raw_fs

M = 128
OPERATOR = "agg"
WAIT = 20.0

COUNT = ValueStateDescriptor("count", IntSerializer())
SEEN = ListStateDescriptor("seen", IntSerializer())
TAGS = MapStateDescriptor("tags", StrSerializer(), IntSerializer())
BLOB = ValueStateDescriptor("blob", BytesSerializer())


class InjectedFailure(OSError):
    """The failure the test storage raises part-way through a write."""


class GatedFileSystem(CheckpointFileSystem):
    """A checkpoint file system whose writes can be held or failed part-way.

    Once ``hold_after`` bytes of a file went through, ``write_file`` waits for ``gate``
    before each further chunk (``holding`` is set then); ``delay`` seconds pass between
    chunks; after ``fail_after`` bytes the chunk stream raises InjectedFailure.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any],
        *,
        hold_after: int | None = None,
        fail_after: int | None = None,
        delay: float = 0.0,
    ) -> None:
        super().__init__(raw_fs(Storage(url, storage_options)))
        self.hold_after = hold_after
        self.fail_after = fail_after
        self.delay = delay
        self.gate = threading.Event()
        self.holding = threading.Event()
        self.chunks_passed = 0

    def _slowed(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        passed = 0
        for chunk in chunks:
            if self.hold_after is not None and passed >= self.hold_after:
                self.holding.set()
                if not self.gate.wait(WAIT):
                    raise AssertionError("the test never opened the gate")
            if self.fail_after is not None and passed + len(chunk) > self.fail_after:
                raise InjectedFailure(f"injected failure after {passed} bytes")
            if self.delay:
                time.sleep(self.delay)
            passed += len(chunk)
            self.chunks_passed += 1
            yield chunk

    def write_file(
        self,
        path: str,
        chunks: Iterable[bytes],
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> WrittenFile:
        """``CheckpointFileSystem.write_file`` over the held / failing chunk stream."""
        return super().write_file(path, self._slowed(chunks), should_stop=should_stop)


def make_storage(location: Storage, fs: CheckpointFileSystem | None = None) -> CheckpointStorage:
    """Checkpoint storage of job ``job`` at ``location`` (through ``fs`` if given)."""
    return CheckpointStorage(
        location.url, "job", storage_options=location.storage_options, filesystem=fs
    )


def make_backend(kind: str, local_dir: Path) -> KeyedStateBackend:
    """A backend owning all key groups."""
    if kind == "rocksdb":
        return RocksDBKeyedStateBackend(
            local_dir, max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1)
        )
    return HeapKeyedStateBackend(max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1))


Model = dict[str, dict[str, Any]]


def write_state(backend: KeyedStateBackend, model: Model, rng: random.Random, n: int) -> None:
    """``n`` random writes over 400 keys, mirrored in ``model`` (key -> state -> value)."""
    count = cast(ValueState, backend.get_state(COUNT))
    seen = cast(ListState, backend.get_state(SEEN))
    tags = cast(MapState, backend.get_state(TAGS))
    for _ in range(n):
        key = f"k{rng.randrange(400)}"
        backend.set_current_key(key)
        entry = model.setdefault(key, {})
        op = rng.randrange(4)
        value = rng.randrange(10_000)
        if op == 0:
            count.update(value)
            entry["count"] = value
        elif op == 1:
            seen.add(value)
            entry["seen"] = [*entry.get("seen", []), value]
        elif op == 2:
            tags.put(f"t{value % 5}", value)
            entry["tags"] = {**entry.get("tags", {}), f"t{value % 5}": value}
        else:
            count.clear()
            entry.pop("count", None)


def read_state(backend: KeyedStateBackend) -> Model:
    """What a backend holds, in the model's shape."""
    count = cast(ValueState, backend.get_state(COUNT))
    seen = cast(ListState, backend.get_state(SEEN))
    tags = cast(MapState, backend.get_state(TAGS))
    out: Model = {}
    keys = set(backend.keys("count")) | set(backend.keys("seen")) | set(backend.keys("tags"))
    for key in keys:
        backend.set_current_key(key)
        entry: dict[str, Any] = {}
        if count.value() is not None:
            entry["count"] = count.value()
        if seen.get():
            entry["seen"] = seen.get()
        if dict(tags.items()):
            entry["tags"] = dict(tags.items())
        out[key] = entry
    return out


def non_empty(model: Model) -> Model:
    """The model without keys that hold nothing."""
    return {key: entry for key, entry in model.items() if entry}


def checkpoint(
    storage: CheckpointStorage,
    coordinator: CheckpointCoordinator,
    backend: KeyedStateBackend,
    operator_state: OperatorStateBackend | None = None,
) -> int:
    """Take and complete a one-subtask checkpoint synchronously; return its id."""
    checkpoint_id = coordinator.trigger({OPERATOR: 1})
    target = storage.snapshot_target(checkpoint_id, OPERATOR, 0)
    keyed = backend.snapshot(checkpoint_id, target)
    ops = target.write_operator_snapshot(
        checkpoint_id, (operator_state or OperatorStateBackend()).sync_cut()
    )
    storage.write_ack(
        checkpoint_id, SubtaskAck(OPERATOR, 0, 1, keyed.result(), ops.result(), coordinator.run_id)
    )
    assert coordinator.poll(checkpoint_id) is not None
    return checkpoint_id


def restored_model(storage: CheckpointStorage, checkpoint_id: int) -> Model:
    """The keyed state of checkpoint ``checkpoint_id`` restored into a fresh heap backend."""
    metadata = storage.load(checkpoint_id)
    backend = make_backend("heap", Path("unused"))
    restore_keyed_state(backend, storage.fs, storage.resolve(checkpoint_id), metadata, OPERATOR)
    return read_state(backend)


def files_of(storage: CheckpointStorage, checkpoint_id: int) -> list[str]:
    """Every file left in checkpoint ``checkpoint_id``'s directory (recursively), but the
    coordinator's pending marker."""
    directory = storage.resolve(checkpoint_id)
    found: list[str] = []
    for name in storage.fs.list_dir(directory):
        if name == PENDING_FILE:
            continue
        below = storage.fs.list_dir(f"{directory}/{name}")
        if below and below != [name]:
            found.extend(f"{name}/{b}" for b in below)
        else:
            found.append(name)
    return found


def multipart_uploads(location: Storage) -> list[Any] | None:
    """Unfinished multipart uploads under an s3:// location (None on file://)."""
    if not location.url.startswith("s3://"):
        return None
    bucket, prefix = location.url[len("s3://") :].split("/", 1)
    client = boto3.client("s3", endpoint_url=location.storage_options["endpoint_url"])
    return list(client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []))


def cut_dirs(local_dir: Path) -> list[str]:
    """Directories the RocksDB backend has under its local dir besides its database."""
    return sorted(p.name for p in local_dir.iterdir() if p.name != "db")


def encode_threads() -> list[threading.Thread]:
    """Live producer threads of keyed snapshots (``snapshot/pipeline.py``)."""
    return [t for t in threading.enumerate() if t.name == "statebackend-encode"]


@pytest.fixture(params=["heap", "rocksdb"])
def kind(request: pytest.FixtureRequest) -> str:
    """The keyed backend under test."""
    return str(request.param)


def test_writes_during_the_upload_are_not_in_the_snapshot(
    checkpoint_url: Storage, kind: str, tmp_path: Path
) -> None:
    """Held mid-upload, the state is rewritten, cleared and extended; the checkpoint still
    holds exactly the state at the cut (keyed and operator state)."""
    fs = GatedFileSystem(
        checkpoint_url.url, checkpoint_url.storage_options, hold_after=1, delay=0.0005
    )
    storage = make_storage(checkpoint_url, fs)
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    backend = make_backend(kind, tmp_path / "db")
    rng = random.Random(7)
    model: Model = {}
    write_state(backend, model, rng, 3000)
    offsets = OperatorStateBackend()
    offsets.get_list_state("offsets", IntSerializer()).add_all([1, 2, 3])

    checkpoint_id = coordinator.trigger({OPERATOR: 1})
    target = storage.snapshot_target(checkpoint_id, OPERATOR, 0)
    keyed = backend.snapshot(checkpoint_id, target)
    ops = target.write_operator_snapshot(checkpoint_id, offsets.sync_cut())
    at_cut = non_empty({k: dict(v) for k, v in model.items()})
    assert fs.holding.wait(WAIT)
    assert not keyed.done()

    # While the upload is held: overwrite, clear, add keys and operator elements.
    write_state(backend, model, rng, 3000)
    for key in list(model)[:50]:
        backend.set_current_key(key)
        for descriptor in (COUNT, SEEN, TAGS):
            backend.get_state(descriptor).clear()
        model[key] = {}
    offsets.get_list_state("offsets", IntSerializer()).update([99])
    assert non_empty(model) != at_cut
    assert read_state(backend) == non_empty(model)
    fs.gate.set()

    storage.write_ack(
        checkpoint_id,
        SubtaskAck(OPERATOR, 0, 1, keyed.result(WAIT), ops.result(), coordinator.run_id),
    )
    assert coordinator.poll(checkpoint_id) is not None
    assert fs.chunks_passed > 1
    assert restored_model(storage, checkpoint_id) == at_cut
    metadata = storage.load(checkpoint_id)
    restored_ops = restore_operator_state(
        storage.fs, storage.resolve(checkpoint_id), metadata, OPERATOR, 0, 1
    )
    assert restored_ops.get_list_state("offsets", IntSerializer()).get() == [1, 2, 3]
    if isinstance(backend, RocksDBKeyedStateBackend):
        assert cut_dirs(backend.local_dir) == []
    backend.dispose()
    storage.close()


def test_cancel_mid_upload_leaves_nothing(
    checkpoint_url: Storage, kind: str, tmp_path: Path
) -> None:
    """cancel() during the upload: CheckpointCancelledError, no file of the checkpoint in
    storage, no multipart upload left on S3, no cut directory left on local disk."""
    big = 6 << 20  # over a 5 MiB s3 block: the upload is a multipart one by then
    options = dict(checkpoint_url.storage_options)
    if checkpoint_url.url.startswith("s3://"):
        options["default_block_size"] = 5 << 20
    fs = GatedFileSystem(checkpoint_url.url, options, hold_after=big)
    storage = make_storage(checkpoint_url, fs)
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    backend = make_backend(kind, tmp_path / "db")
    blob = cast(ValueState, backend.get_state(BLOB))
    rng = random.Random(3)
    for n in range(200):
        backend.set_current_key(f"k{n}")
        blob.update(rng.randbytes(64 * 1024))

    checkpoint_id = coordinator.trigger({OPERATOR: 1})
    future = backend.snapshot(checkpoint_id, storage.snapshot_target(checkpoint_id, OPERATOR, 0))
    assert fs.holding.wait(WAIT)
    if isinstance(backend, RocksDBKeyedStateBackend):
        assert len(cut_dirs(backend.local_dir)) == 1
    assert multipart_uploads(checkpoint_url) in (None, [ANY])  # s3: the upload is under way
    assert future.cancel() is True
    fs.gate.set()
    with pytest.raises(CheckpointCancelledError):
        future.result(WAIT)
    assert future.done()
    assert encode_threads() == []

    assert files_of(storage, checkpoint_id) == []
    if isinstance(backend, RocksDBKeyedStateBackend):
        assert cut_dirs(backend.local_dir) == []
    assert multipart_uploads(checkpoint_url) in (None, [])
    # The job goes on: the next checkpoint completes.
    coordinator.abort(checkpoint_id)
    fs.hold_after = None
    next_id = checkpoint(storage, coordinator, backend)
    assert next_id == checkpoint_id + 1
    restored = make_backend("heap", tmp_path)
    metadata = storage.load(next_id)
    restore_keyed_state(restored, storage.fs, storage.resolve(next_id), metadata, OPERATOR)
    restored.get_state(BLOB)
    assert sorted(restored.keys("blob")) == sorted(f"k{n}" for n in range(200))
    backend.dispose()
    storage.close()


def test_cancel_before_the_upload_starts_releases_the_cut(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """A snapshot queued behind a busy transfer thread, cancelled: it never runs, and its
    RocksDB cut directory is gone at once."""
    fs = GatedFileSystem(checkpoint_url.url, checkpoint_url.storage_options, hold_after=1)
    storage = CheckpointStorage(
        checkpoint_url.url,
        "job",
        storage_options=checkpoint_url.storage_options,
        filesystem=fs,
        transfer_threads=1,
    )
    first = make_backend("rocksdb", tmp_path / "a")
    second = make_backend("rocksdb", tmp_path / "b")
    assert isinstance(first, RocksDBKeyedStateBackend)
    assert isinstance(second, RocksDBKeyedStateBackend)
    model: Model = {}
    write_state(first, model, random.Random(1), 500)
    write_state(second, {}, random.Random(2), 500)
    running = first.snapshot(1, storage.snapshot_target(1, OPERATOR, 0))
    assert fs.holding.wait(WAIT)
    queued = second.snapshot(1, storage.snapshot_target(1, OPERATOR, 1))
    assert len(cut_dirs(second.local_dir)) == 1

    assert queued.cancel() is True
    assert cut_dirs(second.local_dir) == []
    assert queued.done()
    with pytest.raises(CheckpointCancelledError):
        queued.result(0)
    fs.gate.set()
    handle = running.result(WAIT)
    assert handle.size > 0
    assert running.cancel() is False  # already complete
    assert cut_dirs(first.local_dir) == []
    assert [name for name in storage.fs.list_dir(storage.resolve(1))] == [handle.path]
    first.dispose()
    second.dispose()
    storage.close()


def test_failure_in_the_async_part_fails_only_that_checkpoint(
    checkpoint_url: Storage, kind: str, tmp_path: Path
) -> None:
    """A storage that fails after N bytes: that checkpoint's future raises CheckpointError
    with the cause attached, the coordinator aborts it (files deleted), the previous
    checkpoint still restores, and the next checkpoint completes."""
    fs = GatedFileSystem(checkpoint_url.url, checkpoint_url.storage_options)
    storage = make_storage(checkpoint_url, fs)
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    backend = make_backend(kind, tmp_path / "db")
    rng = random.Random(11)
    model: Model = {}
    write_state(backend, model, rng, 2000)
    good = checkpoint(storage, coordinator, backend)
    at_good = non_empty({k: dict(v) for k, v in model.items()})

    write_state(backend, model, rng, 2000)
    fs.fail_after = 3000
    failed = coordinator.trigger({OPERATOR: 1})
    future = backend.snapshot(failed, storage.snapshot_target(failed, OPERATOR, 0))
    with pytest.raises(CheckpointError) as info:
        future.result(WAIT)
    causes = []
    error: BaseException | None = info.value
    while error is not None:
        causes.append(error)
        error = error.__cause__
    assert any(isinstance(c, InjectedFailure) for c in causes), causes
    assert "injected failure" in str(info.value)
    assert not isinstance(info.value, CheckpointCancelledError)
    assert encode_threads() == []
    if isinstance(backend, RocksDBKeyedStateBackend):
        assert cut_dirs(backend.local_dir) == []

    # The failed checkpoint never acknowledges; the coordinator times it out and aborts.
    coordinator.timeout_seconds = 0.0
    time.sleep(0.01)
    with pytest.raises(CheckpointError, match="timed out"):
        coordinator.poll(failed)
    assert failed not in coordinator.pending
    assert files_of(storage, failed) == []
    assert storage.completed_checkpoint_ids() == [good]
    with pytest.raises(CheckpointNotFoundError):
        storage.load(failed)
    assert restored_model(storage, good) == at_good

    # The job goes on: the next checkpoint completes with the current state.
    fs.fail_after = None
    coordinator.timeout_seconds = 600.0
    after = checkpoint(storage, coordinator, backend)
    assert after == failed + 1
    assert restored_model(storage, after) == non_empty(model)
    backend.dispose()
    storage.close()


def test_failure_while_encoding_fails_the_snapshot_and_leaves_nothing(
    checkpoint_url: Storage, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cut's reader fails part-way (frames are encoded on a producer thread): the
    future raises CheckpointError with the cause, the partial file is gone, the producer
    thread has ended, the cut is released once, and the next checkpoint completes."""
    storage = make_storage(checkpoint_url)
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    backend = make_backend(kind, tmp_path / "db")
    model: Model = {}
    write_state(backend, model, random.Random(13), 3000)
    cut = backend.sync_cut()
    view_class = type(cut.views["count"])
    original = view_class.composite_items

    def failing(self: Any, key_group: int) -> Iterator[tuple[bytes, bytes]]:
        if key_group >= M // 2:
            raise InjectedFailure(f"cannot read key group {key_group}")
        yield from original(self, key_group)

    monkeypatch.setattr(view_class, "composite_items", failing)
    releases: list[int] = []
    release = cut._release

    def counted() -> None:
        releases.append(len(encode_threads()))
        if release is not None:
            release()

    cut._release = counted
    checkpoint_id = coordinator.trigger({OPERATOR: 1})
    future = storage.snapshot_target(checkpoint_id, OPERATOR, 0).write_keyed_snapshot(
        checkpoint_id, cut
    )
    with pytest.raises(CheckpointError, match="cannot read key group") as info:
        future.result(WAIT)
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert releases == [0]  # once, after the producer thread ended
    assert encode_threads() == []
    assert files_of(storage, checkpoint_id) == []
    if isinstance(backend, RocksDBKeyedStateBackend):
        assert cut_dirs(backend.local_dir) == []

    monkeypatch.undo()
    coordinator.abort(checkpoint_id)
    after = checkpoint(storage, coordinator, backend)
    assert restored_model(storage, after) == non_empty(model)
    backend.dispose()
    storage.close()


def test_failure_reported_through_done_callback_aborts_at_once(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """A runtime that aborts from the done callback: the failed checkpoint's files are
    gone, the operator-state part that succeeded included."""
    fs = GatedFileSystem(checkpoint_url.url, checkpoint_url.storage_options, fail_after=100)
    storage = make_storage(checkpoint_url, fs)
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    backend = make_backend("heap", tmp_path)
    write_state(backend, {}, random.Random(5), 1000)
    big_ops = OperatorStateBackend()
    big_ops.get_union_list_state("u", BytesSerializer()).add_all([b"x" * 1000] * 30)

    checkpoint_id = coordinator.trigger({OPERATOR: 1})
    target = storage.snapshot_target(checkpoint_id, OPERATOR, 0)
    failures: list[BaseException] = []
    finished = threading.Event()

    def on_done(future: SnapshotFuture[Any]) -> None:
        try:
            future.result()
        except CheckpointError as exc:
            failures.append(exc)
        finished.set()

    # The operator part (30 KB: written as a file, not inline) succeeds before the keyed
    # part is attempted.
    fs.fail_after = None
    ops = target.write_operator_snapshot(checkpoint_id, big_ops.sync_cut())
    assert ops.result(WAIT).path is not None
    fs.fail_after = 100
    keyed = backend.snapshot(checkpoint_id, target)
    keyed.add_done_callback(on_done)
    assert finished.wait(WAIT)
    assert len(failures) == 1
    assert files_of(storage, checkpoint_id) != []
    coordinator.abort(checkpoint_id)
    assert files_of(storage, checkpoint_id) == []
    assert storage.completed_checkpoint_ids() == []
    backend.dispose()
    storage.close()


def test_snapshot_future_done_result_timeout_and_callbacks(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """done() is False and result(timeout) raises TimeoutError while the upload is held;
    callbacks run once with the future when it ends, and at once when added later."""
    fs = GatedFileSystem(checkpoint_url.url, checkpoint_url.storage_options, hold_after=1)
    storage = make_storage(checkpoint_url, fs)
    backend = make_backend("rocksdb", tmp_path / "db")
    write_state(backend, {}, random.Random(9), 1000)
    future = backend.snapshot(1, storage.snapshot_target(1, OPERATOR, 0))
    calls: list[tuple[SnapshotFuture[Any], str]] = []
    future.add_done_callback(lambda f: calls.append((f, threading.current_thread().name)))
    assert fs.holding.wait(WAIT)

    assert not future.done()
    started = time.monotonic()
    with pytest.raises(concurrent.futures.TimeoutError):
        future.result(timeout=0.1)
    assert time.monotonic() - started >= 0.09
    assert calls == []

    fs.gate.set()
    handle = future.result(WAIT)
    assert future.done()
    deadline = time.monotonic() + WAIT
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 1 and calls[0][0] is future
    assert calls[0][1].startswith("statebackend-transfer")
    late: list[SnapshotFuture[Any]] = []
    future.add_done_callback(late.append)
    assert late == [future]
    assert future.result(0) == handle
    assert storage.fs.size(f"{storage.resolve(1)}/{handle.path}") == handle.size
    backend.dispose()
    storage.close()
