"""The serializer contract: ``Serializer``, its ``config()`` and the compatibility of stored
bytes with a new serializer, and the registry that rebuilds serializers from configs."""

from __future__ import annotations

import json
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
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


def describe_value(value: object) -> str:
    """A value as error messages show it: its repr, cut to 80 characters."""
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
    decodes_immutable: bool = False
    """Whether every value ``deserialize`` returns is immutable all the way down (numbers,
    strings, bytes, tuples of such), so that one decoded value may be handed out more
    than once: a batch then decodes a value once (``keyed_states.ValueStateImpl``)."""

    def serialize(self, value: T) -> bytes:
        """The bytes of ``value``; SerializationError if this serializer cannot encode it."""
        try:
            return self._encode(value)
        except SerializationError:
            raise
        except Exception as exc:
            raise SerializationError(
                f"{self.identity} serializer cannot encode {describe_value(value)} "
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

    def encoder(self) -> Callable[[T], bytes]:
        """``serialize`` without its error-wrapping frame, for hot paths: a function that
        gives ``serialize``'s bytes for every value ``serialize`` accepts and raises some
        exception (not necessarily a SerializationError) for any other. Call it inside
        ``try`` and, on an exception, call ``serialize`` for the value's clear error."""
        return self._encode

    def decoder(self) -> Callable[[bytes], T]:
        """``deserialize`` without its error-wrapping frame, as ``encoder`` is to
        ``serialize``: on an exception, call ``deserialize`` for the clear error."""
        return self._decode

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
            self.migrates_from == MIGRATES_FROM_ANY
            and identity in _REGISTRY
            and _REGISTRY[str(identity)].migratable_by_any
        ):
            return Compatibility.COMPATIBLE_AFTER_MIGRATION
        return Compatibility.INCOMPATIBLE

    @classmethod
    def from_config(cls, config: SerializerConfig) -> Serializer[Any]:
        """Rebuild this kind of serializer from its ``config()``."""
        return cls()

    def incompatibility(self, stored: SerializerConfig) -> str | None:
        """Why this serializer cannot read what ``stored`` wrote (INCOMPATIBLE), naming
        the part at fault (a field, a TTL) if it can; None otherwise."""
        return None

    def migration_loses(self, stored: SerializerConfig) -> bool:
        """Whether migrating what ``stored`` wrote to this serializer drops part of it
        (``RowTupleSerializer``: a field this one lacks)."""
        return False

    def migration_reader(self, stored: SerializerConfig) -> Serializer[Any]:
        """What decodes the bytes written by ``stored`` (COMPATIBLE_AFTER_MIGRATION with
        this one) into values this one encodes: the serializer that wrote them, unless
        its values need reshaping (``RowTupleSerializer``'s evolved schemas)."""
        return serializer_from_config(stored)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Serializer) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(json.dumps(self.config(), sort_keys=True))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


MIGRATES_FROM_ANY = frozenset({"*"})
"""``migrates_from`` of a serializer that reads the values of any ``migratable_by_any`` one."""

LENGTH_PREFIX = struct.Struct(">I")
"""The 4-byte big-endian length before each length-prefixed field."""

_REGISTRY: dict[str, type[Serializer[Any]]] = {}


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


def config_problem(config: Any) -> str | None:
    """Why ``config``, read from a snapshot, is no serializer config (a JSON object with a
    text ``identity``, its nested ``fields`` a list of configs and its ``inner`` a
    config), or None if it is one."""
    if not isinstance(config, dict) or not isinstance(config.get("identity"), str):
        return f"{describe_value(config)} is no serializer config: it has no text identity"
    fields = config.get("fields", [])
    if not isinstance(fields, list):
        return f"{describe_value(config)} is no serializer config: its fields are no list"
    for nested in [*fields, *([config["inner"]] if "inner" in config else [])]:
        problem = config_problem(nested)
        if problem is not None:
            return problem
    return None


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
        return new.migration_reader(stored)
    try:
        written: object = serializer_from_config(stored)
    except Exception:  # a config of an unknown or damaged serializer: show it as it is
        written = stored
    reason = new.incompatibility(stored)
    raise IncompatibleStateError(
        f"state {state_name!r} was written as {written!r}, which {new!r} cannot read"
        f"{'' if reason is None else f' ({reason})'}: declare the state as it was "
        f"written, or start without this state (a new job_id)"
    )


def migrate(data: bytes, old: Serializer[Any], new: Serializer[Any]) -> bytes:
    """Re-encode bytes written by ``old`` so that ``new`` reads them."""
    return new.serialize(old.deserialize(data))
