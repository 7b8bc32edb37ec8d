"""``spark.statebackend.rocksdb.memory``: one block cache and write-buffer manager that
every RocksDB of a process shares, and the setting that sizes them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from statebackend.backends import rocksdb
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend, memory_limit, set_memory_limit
from statebackend.errors import ConfigurationError
from statebackend.keygroups import compute_key_group_range_for_operator_index
from statebackend.serializers import BytesSerializer
from statebackend.spark.conf import DEFAULT_ROCKSDB_MEMORY, StateBackendConf
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState

MB = 1 << 20


@pytest.fixture
def limit_restored() -> Iterator[None]:
    saved = memory_limit()
    yield
    set_memory_limit(saved)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512m", 512 * MB),
        ("2g", 2048 * MB),
        ("1048576", MB),
        ("64M", 64 * MB),
        ("unbounded", None),
        # Spark's size strings (spark.executor.memory, JavaUtils.byteStringAsBytes)
        ("512mb", 512 * MB),
        ("1GB", 1024 * MB),
        ("2048kb", 2 * MB),
        ("1t", 1024 * 1024 * MB),
        ("1048576b", MB),
    ],
)
def test_the_setting_takes_sizes_with_units(text: str, expected: int | None) -> None:
    conf = StateBackendConf.from_pairs([("spark.statebackend.rocksdb.memory", text)])
    assert conf.rocksdb_memory == expected
    assert StateBackendConf().rocksdb_memory == DEFAULT_ROCKSDB_MEMORY


@pytest.mark.parametrize(
    "text", ["", "lots", "-1g", "0", "512x", "1000", "1.5g", "512 m", "1_024m", "m", "1gib"]
)
def test_the_setting_rejects_what_is_no_size(text: str) -> None:
    with pytest.raises(ConfigurationError, match="rocksdb.memory=.*at least 1m"):
        StateBackendConf.from_pairs([("spark.statebackend.rocksdb.memory", text)])


def test_databases_of_a_process_share_one_bounded_budget(
    tmp_path: Path, limit_restored: None
) -> None:
    set_memory_limit(8 * MB)
    shared = rocksdb._shared_memory
    assert shared is not None
    state = ValueStateDescriptor("v", BytesSerializer())
    backends = [
        RocksDBKeyedStateBackend(
            tmp_path / str(i),
            max_parallelism=128,
            key_group_range=compute_key_group_range_for_operator_index(128, 1, 0),
        )
        for i in range(4)
    ]
    value = os.urandom(1000)
    peak = 0
    for n in range(40_000):  # ~40 MB of values: 5x the budget, 10x the memtable share
        backend = backends[n % 4]
        backend.set_current_key(f"key-{n}")
        cast(ValueState, backend.get_state(state)).update(value)
        if n % 1000 == 0:
            peak = max(peak, shared.write_buffers.get_usage())
    for i, backend in enumerate(backends):
        backend.set_current_key(f"key-{i}")
        assert cast(ValueState, backend.get_state(state)).value() == value
        backend.dispose()
    # The memtables of all four databases were flushed at the shared limit, not each at
    # RocksDB's 64 MB default; their memory was charged to the one cache.
    assert 0 < peak <= 4 * MB * 1.2
    assert shared.write_buffers.get_buffer_size() == 4 * MB
    assert shared.cache.get_usage() <= 8 * MB * 1.2
    set_memory_limit(8 * MB)
    assert rocksdb._shared_memory is shared  # the same limit again keeps the budget
