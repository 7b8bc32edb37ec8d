"""Serializers: how keys and values become bytes, and whether stored bytes still fit.

Every serializer has an ``identity`` and a ``version``; its ``config()`` is written into
every snapshot. On restore, ``compatibility_with(stored_config)`` says whether the stored
bytes are readable as they are, readable after migration (decode with the stored
serializer, re-encode with the new one: see ``migrate``), or not at all.

``base`` holds the contract and the registry, ``simple`` the serializers of plain Python
values, ``rows`` the Spark-schema row tuples of transform_with_state, ``opaque`` the
reading of stored state without unpickling.
"""

from statebackend.serializers.base import (
    Compatibility,
    Serializer,
    SerializerConfig,
    migrate,
    register_serializer,
    resolve_serializer,
    serializer_from_config,
)
from statebackend.serializers.opaque import OpaqueSerializer, OpaqueValue, reading_serializer
from statebackend.serializers.rows import RowTupleSerializer
from statebackend.serializers.simple import (
    BoolSerializer,
    BytesSerializer,
    FloatSerializer,
    IntSerializer,
    JsonSerializer,
    PickleSerializer,
    StrSerializer,
    TupleSerializer,
)

for _builtin in (
    StrSerializer,
    IntSerializer,
    FloatSerializer,
    BoolSerializer,
    BytesSerializer,
    JsonSerializer,
    PickleSerializer,
    TupleSerializer,
    RowTupleSerializer,
    OpaqueSerializer,
):
    register_serializer(_builtin)

__all__ = [
    "BoolSerializer",
    "BytesSerializer",
    "Compatibility",
    "FloatSerializer",
    "IntSerializer",
    "JsonSerializer",
    "OpaqueSerializer",
    "OpaqueValue",
    "PickleSerializer",
    "RowTupleSerializer",
    "Serializer",
    "SerializerConfig",
    "StrSerializer",
    "TupleSerializer",
    "migrate",
    "reading_serializer",
    "register_serializer",
    "resolve_serializer",
    "serializer_from_config",
]
