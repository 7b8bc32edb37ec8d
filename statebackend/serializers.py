"""Serializers: how keys and values become bytes, and whether stored bytes still fit.

Every serializer has an ``identity`` and a ``version``; its ``config()`` is written into
every snapshot. On restore, ``compatibility_with(stored_config)`` says whether the stored
bytes are readable as they are, readable after migration (decode with the stored
serializer, re-encode with the new one: see ``migrate``), or not at all.
"""

from __future__ import annotations

import base64
import json
import pickle
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Generic, TypeVar

from statebackend.errors import IncompatibleStateError, SerializationError

T = TypeVar("T")

SerializerConfig = dict[str, Any]
"""A serializer's JSON-able description: ``{"identity": ..., "version": ..., ...}``."""


class Compatibility(Enum):
    """How a new serializer relates to the one that wrote stored state."""

    COMPATIBLE_AS_IS = "compatible-as-is"
    COMPATIBLE_AFTER_MIGRATION = "compatible-after-migration"
    INCOMPATIBLE = "incompatible"


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Serializer(ABC, Generic[T]):
    """Encodes values of one kind to bytes and back; the bytes of equal values are equal."""

    identity: ClassVar[str]
    version: ClassVar[int] = 1
    migrates_from: ClassVar[frozenset[str]] = frozenset()
    """Identities of other serializers whose stored bytes this one can take over."""
    migratable_by_any: ClassVar[bool] = True
    """Whether a serializer that takes over any stored state (pickle) may take over this
    one's bytes: False for envelopes such as TTL, whose decoded values are not the user's."""

    def serialize(self, value: T) -> bytes:
        """The bytes of ``value``; SerializationError if this serializer cannot encode it."""
        try:
            return self._encode(value)
        except SerializationError:
            raise
        except Exception as exc:
            raise SerializationError(
                f"{self.identity} serializer cannot encode {_describe(value)} "
                f"(a {type(value).__name__}): {exc}; use a serializer that fits the value"
            ) from exc

    def deserialize(self, data: bytes) -> T:
        """The value encoded in ``data``; SerializationError if the bytes are not one."""
        try:
            return self._decode(data)
        except Exception as exc:
            raise SerializationError(
                f"{self.identity} serializer cannot decode {len(data)} bytes: {exc}"
            ) from exc

    @abstractmethod
    def _encode(self, value: T) -> bytes: ...

    @abstractmethod
    def _decode(self, data: bytes) -> T: ...

    def config(self) -> SerializerConfig:
        """The JSON-able identity, version and parameters written into snapshots."""
        return {"identity": self.identity, "version": self.version}

    def compatibility_with(self, stored: SerializerConfig) -> Compatibility:
        """Whether state written by the serializer described by ``stored`` fits this one."""
        identity, version = stored.get("identity"), stored.get("version", 0)
        if identity == self.identity:
            if version == self.version and stored == self.config():
                return Compatibility.COMPATIBLE_AS_IS
            if isinstance(version, int) and version <= self.version and identity in _REGISTRY:
                return Compatibility.COMPATIBLE_AFTER_MIGRATION
            return Compatibility.INCOMPATIBLE
        if identity in self.migrates_from or (
            self.migrates_from == _ANY
            and identity in _REGISTRY
            and _REGISTRY[str(identity)].migratable_by_any
        ):
            return Compatibility.COMPATIBLE_AFTER_MIGRATION
        return Compatibility.INCOMPATIBLE

    @classmethod
    def from_config(cls, config: SerializerConfig) -> Serializer[Any]:
        """Rebuild this kind of serializer from its ``config()``."""
        return cls()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Serializer) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(json.dumps(self.config(), sort_keys=True))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_ANY = frozenset({"*"})


class StrSerializer(Serializer[str]):
    """UTF-8 text."""

    identity = "str"

    def _encode(self, value: str) -> bytes:
        if not isinstance(value, str):
            raise TypeError("not a str")
        return value.encode("utf-8")

    def _decode(self, data: bytes) -> str:
        return bytes(data).decode("utf-8")


_INT = struct.Struct(">q")
_FLOAT = struct.Struct(">d")


class IntSerializer(Serializer[int]):
    """Signed 64-bit integers, 8 bytes big-endian."""

    identity = "int"

    def _encode(self, value: int) -> bytes:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError("not an int")
        if not -(1 << 63) <= value < (1 << 63):
            raise OverflowError("outside the signed 64-bit range; use PickleSerializer")
        return _INT.pack(value)

    def _decode(self, data: bytes) -> int:
        return int(_INT.unpack(data)[0])


class FloatSerializer(Serializer[float]):
    """IEEE-754 doubles, 8 bytes big-endian; takes over state stored as int."""

    identity = "float"
    migrates_from = frozenset({"int"})

    def _encode(self, value: float) -> bytes:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError("not a float")
        return _FLOAT.pack(float(value))

    def _decode(self, data: bytes) -> float:
        return float(_FLOAT.unpack(data)[0])


class BoolSerializer(Serializer[bool]):
    """One byte, 0 or 1."""

    identity = "bool"

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

    def _encode(self, value: bytes) -> bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError("not bytes")
        return bytes(value)

    def _decode(self, data: bytes) -> bytes:
        return bytes(data)


class JsonSerializer(Serializer[Any]):
    """JSON-able values (dict keys sorted, so equal values have equal bytes)."""

    identity = "json"
    migrates_from = frozenset({"str", "int", "float", "bool"})

    def _encode(self, value: Any) -> bytes:
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
    migrates_from = _ANY
    PROTOCOL: ClassVar[int] = 5

    def _encode(self, value: Any) -> bytes:
        return pickle.dumps(value, protocol=self.PROTOCOL)

    def _decode(self, data: bytes) -> Any:
        return pickle.loads(data)


_LENGTH = struct.Struct(">I")


class TupleSerializer(Serializer[tuple[Any, ...]]):
    """Fixed-arity tuples, each field with its own serializer, length-prefixed."""

    identity = "tuple"

    def __init__(self, *fields: Serializer[Any]) -> None:
        if not fields:
            raise ValueError("a TupleSerializer needs at least one field serializer")
        self.fields = fields

    def _encode(self, value: tuple[Any, ...]) -> bytes:
        if not isinstance(value, tuple) or len(value) != len(self.fields):
            raise TypeError(f"not a tuple of {len(self.fields)} fields")
        parts = []
        for field, item in zip(self.fields, value, strict=True):
            encoded = field.serialize(item)
            parts.append(_LENGTH.pack(len(encoded)))
            parts.append(encoded)
        return b"".join(parts)

    def _decode(self, data: bytes) -> tuple[Any, ...]:
        view, position, items = memoryview(data), 0, []
        for field in self.fields:
            (length,) = _LENGTH.unpack_from(view, position)
            position += _LENGTH.size
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

    def __repr__(self) -> str:
        return f"TupleSerializer({', '.join(map(repr, self.fields))})"


@dataclass(frozen=True)
class OpaqueValue:
    """Stored bytes shown without decoding them: a pickled value read where unpickling
    is not allowed."""

    serializer: str
    data: bytes

    def to_json(self) -> dict[str, str]:
        """``{"serializer": ..., "base64": ...}``."""
        return {"serializer": self.serializer, "base64": base64.b64encode(self.data).decode()}


class OpaqueSerializer(Serializer[OpaqueValue]):
    """Reads stored bytes of the serializer named ``of`` as ``OpaqueValue``s, decoding
    nothing; ``reading_serializer`` puts it in place of the pickle serializer."""

    identity = "opaque"
    migratable_by_any = False

    def __init__(self, of: str = PickleSerializer.identity) -> None:
        self.of = of

    def _encode(self, value: OpaqueValue) -> bytes:
        if not isinstance(value, OpaqueValue):
            raise TypeError("not an OpaqueValue")
        return value.data

    def _decode(self, data: bytes) -> OpaqueValue:
        return OpaqueValue(self.of, bytes(data))

    def config(self) -> SerializerConfig:
        return {**super().config(), "of": self.of}

    @classmethod
    def from_config(cls, config: SerializerConfig) -> OpaqueSerializer:
        return cls(str(config.get("of", PickleSerializer.identity)))


def _without_pickle(config: Any) -> Any:
    """``config`` with every pickle serializer in it, however nested, made opaque."""
    if isinstance(config, list):
        return [_without_pickle(item) for item in config]
    if not isinstance(config, dict):
        return config
    if config.get("identity") == PickleSerializer.identity:
        return OpaqueSerializer().config()
    return {key: _without_pickle(value) for key, value in config.items()}


def reading_serializer(config: SerializerConfig, allow_pickle: bool) -> Serializer[Any]:
    """The serializer to decode stored state of ``config`` with: the recorded one, except
    that without ``allow_pickle`` pickled values (also inside tuples or TTL values) come
    out as ``OpaqueValue``s, so reading a checkpoint never runs code it carries."""
    return serializer_from_config(config if allow_pickle else _without_pickle(config))


_REGISTRY: dict[str, type[Serializer[Any]]] = {
    cls.identity: cls
    for cls in (
        StrSerializer,
        IntSerializer,
        FloatSerializer,
        BoolSerializer,
        BytesSerializer,
        JsonSerializer,
        PickleSerializer,
        TupleSerializer,
        OpaqueSerializer,
    )
}


def serializer_from_config(config: SerializerConfig) -> Serializer[Any]:
    """Rebuild the serializer a snapshot recorded; IncompatibleStateError if unknown."""
    identity = config.get("identity")
    cls = _REGISTRY.get(str(identity))
    if cls is None:
        raise IncompatibleStateError(
            f"unknown serializer {identity!r} in stored state: "
            f"install the statebackend version that wrote it"
        )
    return cls.from_config(config)


def register_serializer(cls: type[Serializer[Any]]) -> None:
    """Make a serializer class known to ``serializer_from_config`` by its identity."""
    _REGISTRY[cls.identity] = cls


def resolve_serializer(
    state_name: str, new: Serializer[Any], stored: SerializerConfig
) -> Serializer[Any] | None:
    """Check ``new`` against the ``stored`` config of state ``state_name``.

    Returns None when stored bytes are readable as they are, or the stored serializer
    to decode them with before re-encoding with ``new`` (migration). Raises
    IncompatibleStateError naming the state otherwise.
    """
    verdict = new.compatibility_with(stored)
    if verdict is Compatibility.COMPATIBLE_AS_IS:
        return None
    if verdict is Compatibility.COMPATIBLE_AFTER_MIGRATION:
        return serializer_from_config(stored)
    raise IncompatibleStateError(
        f"state {state_name!r} was written with serializer {stored} which {new!r} cannot "
        f"read: restore with a compatible serializer or start without this state"
    )


def migrate(data: bytes, old: Serializer[Any], new: Serializer[Any]) -> bytes:
    """Re-encode bytes written by ``old`` so that ``new`` reads them."""
    return new.serialize(old.deserialize(data))
