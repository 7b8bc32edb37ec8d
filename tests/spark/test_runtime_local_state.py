"""Executor-local state without Spark: RocksDB reopen and the version marker protocol."""

from __future__ import annotations

from pathlib import Path

import pytest

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import IncompatibleStateError
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.spark.local_state import LocalKeyedState, LocalVersion, StaleLocalStateError
from statebackend.state.descriptors import MapStateDescriptor, ValueStateDescriptor
from statebackend.state.interfaces import MapState, ValueState

COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)
ALL = KeyGroupRange(0, 127)


def test_rocksdb_close_and_open_existing(tmp_path: Path) -> None:
    backend = RocksDBKeyedStateBackend(tmp_path / "db", max_parallelism=128, key_group_range=ALL)
    count = backend.get_state(COUNT)
    tags = backend.get_state(MapStateDescriptor("tags", StrSerializer(), IntSerializer()))
    assert isinstance(count, ValueState) and isinstance(tags, MapState)
    for key in ("a", "b"):
        backend.set_current_key(key)
        count.update(len(key) + 1)
        tags.put("x", 1)
    backend.close()
    reopened = RocksDBKeyedStateBackend(
        tmp_path / "db", open_existing=True, max_parallelism=128, key_group_range=ALL
    )
    count = reopened.get_state(COUNT)
    assert isinstance(count, ValueState)
    reopened.set_current_key("b")
    assert count.value() == 2
    assert sorted(reopened.keys("tags")) == ["a", "b"]  # carried although not registered
    reopened.close()
    with pytest.raises(IncompatibleStateError, match="key_group_range"):
        RocksDBKeyedStateBackend(
            tmp_path / "db",
            open_existing=True,
            max_parallelism=128,
            key_group_range=KeyGroupRange(0, 63),
        )


def test_marker_reuse_and_stale(tmp_path: Path) -> None:
    storage = CheckpointStorage(tmp_path.as_uri(), "job")

    def local(previous: int | None, generation: str = "g1") -> LocalKeyedState:
        version = LocalVersion(generation, previous, None, 1, 128)
        return LocalKeyedState(tmp_path / "local", 0, version, storage, "op", StrSerializer())

    with local(None) as state:
        assert state.backend is not None and not state.reused
        state.backend.set_current_key("k")
        count = state.backend.get_state(COUNT)
        assert isinstance(count, ValueState)
        count.update(5)
        state.commit(0)
    with local(0) as state:
        assert state.reused and state.restored_bytes == 0
        state.commit(1)
    with pytest.raises(StaleLocalStateError):  # another generation
        local(1, "g2").__enter__()
    with pytest.raises(RuntimeError), local(1) as state:  # a task failing midway ...
        raise RuntimeError("boom")
    with pytest.raises(StaleLocalStateError):  # ... leaves no current copy behind
        local(1).__enter__()
