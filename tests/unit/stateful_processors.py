"""Test helpers for StatefulProcessor tests without a JVM: keyed backends keyed by tuples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyspark.sql.types import StringType, StructField, StructType

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.processor_handle import BatchClock

KEY_SCHEMA = StructType([StructField("user", StringType())])
MAX_PARALLELISM = 128


def make_backend(kind: str, directory: Path, clock: BatchClock) -> KeyedStateBackend:
    """A backend owning every key group, keyed by 1-tuples of a string column."""
    options: dict[str, Any] = {
        "max_parallelism": MAX_PARALLELISM,
        "key_group_range": KeyGroupRange(0, MAX_PARALLELISM - 1),
        "key_serializer": RowTupleSerializer(KEY_SCHEMA.json()),
        "clock": clock,
    }
    if kind == "heap":
        return HeapKeyedStateBackend(**options)
    return RocksDBKeyedStateBackend(directory, open_existing=True, **options)
