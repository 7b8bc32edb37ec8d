"""What a Python worker keeps across tasks stays bounded however many jobs it serves
(``spark/process_cache.py``): the table evicts the least recently used entry, and a
job's checkpoint storage it evicts lets its uploads finish, then its threads end."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from statebackend.spark import tasks
from statebackend.spark.process_cache import ProcessCache
from statebackend.spark.tasks import CACHED_STORAGES, StorageSpec


def test_the_least_recently_used_entry_is_evicted() -> None:
    evicted: list[str] = []
    cache: ProcessCache[str, str] = ProcessCache(2, evicted.append)
    cache.put("a", "A")
    cache.put("b", "B")
    assert cache.get("a") == "A"  # now b is the least recent
    cache.put("c", "C")
    assert evicted == ["B"] and cache.get("b") is None
    assert [key for key, _ in cache.items()] == ["a", "c"]
    assert cache.pop("a") == "A" and cache.pop("a") is None and len(cache) == 1
    with pytest.raises(ValueError, match="capacity 0"):
        ProcessCache(0)


def _transfer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("statebackend-transfer")]


def test_a_worker_serving_many_jobs_keeps_a_bounded_number_of_storages(tmp_path: Path) -> None:
    """One more job than CACHED_STORAGES: the first job's storage is evicted while an
    upload of it is still running; the upload finishes, then its thread ends, and no
    more than CACHED_STORAGES jobs keep transfer threads."""
    before = set(_transfer_threads())
    specs = [
        StorageSpec((tmp_path / "checkpoints").as_uri(), f"job-{n}", {}, 1, "none")
        for n in range(CACHED_STORAGES + 1)
    ]
    first = specs[0].open()
    assert specs[0].open() is first
    release, finished = threading.Event(), threading.Event()

    def upload() -> None:
        release.wait(30)
        finished.set()

    running = first.executor.submit(upload)
    (first_thread,) = set(_transfer_threads()) - before
    for spec in specs[1:]:
        spec.open().executor.submit(lambda: None).result()
    assert tasks._STORAGES.get(specs[0]._cache_key()) is None  # evicted, still uploading
    assert not finished.is_set()
    release.set()
    running.result(timeout=30)
    first_thread.join(timeout=30)
    assert not first_thread.is_alive()
    alive = set(_transfer_threads()) - before
    assert len(alive) == CACHED_STORAGES, alive
    assert specs[0].open() is not first  # a new storage for the first job
