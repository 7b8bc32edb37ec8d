"""The serializers of plain Python values: str, int, float, bool, bytes, JSON, pickle and
tuples of them."""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Callable
from typing import Any, ClassVar

from statebackend.serializers.base import (
    LENGTH_PREFIX,
    MIGRATES_FROM_ANY,
    Compatibility,
    Serializer,
    SerializerConfig,
    describe_value,
    serializer_from_config,
)


class StrSerializer(Serializer[str]):
    """UTF-8 text."""

    identity = "str"
    decodes_immutable = True

    def _encode(self, value: str) -> bytes:
        if type(value) is not str and not isinstance(value, str):
            raise TypeError("not a str")
        return value.encode()

    def _decode(self, data: bytes) -> str:
        return str(data, "utf-8")

    def encoder(self) -> Callable[[str], bytes]:
        # Native: str.encode takes exactly the str values (subclasses too), UTF-8.
        return str.encode


_INT = struct.Struct(">q")
_FLOAT = struct.Struct(">d")


def _encode_exact_int(value: int) -> bytes:
    """``IntSerializer``'s encoder: the bytes of an exact int; struct.error out of range
    and TypeError for anything else (int subclasses too: ``serialize`` takes those)."""
    if type(value) is int:
        return _INT.pack(value)
    raise TypeError("not an exact int")


class IntSerializer(Serializer[int]):
    """Signed 64-bit integers, 8 bytes big-endian."""

    identity = "int"
    decodes_immutable = True

    def _encode(self, value: int) -> bytes:
        if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError("not an int")
        if not -(1 << 63) <= value < (1 << 63):
            raise OverflowError("outside the signed 64-bit range")
        return _INT.pack(value)

    def _decode(self, data: bytes) -> int:
        return _INT.unpack(data)[0]  # "q" unpacks an int

    def encoder(self) -> Callable[[int], bytes]:
        return _encode_exact_int


class FloatSerializer(Serializer[float]):
    """IEEE-754 doubles, 8 bytes big-endian; takes over state stored as int."""

    identity = "float"
    migrates_from = frozenset({"int"})
    decodes_immutable = True

    def _encode(self, value: float) -> bytes:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError("not a float")
        return _FLOAT.pack(float(value))

    def _decode(self, data: bytes) -> float:
        return float(_FLOAT.unpack(data)[0])


class BoolSerializer(Serializer[bool]):
    """One byte, 0 or 1."""

    identity = "bool"
    decodes_immutable = True

    def _encode(self, value: bool) -> bytes:
        if not isinstance(value, bool):
            raise TypeError("not a bool")
        return b"\x01" if value else b"\x00"

    def _decode(self, data: bytes) -> bool:
        if bytes(data) not in (b"\x00", b"\x01"):
            raise ValueError("not a bool byte")
        return data == b"\x01"


class BytesSerializer(Serializer[bytes]):
    """Bytes as they are."""

    identity = "bytes"
    decodes_immutable = True

    def _encode(self, value: bytes) -> bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError("not bytes")
        return bytes(value)

    def _decode(self, data: bytes) -> bytes:
        return bytes(data)


def _check_round_trips(value: Any) -> None:
    """TypeError for what JSON would turn into something else: a tuple (read back as a
    list) or a dict key that is not a str (read back as text), at any depth."""
    if isinstance(value, tuple):
        raise TypeError(
            f"{describe_value(value)} is a tuple, which JSON reads back as a list: give a "
            "list, or use TupleSerializer or PickleSerializer to keep tuples"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"dict key {describe_value(key)} of type {type(key).__name__} is not a str, "
                    "which JSON reads back as text: use str keys, or PickleSerializer"
                )
            _check_round_trips(item)
    elif isinstance(value, list):
        for item in value:
            _check_round_trips(item)


class JsonSerializer(Serializer[Any]):
    """JSON-able values (dict keys sorted, so equal values have equal bytes) that read back
    equal: tuples and dict keys other than str are refused, not turned into lists and
    text."""

    identity = "json"
    migrates_from = frozenset({"str", "int", "float", "bool"})

    def _encode(self, value: Any) -> bytes:
        _check_round_trips(value)
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")

    def _decode(self, data: bytes) -> Any:
        return json.loads(bytes(data))


class PickleSerializer(Serializer[Any]):
    """Any picklable Python object (pickle protocol 5); takes over any stored serializer.

    Unpickling runs code the bytes name: never decode pickled state of a checkpoint that
    others can write to (see ``reading_serializer`` and ``checkpoint/signing.py``).
    """

    identity = "pickle"
    migrates_from = MIGRATES_FROM_ANY
    PROTOCOL: ClassVar[int] = 5

    def _encode(self, value: Any) -> bytes:
        return pickle.dumps(value, protocol=self.PROTOCOL)

    def _decode(self, data: bytes) -> Any:
        return pickle.loads(data)


class TupleSerializer(Serializer[tuple[Any, ...]]):
    """Fixed-arity tuples, each field with its own serializer, length-prefixed."""

    identity = "tuple"

    def __init__(self, *fields: Serializer[Any]) -> None:
        if not fields:
            raise ValueError("a TupleSerializer needs at least one field serializer")
        self.fields = fields
        self.decodes_immutable = all(field.decodes_immutable for field in fields)

    def _encode(self, value: tuple[Any, ...]) -> bytes:
        if not isinstance(value, tuple) or len(value) != len(self.fields):
            raise TypeError(f"not a tuple of {len(self.fields)} fields")
        parts = []
        for field, item in zip(self.fields, value, strict=True):
            encoded = field.serialize(item)
            parts.append(LENGTH_PREFIX.pack(len(encoded)))
            parts.append(encoded)
        return b"".join(parts)

    def _decode(self, data: bytes) -> tuple[Any, ...]:
        view, position, items = memoryview(data), 0, []
        for field in self.fields:
            (length,) = LENGTH_PREFIX.unpack_from(view, position)
            position += LENGTH_PREFIX.size
            items.append(field.deserialize(bytes(view[position : position + length])))
            position += length
        if position != len(view):
            raise ValueError("trailing bytes after the last field")
        return tuple(items)

    def config(self) -> SerializerConfig:
        return {**super().config(), "fields": [field.config() for field in self.fields]}

    def compatibility_with(self, stored: SerializerConfig) -> Compatibility:
        stored_fields = stored.get("fields")
        if stored.get("identity") != self.identity or not isinstance(stored_fields, list):
            return super().compatibility_with(stored)
        if len(stored_fields) != len(self.fields):
            return Compatibility.INCOMPATIBLE
        results = {f.compatibility_with(s) for f, s in zip(self.fields, stored_fields, strict=True)}
        for worst in (Compatibility.INCOMPATIBLE, Compatibility.COMPATIBLE_AFTER_MIGRATION):
            if worst in results:
                return worst
        return Compatibility.COMPATIBLE_AS_IS

    @classmethod
    def from_config(cls, config: SerializerConfig) -> TupleSerializer:
        return cls(*(serializer_from_config(field) for field in config.get("fields", [])))

    def migration_loses(self, stored: SerializerConfig) -> bool:
        fields = stored.get("fields") if stored.get("identity") == self.identity else None
        if not isinstance(fields, list) or len(fields) != len(self.fields):
            return False
        return any(f.migration_loses(c) for f, c in zip(self.fields, fields, strict=True))

    def migration_reader(self, stored: SerializerConfig) -> Serializer[Any]:
        if stored.get("identity") != self.identity:
            return super().migration_reader(stored)
        fields = zip(self.fields, stored["fields"], strict=True)
        return TupleSerializer(*(field.migration_reader(config) for field, config in fields))

    def __repr__(self) -> str:
        return f"TupleSerializer({', '.join(map(repr, self.fields))})"
