"""The RocksDB restore without puts, at 4 -> 3 and 4 -> 8, of full and incremental
snapshots: full snapshots are written into SST files and ingested, an incremental
snapshot becomes the new database and is clipped with ``delete_range``.

Every key group holds keys, so the first and last key group of every new range and
their neighbours outside it are checked against a plain-Python model. RocksDB's own
memtable counters tell that nothing was put (the fast path did not fall back to puts)
and that the adopted database was clipped.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, cast

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.state.descriptors import MapStateDescriptor, ValueStateDescriptor
from statebackend.state.interfaces import MapState, ValueState

M = 128
OLD_PARALLELISM = 4
OPERATOR = "op"
COUNT = ValueStateDescriptor("count", IntSerializer())
TAGS = MapStateDescriptor("tags", StrSerializer(), IntSerializer())

Model = dict[str, tuple[int | None, dict[str, int]]]
"""key -> (count, tags); keys holding nothing are absent."""


def key_group(key: str) -> int:
    return assign_to_key_group(StrSerializer().serialize(key), M)


def fill(backends: list[RocksDBKeyedStateBackend], keys: int, seed: int) -> Model:
    """Counts for every key, tags for every other one, in the backend owning its key
    group; the same in the model."""
    rng = random.Random(seed)
    model: Model = {}
    for n in range(keys):
        key = f"key-{n}"
        backend = backends[compute_operator_index_for_key_group(M, len(backends), key_group(key))]
        backend.set_current_key(key)
        count = rng.randrange(1_000_000)
        cast(ValueState, backend.get_state(COUNT)).update(count)
        tags = {f"t{i}": rng.randrange(100) for i in range(n % 2 * rng.randrange(1, 4))}
        map_state = cast(MapState, backend.get_state(TAGS))
        for tag, value in tags.items():
            map_state.put(tag, value)
        model[key] = (count, tags)
    return model


def read_model(backend: KeyedStateBackend) -> Model:
    """What a backend holds, in the model's shape."""
    count = cast(ValueState, backend.get_state(COUNT))
    tags = cast(MapState, backend.get_state(TAGS))
    out: Model = {}
    for key in set(backend.keys("count")) | set(backend.keys("tags")):
        backend.set_current_key(key)
        out[key] = (count.value(), dict(tags.items()))
    return out


def checkpoint(tmp_path: Path, incremental: bool) -> tuple[CheckpointStorage, str, Model]:
    """A completed checkpoint of 4 RocksDB subtasks; its directory and its model."""
    storage = CheckpointStorage(tmp_path.as_uri() + "/checkpoints", "job", incremental=incremental)
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    backends = [
        RocksDBKeyedStateBackend(
            tmp_path / f"old-{i}",
            max_parallelism=M,
            key_group_range=compute_key_group_range_for_operator_index(M, OLD_PARALLELISM, i),
        )
        for i in range(OLD_PARALLELISM)
    ]
    try:
        model = fill(backends, 3000, seed=11)
        checkpoint_id = coordinator.trigger({OPERATOR: OLD_PARALLELISM})
        for i, backend in enumerate(backends):
            handle = backend.snapshot(
                checkpoint_id, storage.snapshot_target(checkpoint_id, OPERATOR, i)
            ).result()
            ack = SubtaskAck(OPERATOR, i, OLD_PARALLELISM, handle, None, coordinator.run_id)
            storage.write_ack(checkpoint_id, ack)
        assert coordinator.poll(checkpoint_id) is not None
    finally:
        for backend in backends:
            backend.dispose()
    assert {key_group(key) for key in model} == set(range(M)), "a key group is empty"
    return storage, storage.resolve(checkpoint_id), model


def entries_in(model: Model, key_groups: KeyGroupRange) -> Model:
    return {k: v for k, v in model.items() if key_group(k) in key_groups}


def memtable_counter(backend: RocksDBKeyedStateBackend) -> int:
    """Entries (puts, deletes, range deletes) in the active memtables of the states."""
    total = 0
    for state in ("count", "tags"):
        column: Any = backend._columns[state]
        total += int(column.property_int_value("rocksdb.num-entries-active-mem-table") or 0)
    return total


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
@pytest.mark.parametrize("new_parallelism", [3, 8])
def test_rescaled_restore_loads_exactly_its_key_groups_without_puts(
    tmp_path: Path, incremental: bool, new_parallelism: int
) -> None:
    storage, directory, model = checkpoint(tmp_path, incremental)
    metadata: CheckpointMetadata = storage.load(directory)
    restored: Model = {}
    for i in range(new_parallelism):
        key_groups = compute_key_group_range_for_operator_index(M, new_parallelism, i)
        backend = RocksDBKeyedStateBackend(
            tmp_path / f"new-{new_parallelism}-{i}", max_parallelism=M, key_group_range=key_groups
        )
        try:
            copied = restore_keyed_state(backend, storage.fs, directory, metadata, OPERATOR)
            # Nothing was put: the memtables hold at most the clipping range deletes
            # (two per state; flushed when an SST file ingested after them overlaps).
            in_memtables = memtable_counter(backend)
            assert in_memtables in ((0, 4) if incremental else (0,))
            old = [
                s
                for s in range(OLD_PARALLELISM)
                if compute_key_group_range_for_operator_index(M, OLD_PARALLELISM, s).intersection(
                    key_groups
                )
            ]
            expected = entries_in(model, key_groups)
            entries = sum(1 + len(tags) for _, tags in expected.values())
            if incremental:
                # One old subtask's database became this one, clipped by delete_range;
                # a second one (4 -> 3) was copied through SST files.
                assert in_memtables == 4 or len(old) == 2
                assert (copied == 0) == (len(old) == 1)
                assert copied < entries
            else:
                assert copied == entries
            part = read_model(backend)
        finally:
            backend.dispose()
        assert part == expected
        # The border key groups and their neighbours: inside present, outside absent.
        groups = {key_group(key) for key in part}
        assert {key_groups.start, key_groups.end} <= groups
        assert not groups & {key_groups.start - 1, key_groups.end + 1}
        restored.update(part)
    assert restored == model
    storage.close()


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_heap_restore_of_the_same_checkpoint_matches(tmp_path: Path, incremental: bool) -> None:
    storage, directory, model = checkpoint(tmp_path, incremental)
    metadata = storage.load(directory)
    key_groups = compute_key_group_range_for_operator_index(M, 3, 1)
    backend = HeapKeyedStateBackend(max_parallelism=M, key_group_range=key_groups)
    restore_keyed_state(backend, storage.fs, directory, metadata, OPERATOR)
    assert read_model(backend) == entries_in(model, key_groups)
    backend.dispose()
    storage.close()
