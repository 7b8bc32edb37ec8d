"""A bounded, least-recently-used table of what a Python worker keeps across tasks.

A Spark Python worker is reused for task after task, of every job the application runs.
What it keeps per job (a job's checkpoint storage with its transfer threads, a subtask's
live function) must therefore not grow with the number of jobs: ``ProcessCache`` holds
at most ``capacity`` entries and hands the least recently used one to ``on_evict`` when
a new one needs room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

_Key = TypeVar("_Key", bound=Hashable)
_Value = TypeVar("_Value")


class ProcessCache(Generic[_Key, _Value]):
    """At most ``capacity`` entries; ``get`` and ``put`` make an entry the most recent,
    and ``put`` evicts the least recent ones beyond ``capacity`` (``on_evict`` is called
    with each, after it left the table)."""

    def __init__(self, capacity: int, on_evict: Callable[[_Value], None] = lambda _: None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity {capacity!r} is invalid: give at least 1")
        self.capacity = capacity
        self._on_evict = on_evict
        self._entries: OrderedDict[_Key, _Value] = OrderedDict()

    def get(self, key: _Key) -> _Value | None:
        """The entry of ``key`` (now the most recent), or None."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: _Key, value: _Value) -> None:
        """Set the entry of ``key`` (the most recent); evict beyond ``capacity``."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            self._on_evict(evicted)

    def pop(self, key: _Key) -> _Value | None:
        """Take the entry of ``key`` out of the table; None if there is none."""
        return self._entries.pop(key, None)

    def items(self) -> list[tuple[_Key, _Value]]:
        """The entries, least recent first (a copy: the table may change meanwhile)."""
        return list(self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)
