"""State descriptors: the name, kind, serializers, default and TTL of one keyed state."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from typing import Any, Generic, TypeVar

from statebackend.errors import ConfigurationError
from statebackend.serializers import PickleSerializer, Serializer
from statebackend.state.timers import TIMER_STATE_PREFIX, is_timer_state
from statebackend.state.ttl import StateTtlConfig

RESERVED_STATE_NAMES = frozenset({"default"})
"""Names no state may take (RocksDB's default column family)."""

ACC = TypeVar("ACC")
IN = TypeVar("IN")
OUT = TypeVar("OUT")


class StateKind(Enum):
    """The kinds of keyed state."""

    VALUE = "value"
    LIST = "list"
    MAP = "map"
    REDUCING = "reducing"
    AGGREGATING = "aggregating"


def check_state_name(name: object) -> str:
    """Return ``name`` if it is a usable state name, else raise ConfigurationError."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"state name {name!r} is invalid: give a non-empty string")
    if name in RESERVED_STATE_NAMES or is_timer_state(name):
        raise ConfigurationError(
            f"state name {name!r} is reserved (as are names starting with "
            f"{TIMER_STATE_PREFIX!r}): choose another name"
        )
    return name


class StateDescriptor(ABC):
    """Describes one state: name, kind, value serializer, default and optional TTL."""

    kind: StateKind

    def __init__(
        self,
        name: str,
        serializer: Serializer[Any] | None = None,
        *,
        default: Any = None,
        ttl: StateTtlConfig | None = None,
    ) -> None:
        self.name = check_state_name(name)
        self.serializer: Serializer[Any] = serializer or PickleSerializer()
        self.default = default
        self.ttl = ttl

    def serializer_configs(self) -> dict[str, Any]:
        """The serializers' configs by role, as written into snapshots."""
        return {"value": self.serializer.config()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ValueStateDescriptor(StateDescriptor):
    """A single value per key; ``default`` is returned while none is set (a mutable
    default as a fresh deep copy per read, so keys never share it)."""

    kind = StateKind.VALUE


class ListStateDescriptor(StateDescriptor):
    """A list of elements per key; ``serializer`` encodes one element."""

    kind = StateKind.LIST

    def __init__(
        self,
        name: str,
        serializer: Serializer[Any] | None = None,
        *,
        ttl: StateTtlConfig | None = None,
    ) -> None:
        super().__init__(name, serializer, ttl=ttl)


class MapStateDescriptor(StateDescriptor):
    """A map per key, one stored entry per map entry (a map is never loaded whole).

    User keys are told apart by their encoded bytes, not by ``==``. The default
    ``PickleSerializer`` makes ``1``, ``1.0`` and ``True`` three keys, and equal tuples or
    dicts may pickle differently (shared objects, dict order) and be two keys: give a
    typed ``key_serializer`` (``StrSerializer``, ``IntSerializer``, ``TupleSerializer``,
    ``RowTupleSerializer``...), whose equal keys have equal bytes."""

    kind = StateKind.MAP

    def __init__(
        self,
        name: str,
        key_serializer: Serializer[Any] | None = None,
        value_serializer: Serializer[Any] | None = None,
        *,
        ttl: StateTtlConfig | None = None,
    ) -> None:
        super().__init__(name, value_serializer, ttl=ttl)
        self.key_serializer: Serializer[Any] = key_serializer or PickleSerializer()

    def serializer_configs(self) -> dict[str, Any]:
        return {"user_key": self.key_serializer.config(), **super().serializer_configs()}


class ReducingStateDescriptor(StateDescriptor):
    """A value per key folded with ``reduce_function(accumulated, new)`` on every add."""

    kind = StateKind.REDUCING

    def __init__(
        self,
        name: str,
        reduce_function: Callable[[Any, Any], Any],
        serializer: Serializer[Any] | None = None,
        *,
        ttl: StateTtlConfig | None = None,
    ) -> None:
        super().__init__(name, serializer, ttl=ttl)
        self.reduce_function = reduce_function


class AggregateFunction(ABC, Generic[IN, ACC, OUT]):
    """Flink's AggregateFunction: folds inputs into an accumulator and reads a result."""

    @abstractmethod
    def create_accumulator(self) -> ACC:
        """A fresh, empty accumulator."""

    @abstractmethod
    def add(self, value: IN, accumulator: ACC) -> ACC:
        """The accumulator after adding ``value`` (may be the same object, changed)."""

    @abstractmethod
    def get_result(self, accumulator: ACC) -> OUT:
        """The result the accumulator stands for."""

    @abstractmethod
    def merge(self, a: ACC, b: ACC) -> ACC:
        """One accumulator holding both ``a`` and ``b``."""


class AggregatingStateDescriptor(StateDescriptor):
    """An accumulator per key driven by an ``AggregateFunction``; ``serializer`` encodes it."""

    kind = StateKind.AGGREGATING

    def __init__(
        self,
        name: str,
        aggregate_function: AggregateFunction[Any, Any, Any],
        serializer: Serializer[Any] | None = None,
        *,
        ttl: StateTtlConfig | None = None,
    ) -> None:
        super().__init__(name, serializer, ttl=ttl)
        self.aggregate_function = aggregate_function
