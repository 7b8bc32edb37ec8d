"""One state stored with different value serializers by the subtasks of one checkpoint or
batch, restored or rebuilt at another parallelism.

A subtask takes a serializer change (int -> float here) when it registers the state; one
that had no key for it since keeps the old serializer in its snapshots and records. A
restore merging such handles read the old subtask's int bytes as floats (7 came back as
3.5e-323, or 7.5 as 4.6e18 the other way round), and a changelog rebuild refused the
batch. Expected values come from a plain-Python model of the updates.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
)
from statebackend.serializers import FloatSerializer, IntSerializer, StrSerializer
from statebackend.state.descriptors import ListStateDescriptor, ValueStateDescriptor

MAX_PARALLELISM = 16
KEYS = [f"k{i}" for i in range(24)]


def new_backend(kind: str, directory: Path, parallelism: int, index: int) -> KeyedStateBackend:
    key_groups = compute_key_group_range_for_operator_index(MAX_PARALLELISM, parallelism, index)
    if kind == "heap":
        return HeapKeyedStateBackend(
            max_parallelism=MAX_PARALLELISM,
            key_group_range=key_groups,
            key_serializer=StrSerializer(),
        )
    return RocksDBKeyedStateBackend(
        tempfile.mkdtemp(dir=directory),
        max_parallelism=MAX_PARALLELISM,
        key_group_range=key_groups,
        key_serializer=StrSerializer(),
    )


def owner(key: str, parallelism: int) -> int:
    group = assign_to_key_group(StrSerializer().serialize(key), MAX_PARALLELISM)
    return next(
        i
        for i in range(parallelism)
        if group in compute_key_group_range_for_operator_index(MAX_PARALLELISM, parallelism, i)
    )


def descriptor(state: str, number: Any) -> Any:
    if state == "value":
        return ValueStateDescriptor("s", number)
    return ListStateDescriptor("s", number)


def write(handle: Any, state: str, value: float) -> None:
    if state == "value":
        handle.update(value)
    else:
        handle.add(value)


def read(handle: Any, state: str) -> Any:
    return handle.value() if state == "value" else list(handle.get())


def read_all_and_dispose(backend: KeyedStateBackend, state: str) -> dict[str, Any]:
    """Every key's value of the state, registered as float, in ``backend`` (then disposed)."""
    handle = backend.get_state(descriptor(state, FloatSerializer()))
    got = {}
    for key in KEYS:
        backend.set_current_key(key)
        got[key] = read(handle, state)
    backend.dispose()
    return got


def expected(upgraded: int, state: str) -> dict[str, Any]:
    """Every key got 7 (int) under the old serializer; the keys of subtask ``upgraded``
    then got 7.5 (float) under the new one, which the other subtask never registered."""
    model: dict[str, Any] = {}
    for key in KEYS:
        if state == "value":
            model[key] = 7.5 if owner(key, 2) == upgraded else 7.0
        else:
            model[key] = [7.0, 7.5] if owner(key, 2) == upgraded else [7.0]
    return model


def run_two_subtasks(
    kind: str, tmp_path: Path, state: str, upgraded: int
) -> list[KeyedStateBackend]:
    """Two subtasks with the int state of every key, then only subtask ``upgraded``
    registers it as float and writes its keys (the other has no key for it)."""
    backends = [new_backend(kind, tmp_path, 2, i) for i in range(2)]
    for index, backend in enumerate(backends):
        handle = backend.get_state(descriptor(state, IntSerializer()))
        for key in KEYS:
            if owner(key, 2) == index:
                backend.set_current_key(key)
                write(handle, state, 7)
    return backends


def checkpoint_and_dispose(
    storage: CheckpointStorage,
    coordinator: CheckpointCoordinator,
    backends: list[KeyedStateBackend],
) -> int:
    """Checkpoint the subtasks ``backends`` of operator "op" (completed once each
    acknowledged), dispose of them, and return the checkpoint's id."""
    checkpoint_id = coordinator.trigger({"op": len(backends)})
    for index, backend in enumerate(backends):
        handle = backend.snapshot(
            checkpoint_id, storage.snapshot_target(checkpoint_id, "op", index)
        )
        ack = SubtaskAck("op", index, len(backends), handle.result(), None, coordinator.run_id)
        coordinator.acknowledge(checkpoint_id, ack)
        backend.dispose()
    return checkpoint_id


@pytest.mark.parametrize("upgraded", [0, 1])
@pytest.mark.parametrize("state", ["value", "list"])
@pytest.mark.parametrize(
    ("kind", "incremental"), [("heap", False), ("rocksdb", False), ("rocksdb", True)]
)
def test_a_checkpoint_of_subtasks_with_different_serializers_restores_at_another_parallelism(
    tmp_path: Path, kind: str, incremental: bool, state: str, upgraded: int
) -> None:
    storage = CheckpointStorage(f"file://{tmp_path}/ck", "job", incremental=incremental)
    coordinator = CheckpointCoordinator(storage, max_parallelism=MAX_PARALLELISM)
    first = run_two_subtasks(kind, tmp_path, state, upgraded)
    checkpoint_id = checkpoint_and_dispose(storage, coordinator, first)
    # Restore each subtask at 2, upgrade only one, checkpoint again: mixed serializers.
    directory = storage.resolve(checkpoint_id)
    metadata = storage.load(checkpoint_id)
    second = [new_backend(kind, tmp_path, 2, i) for i in range(2)]
    for backend in second:
        restore_keyed_state(backend, storage.fs, directory, metadata, "op")
    upgraded_state = second[upgraded].get_state(descriptor(state, FloatSerializer()))
    for key in KEYS:
        if owner(key, 2) == upgraded:
            second[upgraded].set_current_key(key)
            write(upgraded_state, state, 7.5)
    checkpoint_id = checkpoint_and_dispose(storage, coordinator, second)
    metadata = storage.load(checkpoint_id)
    stored = {
        h.states[0].serializers["value"]["identity"]
        for h in metadata.operators["op"].keyed_handles()
    }
    assert stored == {"int", "float"}  # the situation under test

    one = new_backend(kind, tmp_path, 1, 0)
    restore_keyed_state(one, storage.fs, storage.resolve(checkpoint_id), metadata, "op")
    assert read_all_and_dispose(one, state) == expected(upgraded, state)


@pytest.mark.parametrize("upgraded", [0, 1])
@pytest.mark.parametrize("state", ["value", "list"])
@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_a_batch_of_subtasks_with_different_serializers_rebuilds_at_another_parallelism(
    tmp_path: Path, kind: str, state: str, upgraded: int
) -> None:
    changelog = ChangelogStorage(CheckpointStorage(f"file://{tmp_path}/ck", "job"))
    first = [new_backend(kind, tmp_path, 2, i) for i in range(2)]
    for index, backend in enumerate(first):
        backend.enable_changelog()
        handle = backend.get_state(descriptor(state, IntSerializer()))
        for key in KEYS:
            if owner(key, 2) == index:
                backend.set_current_key(key)
                write(handle, state, 7)
    records = [
        changelog.write_record(0, "op", i, "a", backend.drain_changelog())
        for i, backend in enumerate(first)
    ]
    changelog.commit(0, {"op": records}, max_parallelism=MAX_PARALLELISM)
    second = [new_backend(kind, tmp_path, 2, i) for i in range(2)]
    for backend in second:
        rebuild_keyed_state(backend, changelog, changelog.load_manifest(0), "op")
        backend.enable_changelog()
    handle = second[upgraded].get_state(descriptor(state, FloatSerializer()))
    for key in KEYS:
        if owner(key, 2) == upgraded:
            second[upgraded].set_current_key(key)
            write(handle, state, 7.5)
    records = [
        changelog.write_record(1, "op", i, "a", backend.drain_changelog())
        for i, backend in enumerate(second)
    ]
    changelog.commit(1, {"op": records}, max_parallelism=MAX_PARALLELISM)
    for backend in (*first, *second):
        backend.dispose()

    one = new_backend(kind, tmp_path, 1, 0)
    assert one.key_group_range == KeyGroupRange(0, MAX_PARALLELISM - 1)
    rebuild_keyed_state(one, changelog, changelog.load_manifest(1), "op")
    assert read_all_and_dispose(one, state) == expected(upgraded, state)
