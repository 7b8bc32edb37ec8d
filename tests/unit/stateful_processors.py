"""Test helpers for StatefulProcessor tests without a JVM: keyed backends keyed by tuples,
and an in-memory stand-in of the timer service's interface (the real one lives in
``statebackend/state/timers.py`` once the timers work is merged)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pyspark.sql.types import StringType, StructField, StructType

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.processor_handle import BatchClock

KEY_SCHEMA = StructType([StructField("user", StringType())])
MAX_PARALLELISM = 128


def make_backend(kind: str, directory: Path, clock: BatchClock) -> KeyedStateBackend:
    """A backend owning every key group, keyed by 1-tuples of a string column."""
    options: dict[str, Any] = {
        "max_parallelism": MAX_PARALLELISM,
        "key_group_range": KeyGroupRange(0, MAX_PARALLELISM - 1),
        "key_serializer": RowTupleSerializer(KEY_SCHEMA.json()),
        "clock": clock,
    }
    if kind == "heap":
        return HeapKeyedStateBackend(**options)
    return RocksDBKeyedStateBackend(directory, open_existing=True, **options)


class InMemoryTimerService:
    """The timer service interface over dicts: timers of the backend's current key."""

    def __init__(self, backend: KeyedStateBackend) -> None:
        self._backend = backend
        self._timers: dict[str, set[tuple[int, Any]]] = {"processing": set(), "event": set()}

    def _add(self, domain: str, timestamp: int) -> None:
        self._timers[domain].add((timestamp, self._backend.current_key))

    def _remove(self, domain: str, timestamp: int) -> None:
        self._timers[domain].discard((timestamp, self._backend.current_key))

    def _of_current(self, domain: str) -> Iterator[int]:
        key = self._backend.current_key
        return iter(sorted(ts for ts, k in self._timers[domain] if k == key))

    def register_processing_time_timer(self, timestamp: int) -> None:
        self._add("processing", timestamp)

    def register_event_time_timer(self, timestamp: int) -> None:
        self._add("event", timestamp)

    def delete_processing_time_timer(self, timestamp: int) -> None:
        self._remove("processing", timestamp)

    def delete_event_time_timer(self, timestamp: int) -> None:
        self._remove("event", timestamp)

    def processing_time_timers(self) -> Iterator[int]:
        return self._of_current("processing")

    def event_time_timers(self) -> Iterator[int]:
        return self._of_current("event")

    def _advance(self, domain: str, time: int, on_timer: Callable[[Any, int], None]) -> int:
        fired = 0
        while True:
            due = sorted(t for t in self._timers[domain] if t[0] <= time)
            if not due:
                return fired
            timestamp, key = due[0]
            self._timers[domain].discard((timestamp, key))
            self._backend.set_current_key(key)
            on_timer(key, timestamp)
            fired += 1

    def advance_processing_time(self, time: int, on_timer: Callable[[Any, int], None]) -> int:
        return self._advance("processing", time, on_timer)

    def advance_watermark(self, time: int, on_timer: Callable[[Any, int], None]) -> int:
        return self._advance("event", time, on_timer)
