"""Time to live for keyed state: values stored with their expiration time.

A state with a TTL stores every value (list element, map entry) wrapped as
``TtlValue(value, expires_at_ms)``, encoded by ``TtlSerializer`` around the user's
serializer, so the TTL travels through snapshots with the bytes and a restore with or
without TTL is a serializer incompatibility like any other.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

from statebackend.errors import ConfigurationError
from statebackend.serializers import (
    Compatibility,
    Serializer,
    SerializerConfig,
    register_serializer,
    serializer_from_config,
)

Clock = Callable[[], float]
"""Seconds since the epoch; ``time.time`` unless a test injects another."""


class TtlUpdateType(Enum):
    """When a value's expiration is pushed forward."""

    ON_CREATE_AND_WRITE = "on-create-and-write"
    ON_READ_AND_WRITE = "on-read-and-write"


MIN_TTL_SECONDS = 0.001
"""The shortest TTL: one millisecond, the unit expiries are stored in."""


@dataclass(frozen=True)
class StateTtlConfig:
    """A time to live in seconds (at least ``MIN_TTL_SECONDS``) and when it is refreshed;
    expired values are never returned."""

    ttl_seconds: float
    update_type: TtlUpdateType = TtlUpdateType.ON_CREATE_AND_WRITE

    def __post_init__(self) -> None:
        # Expiries are whole milliseconds: a shorter TTL would round to 0, every value dead
        # when written. The comparison is also False for NaN.
        ttl = self.ttl_seconds
        if not isinstance(ttl, (int, float)) or not MIN_TTL_SECONDS <= ttl < math.inf:
            raise ConfigurationError(
                f"TTL {ttl!r} is invalid: give a finite number of seconds, at least "
                f"{MIN_TTL_SECONDS} (1 ms, the unit of expiries)"
            )

    def expiry_ms(self, now: float) -> int:
        """The expiration timestamp (ms) of a value written or refreshed at ``now``: both
        in whole milliseconds, so that a clock of whole milliseconds (a batch timestamp)
        gives exact expiries whatever the float rounding of ``now``."""
        return to_ms(now) + round(self.ttl_seconds * 1000)


def to_ms(seconds: float) -> int:
    """A clock reading (seconds since the epoch) in whole milliseconds."""
    return round(seconds * 1000)


class TtlValue(NamedTuple):
    """A stored value and the time (ms since the epoch) after which it is expired."""

    value: Any
    expires_at_ms: int


_EXPIRY = struct.Struct(">q")


class TtlSerializer(Serializer[TtlValue]):
    """Encodes ``TtlValue`` as an 8-byte expiration then the inner serializer's bytes."""

    identity = "ttl"
    migratable_by_any = False

    def __init__(self, inner: Serializer[Any]) -> None:
        self.inner = inner

    def _encode(self, value: TtlValue) -> bytes:
        return _EXPIRY.pack(value.expires_at_ms) + self.inner.serialize(value.value)

    def _decode(self, data: bytes) -> TtlValue:
        (expires,) = _EXPIRY.unpack_from(data)
        return TtlValue(self.inner.deserialize(bytes(data[_EXPIRY.size :])), expires)

    def config(self) -> SerializerConfig:
        return {**super().config(), "inner": self.inner.config()}

    def compatibility_with(self, stored: SerializerConfig) -> Compatibility:
        if stored.get("identity") != self.identity or "inner" not in stored:
            return super().compatibility_with(stored)
        return self.inner.compatibility_with(stored["inner"])

    @classmethod
    def from_config(cls, config: SerializerConfig) -> TtlSerializer:
        return cls(serializer_from_config(config["inner"]))

    def incompatibility(self, stored: SerializerConfig) -> str | None:
        if stored.get("identity") != self.identity:
            return "it was stored without a TTL"
        return self.inner.incompatibility(stored["inner"]) if "inner" in stored else None

    def migration_loses(self, stored: SerializerConfig) -> bool:
        inner = stored.get("inner") if stored.get("identity") == self.identity else None
        return isinstance(inner, dict) and self.inner.migration_loses(inner)

    def migration_reader(self, stored: SerializerConfig) -> Serializer[Any]:
        if stored.get("identity") != self.identity or "inner" not in stored:
            return super().migration_reader(stored)
        return TtlSerializer(self.inner.migration_reader(stored["inner"]))

    def __repr__(self) -> str:
        return f"TtlSerializer({self.inner!r})"


register_serializer(TtlSerializer)
