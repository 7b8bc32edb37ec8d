"""statebackend: Flink's RocksDB state backend for PySpark jobs.

The names a library user needs, importable from here: the state descriptors and TTL, the
keyed backends (RocksDB and heap), operator state with its user-function protocols, the
serializers and the error hierarchy. The Spark runtime is ``statebackend.spark``.

The names below are imported on first use, as in ``statebackend.spark``: the
``statebackend`` command imports only what it needs, inside ``main``, where a Ctrl-C
while it imports is one line, not a traceback.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from statebackend.backends.heap import HeapKeyedStateBackend
    from statebackend.backends.operator import OperatorStateBackend
    from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
    from statebackend.errors import (
        CheckpointCorruptedError,
        CheckpointError,
        CheckpointNotFoundError,
        ConfigurationError,
        IncompatibleStateError,
        SerializationError,
        StateAccessError,
        StateBackendError,
    )
    from statebackend.serializers import (
        BoolSerializer,
        BytesSerializer,
        FloatSerializer,
        IntSerializer,
        JsonSerializer,
        PickleSerializer,
        Serializer,
        StrSerializer,
        TupleSerializer,
    )
    from statebackend.state.descriptors import (
        AggregatingStateDescriptor,
        ListStateDescriptor,
        MapStateDescriptor,
        ReducingStateDescriptor,
        ValueStateDescriptor,
    )
    from statebackend.state.functions import CheckpointedFunction, ListCheckpointed
    from statebackend.state.ttl import StateTtlConfig

_HOMES = {
    "AggregatingStateDescriptor": "statebackend.state.descriptors",
    "BoolSerializer": "statebackend.serializers",
    "BytesSerializer": "statebackend.serializers",
    "CheckpointCorruptedError": "statebackend.errors",
    "CheckpointError": "statebackend.errors",
    "CheckpointNotFoundError": "statebackend.errors",
    "CheckpointedFunction": "statebackend.state.functions",
    "ConfigurationError": "statebackend.errors",
    "FloatSerializer": "statebackend.serializers",
    "HeapKeyedStateBackend": "statebackend.backends.heap",
    "IncompatibleStateError": "statebackend.errors",
    "IntSerializer": "statebackend.serializers",
    "JsonSerializer": "statebackend.serializers",
    "ListCheckpointed": "statebackend.state.functions",
    "ListStateDescriptor": "statebackend.state.descriptors",
    "MapStateDescriptor": "statebackend.state.descriptors",
    "OperatorStateBackend": "statebackend.backends.operator",
    "PickleSerializer": "statebackend.serializers",
    "ReducingStateDescriptor": "statebackend.state.descriptors",
    "RocksDBKeyedStateBackend": "statebackend.backends.rocksdb",
    "SerializationError": "statebackend.errors",
    "Serializer": "statebackend.serializers",
    "StateAccessError": "statebackend.errors",
    "StateBackendError": "statebackend.errors",
    "StateTtlConfig": "statebackend.state.ttl",
    "StrSerializer": "statebackend.serializers",
    "TupleSerializer": "statebackend.serializers",
    "ValueStateDescriptor": "statebackend.state.descriptors",
}

__all__ = [
    "AggregatingStateDescriptor",
    "BoolSerializer",
    "BytesSerializer",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointedFunction",
    "ConfigurationError",
    "FloatSerializer",
    "HeapKeyedStateBackend",
    "IncompatibleStateError",
    "IntSerializer",
    "JsonSerializer",
    "ListCheckpointed",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "OperatorStateBackend",
    "PickleSerializer",
    "ReducingStateDescriptor",
    "RocksDBKeyedStateBackend",
    "SerializationError",
    "Serializer",
    "StateAccessError",
    "StateBackendError",
    "StateTtlConfig",
    "StrSerializer",
    "TupleSerializer",
    "ValueStateDescriptor",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'statebackend' has no attribute {name!r}")
    return getattr(import_module(home), name)
