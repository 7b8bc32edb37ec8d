"""Reading stored state without running code it carries: pickled values come out as
``OpaqueValue``s."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from statebackend.serializers.base import (
    Serializer,
    SerializerConfig,
    serializer_from_config,
)
from statebackend.serializers.simple import PickleSerializer


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


def holds_pickle(config: Any) -> bool:
    """Whether a serializer ``config`` is, or holds (in a tuple, a TTL value), pickle:
    decoding its values would run code they carry."""
    return bool(_without_pickle(config) != config)


def reading_serializer(config: SerializerConfig, allow_pickle: bool) -> Serializer[Any]:
    """The serializer to decode stored state of ``config`` with: the recorded one, except
    that without ``allow_pickle`` pickled values (also inside tuples or TTL values) come
    out as ``OpaqueValue``s, so reading a checkpoint never runs code it carries."""
    return serializer_from_config(config if allow_pickle else _without_pickle(config))
