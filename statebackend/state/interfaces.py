"""The state a user's keyed function reads and writes, scoped to the backend's current key."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


class State(ABC):
    """Keyed state: every call acts on the value of the backend's current key."""

    @abstractmethod
    def clear(self) -> None:
        """Remove the current key's value; reads then return the default / nothing."""


class ValueState(State):
    """One value per key."""

    @abstractmethod
    def value(self) -> Any:
        """The current key's value, or the descriptor's default when none is set."""

    @abstractmethod
    def update(self, value: Any) -> None:
        """Set the current key's value; ``None`` clears it."""


class ListState(State):
    """A list of elements per key."""

    @abstractmethod
    def get(self) -> list[Any]:
        """The current key's elements in the order they were added (empty when none)."""

    @abstractmethod
    def add(self, value: Any) -> None:
        """Append one element."""

    @abstractmethod
    def add_all(self, values: Iterable[Any]) -> None:
        """Append the elements in order."""

    @abstractmethod
    def update(self, values: Iterable[Any]) -> None:
        """Replace the current key's list; an empty iterable clears it."""


class ReducingState(State):
    """A value per key folded with the descriptor's reduce function."""

    @abstractmethod
    def add(self, value: Any) -> None:
        """Fold ``value`` into the current key's value."""

    @abstractmethod
    def get(self) -> Any:
        """The folded value, or None when nothing was added."""


class AggregatingState(State):
    """An accumulator per key driven by the descriptor's AggregateFunction."""

    @abstractmethod
    def add(self, value: Any) -> None:
        """Add ``value`` to the current key's accumulator."""

    @abstractmethod
    def get(self) -> Any:
        """``get_result`` of the accumulator, or None when nothing was added."""


class MapState(State):
    """A map per key; entries are stored one by one, the map is never loaded whole."""

    @abstractmethod
    def get(self, user_key: Any) -> Any:
        """The value under ``user_key``, or None (also the value of an entry that holds
        None: ``contains`` tells them apart)."""

    @abstractmethod
    def put(self, user_key: Any, value: Any) -> None:
        """Set the value under ``user_key``."""

    @abstractmethod
    def put_all(self, entries: Mapping[Any, Any]) -> None:
        """Set every entry of ``entries``."""

    @abstractmethod
    def remove(self, user_key: Any) -> None:
        """Remove ``user_key`` if present."""

    @abstractmethod
    def contains(self, user_key: Any) -> bool:
        """Whether ``user_key`` has a live entry, whatever its value (None included)."""

    @abstractmethod
    def items(self) -> Iterator[tuple[Any, Any]]:
        """The (user key, value) entries."""

    def keys(self) -> Iterator[Any]:
        """The user keys."""
        return (key for key, _ in self.items())

    def values(self) -> Iterator[Any]:
        """The values."""
        return (value for _, value in self.items())

    def is_empty(self) -> bool:
        """Whether the current key's map has no entries."""
        return next(self.items(), None) is None
