"""statebackend: Flink's RocksDB state backend for PySpark jobs.

The names a library user needs, importable from here: the state descriptors and TTL, the
keyed backends (RocksDB and heap), operator state with its user-function protocols, the
serializers and the error hierarchy. The Spark runtime is ``statebackend.spark``.
"""

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
