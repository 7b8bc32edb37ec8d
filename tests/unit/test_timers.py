"""The timer service of both keyed backends, against a plain-Python priority queue.

Expectations come from a model (a set of (timestamp, serialized key) per time domain,
fired by repeatedly taking its minimum), never from the backend under test. The RocksDB
backend runs with its default in-memory cache of timers per key group and with a cache
of 2, so that refills from the store are exercised; the model test also runs it inside
batches (``KeyedStateBackend.batch``, timer writes buffered), ended and reopened every
``BATCH_OPS`` operations.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend, KeyedStateCut
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.backends.stores import Entry
from statebackend.backends.timers import TimerClocks, TimerSnapshotInfo
from statebackend.errors import ConfigurationError, StateAccessError
from statebackend.keygroups import KeyGroupRange, assign_to_key_group
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState
from statebackend.state.timers import MAX_TIMESTAMP, MIN_TIMESTAMP, TimerService

M = 128
FULL_RANGE = KeyGroupRange(0, M - 1)
KEYS = [f"k{n}" for n in range(40)]
# heap; RocksDB with its default cache; RocksDB keeping 2 timers per key group in memory.
VARIANTS = ["heap", "rocksdb", "rocksdb-cache-2"]
BATCHED = "rocksdb-cache-2-batched"
BATCH_OPS = 40
DOMAINS = ["event", "processing"]


def key_group(key: bytes) -> int:
    return assign_to_key_group(key, M)


def encoded(key: str) -> bytes:
    return key.encode("utf-8")  # StrSerializer's encoding, computed independently


class Backends:
    """Creates backends and disposes of all of them at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.created: list[KeyedStateBackend] = []
        self.batches: dict[KeyedStateBackend, ExitStack] = {}

    def make(
        self, variant: str, key_group_range: KeyGroupRange = FULL_RANGE, reopen: Path | None = None
    ) -> KeyedStateBackend:
        options: dict[str, Any] = {
            "max_parallelism": M,
            "key_group_range": key_group_range,
            "key_serializer": StrSerializer(),
        }
        backend: KeyedStateBackend
        if variant == "heap":
            backend = HeapKeyedStateBackend(**options)
        elif reopen is not None:
            backend = RocksDBKeyedStateBackend(reopen, open_existing=True, **options)
        else:
            backend = RocksDBKeyedStateBackend(self.tmp_path / f"db-{len(self.created)}", **options)
        if variant.startswith("rocksdb-cache-2"):
            backend._timer_cache_entries = 2
        self.created.append(backend)
        if variant == BATCHED:
            self.batches[backend] = ExitStack()
            self.rebatch(backend)
        return backend

    def rebatch(self, backend: KeyedStateBackend) -> None:
        """End a batched backend's batch and open the next (nothing for the others)."""
        stack = self.batches.get(backend)
        if stack is not None:
            stack.close()
            stack.enter_context(backend.batch())

    def dispose_all(self) -> None:
        for stack in self.batches.values():
            stack.close()
        for backend in self.created:
            backend.dispose()


@pytest.fixture
def backends(tmp_path: Path) -> Iterator[Backends]:
    factory = Backends(tmp_path)
    yield factory
    factory.dispose_all()


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def register(service: TimerService, domain: str, timestamp: int) -> None:
    if domain == "event":
        service.register_event_time_timer(timestamp)
    else:
        service.register_processing_time_timer(timestamp)


def delete(service: TimerService, domain: str, timestamp: int) -> None:
    if domain == "event":
        service.delete_event_time_timer(timestamp)
    else:
        service.delete_processing_time_timer(timestamp)


def listed(service: TimerService, domain: str) -> list[int]:
    if domain == "event":
        return list(service.event_time_timers())
    return list(service.processing_time_timers())


def advance(
    service: TimerService,
    domain: str,
    timestamp: int,
    on_timer: Callable[[Any, int], None],
    fire_new: bool = True,
) -> int:
    if domain == "event":
        return service.advance_watermark(timestamp, on_timer, fire_new)
    return service.advance_processing_time(timestamp, on_timer, fire_new)


def recorder(fired: list[tuple[int, bytes]]) -> Callable[[Any, int], None]:
    """An ``on_timer`` that appends (timestamp, serialized key) to ``fired``."""

    def on_timer(key: Any, timestamp: int) -> None:
        fired.append((timestamp, encoded(key)))

    return on_timer


def collect(cut: KeyedStateCut) -> list[tuple[str, int, Entry]]:
    entries = [(name, kg, entry) for kg in cut.key_group_range for name, entry in cut.entries(kg)]
    return entries


def restore_cut(
    target: KeyedStateBackend, cut: KeyedStateCut, entries: list[tuple[str, int, Entry]]
) -> None:
    target.restore(cut.key_serializer, cut.states, entries, cut.timers)


# -- behaviour ------------------------------------------------------------------------------


@pytest.mark.parametrize("domain", DOMAINS)
def test_register_list_delete_and_fire(backends: Backends, variant: str, domain: str) -> None:
    backend = backends.make(variant)
    service = backend.timer_service
    count = backend.get_state(ValueStateDescriptor("count", IntSerializer()))
    assert isinstance(count, ValueState)
    for key, timestamps in {"a": [30, 10, 20, 10], "b": [10, -5], "c": [40]}.items():
        backend.set_current_key(key)
        count.update(len(key))
        for timestamp in timestamps:
            register(service, domain, timestamp)
    backend.set_current_key("a")
    assert listed(service, domain) == [10, 20, 30]
    delete(service, domain, 20)
    delete(service, domain, 999)  # absent: nothing happens
    assert listed(service, domain) == [10, 30]
    backend.set_current_key("c")
    count.clear()  # timers stay when the key's state is cleared
    assert listed(service, domain) == [40]

    fired: list[tuple[Any, int, Any]] = []

    def on_timer(key: Any, timestamp: int) -> None:
        assert backend.current_key == key
        fired.append((key, timestamp, count.value()))
        count.update((count.value() or 0) + 100)

    assert advance(service, domain, 10, on_timer) == 3
    expected = sorted([(10, encoded("a")), (10, encoded("b")), (-5, encoded("b"))])
    assert [(t, encoded(k)) for k, t, _ in fired] == expected
    assert fired[0][2] == 1 and fired[1][2] == 1 and fired[2][2] == 101
    backend.set_current_key("a")
    assert listed(service, domain) == [30]
    assert advance(service, domain, 10, on_timer) == 0
    assert advance(service, domain, MAX_TIMESTAMP, on_timer) == 2
    assert [(k, t) for k, t, _ in fired[3:]] == [("a", 30), ("c", 40)]
    assert fired[4][2] is None  # c's state was cleared
    other = "processing" if domain == "event" else "event"
    backend.set_current_key("a")
    assert listed(service, domain) == [] and listed(service, other) == []


def test_clocks_start_at_min_and_never_go_back(backends: Backends, variant: str) -> None:
    service = backends.make(variant).timer_service
    assert service.current_watermark == MIN_TIMESTAMP
    assert service.current_processing_time == MIN_TIMESTAMP
    seen: list[int] = []

    def on_timer(key: Any, timestamp: int) -> None:
        seen.append(service.current_watermark)

    service.advance_watermark(100, on_timer)
    service.advance_watermark(50, on_timer)
    assert service.current_watermark == 100
    service.advance_processing_time(7, on_timer)
    assert service.current_processing_time == 7 and service.current_watermark == 100


def test_timers_registered_while_firing(backends: Backends, variant: str) -> None:
    backend = backends.make(variant)
    service = backend.timer_service
    for key in KEYS[:10]:
        backend.set_current_key(key)
        service.register_event_time_timer(50)
    fired: list[tuple[str, int]] = []

    def on_timer(key: str, timestamp: int) -> None:
        fired.append((key, timestamp))
        if timestamp == 50 and fired.count((key, 50)) == 1:
            service.register_event_time_timer(10)  # due already: fires in this call
            service.register_event_time_timer(150)  # not due
            service.register_event_time_timer(50)  # the firing timer again: fires again
            service.register_event_time_timer(60)
            service.delete_event_time_timer(60)  # registered and deleted: never fires

    assert service.advance_watermark(100, on_timer) == 30
    for key in KEYS[:10]:
        assert fired.count((key, 10)) == 1 and fired.count((key, 50)) == 2
        backend.set_current_key(key)
        assert list(service.event_time_timers()) == [150]


def test_timers_registered_while_firing_wait_for_the_next_advance(
    backends: Backends, variant: str
) -> None:
    """``fire_new=False`` (Spark's transformWithState): the timers due when firing begins
    fire, and only they, even when deleted meanwhile; a firing timer is listed until its
    handler returns; due ones registered meanwhile are listed at once and fire next time."""
    backend = backends.make(variant)
    service = backend.timer_service
    for key in KEYS[:10]:
        backend.set_current_key(key)
        service.register_event_time_timer(50)
        service.register_event_time_timer(70)
    fired: list[tuple[str, int]] = []

    def on_timer(key: str, timestamp: int) -> None:
        fired.append((key, timestamp))
        if timestamp == 50:
            service.register_event_time_timer(10)  # due already: waits
            service.register_event_time_timer(50)  # the firing one: listed, then gone
            service.register_event_time_timer(70)  # due and not fired yet: fires once
            service.delete_event_time_timer(70)  # ... and still does, unlisted
            service.register_event_time_timer(60)
            service.delete_event_time_timer(60)  # registered and deleted: never fires
            assert list(service.event_time_timers()) == [10, 50]
        if timestamp == 70:
            assert list(service.event_time_timers()) == [10]  # deleted before it fired

    assert service.advance_watermark(100, on_timer, fire_new=False) == 20
    assert sorted(fired) == sorted((key, t) for key in KEYS[:10] for t in (50, 70))
    for key in KEYS[:10]:
        backend.set_current_key(key)
        assert list(service.event_time_timers()) == [10]
    fired.clear()
    assert service.advance_watermark(100, on_timer, fire_new=False) == 10
    assert sorted(fired) == sorted((key, 10) for key in KEYS[:10])
    for key in KEYS[:10]:
        backend.set_current_key(key)
        assert list(service.event_time_timers()) == []


@pytest.mark.parametrize("fire_new", [True, False])
def test_a_handler_that_raises_leaves_its_changes_and_bad_timestamps_raise_in_it(
    backends: Backends, variant: str, fire_new: bool
) -> None:
    """In both modes a failing handler's timer changes stay as it made them (a due timer
    it deleted stays deleted, a new one is registered), and a timestamp out of range
    raises in the handler, where it can be caught."""
    backend = backends.make(variant)
    service = backend.timer_service
    backend.set_current_key("k")
    for timestamp in (50, 70, 90):
        service.register_event_time_timer(timestamp)
    refused: list[int] = []

    def on_timer(key: str, timestamp: int) -> None:
        with pytest.raises(StateAccessError):
            service.register_event_time_timer(MIN_TIMESTAMP - 1)
        refused.append(timestamp)
        service.delete_event_time_timer(70)  # due, not fired yet
        service.register_event_time_timer(60)  # due, new
        service.register_event_time_timer(200)
        raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError):
        service.advance_watermark(100, on_timer, fire_new)
    assert refused == [50]
    backend.set_current_key("k")
    assert list(service.event_time_timers()) == [60, 90, 200]
    assert service.counts()["event"] == 3


def test_bad_timestamps_and_no_current_key(backends: Backends, variant: str) -> None:
    backend = backends.make(variant)
    service = backend.timer_service
    with pytest.raises(StateAccessError):
        service.register_event_time_timer(1)
    backend.set_current_key("a")
    for bad in (1.5, "3", True, MAX_TIMESTAMP + 1, MIN_TIMESTAMP - 1, None):
        with pytest.raises(StateAccessError):
            service.register_event_time_timer(bad)  # type: ignore[arg-type]
        with pytest.raises(StateAccessError):
            service.advance_processing_time(bad, lambda key, ts: None)  # type: ignore[arg-type]
    service.register_event_time_timer(MIN_TIMESTAMP)
    service.register_event_time_timer(MAX_TIMESTAMP)
    assert list(service.event_time_timers()) == [MIN_TIMESTAMP, MAX_TIMESTAMP]


def test_timer_state_names_are_reserved() -> None:
    with pytest.raises(ConfigurationError, match="reserved"):
        ValueStateDescriptor("_timers.mine")


def test_one_service_per_backend(backends: Backends, variant: str) -> None:
    backend = backends.make(variant)
    assert backend.timer_service is backend.timer_service


# -- model test -------------------------------------------------------------------------


class Model:
    """Plain-Python timers: a set of (timestamp, serialized key) per domain, fired by
    taking the minimum while it is due (a priority queue by definition); with
    ``fire_new=False`` the timers due when firing begins fire, and only they, even those
    deleted before their turn."""

    def __init__(self) -> None:
        self.timers: dict[str, set[tuple[int, bytes]]] = {d: set() for d in DOMAINS}
        self.clocks = {d: MIN_TIMESTAMP for d in DOMAINS}

    def fire(
        self,
        domain: str,
        until: int,
        effect: Callable[[str, int], None],
        fire_new: bool = True,
    ) -> list[Any]:
        self.clocks[domain] = max(self.clocks[domain], until)
        fired = []
        timers = self.timers[domain]

        def fire_one(timer: tuple[int, bytes]) -> None:
            timers.remove(timer)
            fired.append((timer[1].decode(), timer[0]))
            effect(timer[1].decode(), timer[0])

        if fire_new:
            while timers and min(timers)[0] <= self.clocks[domain]:
                fire_one(min(timers))
            return fired
        for timer in sorted(t for t in timers if t[0] <= self.clocks[domain]):
            timers.add(timer)  # fires even if an earlier timer's effect deleted it
            fire_one(timer)
        return fired


def firing_effect(
    domain: str,
    register_timer: Callable[[str, str, int], None],
    delete_timer: Callable[[str, str, int], None],
) -> Callable[[str, int], None]:
    """What every fired timer does, in the backend and in the model alike: some register
    another timer of the same key, due now or later; some delete one, due or not, or
    register one and delete it again."""

    def effect(key: str, timestamp: int) -> None:
        if timestamp % 5 == 0:
            register_timer(key, domain, timestamp - 3)
        if timestamp % 7 == 0:
            register_timer(key, domain, timestamp + 40)
        if timestamp % 11 == 0:
            delete_timer(key, domain, timestamp + 2)
        if timestamp % 13 == 0:
            register_timer(key, domain, timestamp - 1)
            delete_timer(key, domain, timestamp - 1)

    return effect


def check_against_model(backend: KeyedStateBackend, model: Model) -> None:
    service = backend.timer_service
    for key in KEYS:
        backend.set_current_key(key)
        for domain in DOMAINS:
            expected = sorted(t for t, k in model.timers[domain] if k == encoded(key))
            assert listed(service, domain) == expected, (key, domain)
    assert service.current_watermark == model.clocks["event"]
    assert service.current_processing_time == model.clocks["processing"]


def run_random(
    backend: KeyedStateBackend,
    model: Model,
    rng: random.Random,
    steps: int,
    rebatch: Callable[[KeyedStateBackend], None] = lambda backend: None,
    fire_new: bool = True,
) -> None:
    service = backend.timer_service

    def register_in_backend(key: str, domain: str, timestamp: int) -> None:
        register(service, domain, timestamp)

    def delete_in_backend(key: str, domain: str, timestamp: int) -> None:
        delete(service, domain, timestamp)

    def register_in_model(key: str, domain: str, timestamp: int) -> None:
        model.timers[domain].add((timestamp, encoded(key)))

    def delete_in_model(key: str, domain: str, timestamp: int) -> None:
        model.timers[domain].discard((timestamp, encoded(key)))

    for step in range(steps):
        if step % BATCH_OPS == 0:
            rebatch(backend)
        op = rng.random()
        domain = rng.choice(DOMAINS)
        key = rng.choice(KEYS)
        timestamp = model.clocks[domain] + rng.randrange(-20, 200)
        if model.clocks[domain] == MIN_TIMESTAMP:
            timestamp = rng.randrange(-100, 300)
        if op < 0.55:
            backend.set_current_key(key)
            register(service, domain, timestamp)
            register_in_model(key, domain, timestamp)
        elif op < 0.75:
            mine = [t for t, k in model.timers[domain] if k == encoded(key)]
            if mine and rng.random() < 0.8:
                timestamp = rng.choice(mine)
            backend.set_current_key(key)
            delete(service, domain, timestamp)
            model.timers[domain].discard((timestamp, encoded(key)))
        elif op < 0.8:
            backend.set_current_key(key)
            expected = sorted(t for t, k in model.timers[domain] if k == encoded(key))
            assert listed(service, domain) == expected
        else:
            until = model.clocks[domain] + rng.randrange(-10, 120)
            if model.clocks[domain] == MIN_TIMESTAMP:
                until = rng.randrange(-100, 200)
            fired: list[tuple[str, int]] = []
            backend_effect = firing_effect(domain, register_in_backend, delete_in_backend)

            def on_timer(
                key: str, timestamp: int, effect: Any = backend_effect, fired: Any = fired
            ) -> None:
                assert backend.current_key == key
                fired.append((key, timestamp))
                effect(key, timestamp)

            count = advance(service, domain, until, on_timer, fire_new)
            model_effect = firing_effect(domain, register_in_model, delete_in_model)
            expected = model.fire(domain, until, model_effect, fire_new)
            assert fired == expected
            assert count == len(expected)


@pytest.mark.parametrize("fire_new", [True, False])
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("variant", [*VARIANTS, BATCHED])
def test_random_operations_match_the_model(
    backends: Backends, variant: str, seed: int, fire_new: bool
) -> None:
    rng = random.Random(seed)
    backend = backends.make(variant)
    model = Model()
    run_random(backend, model, rng, 1500, backends.rebatch, fire_new)
    check_against_model(backend, model)
    # Snapshot, restore into every variant, and go on from there with the model.
    cut = backend.sync_cut()
    entries = collect(cut)
    assert cut.timers is not None
    assert cut.timers.clocks == TimerClocks(model.clocks["event"], model.clocks["processing"])
    for domain in DOMAINS:
        assert cut.timers.counts[domain] == len(model.timers[domain])
        assert cut.timers.earliest[domain] == min(model.timers[domain], default=(None,))[0]
    cut.release()
    for target_variant in VARIANTS:
        target = backends.make(target_variant)
        restore_cut(target, cut, entries)
        copy = Model()
        copy.timers = {d: set(t) for d, t in model.timers.items()}
        copy.clocks = dict(model.clocks)
        check_against_model(target, copy)
        run_random(target, copy, random.Random(seed * 100), 500, fire_new=fire_new)
        check_against_model(target, copy)


def model_entries(model: Model) -> list[tuple[str, int, Entry]]:
    """The snapshot entries a backend holding ``model``'s timers must produce, computed
    from the documented layout."""
    entries = []
    for kg in FULL_RANGE:
        for domain in DOMAINS:
            timers = sorted(
                (t, k) for t, k in model.timers[domain] if assign_to_key_group(k, M) == kg
            )
            by_key = sorted((k, t) for t, k in timers)
            for key, t in by_key:
                ts8 = (t + 2**63).to_bytes(8, "big")
                entries.append((f"_timers.{domain}.by_key", kg, (key, ts8, b"")))
            for t, key in timers:
                ts8 = (t + 2**63).to_bytes(8, "big")
                entries.append((f"_timers.{domain}.by_time", kg, (ts8, key, b"")))
    return entries


def test_heap_and_rocksdb_cuts_are_identical_and_as_documented(backends: Backends) -> None:
    results = []
    for variant in VARIANTS:
        backend = backends.make(variant)
        model = Model()
        run_random(backend, model, random.Random(5), 800)
        for i, key in enumerate(KEYS):
            backend.set_current_key(key)
            for domain in DOMAINS:
                for timestamp in (model.clocks[domain] + 1000 + i, -i):
                    register(backend.timer_service, domain, timestamp)
                    model.timers[domain].add((timestamp, encoded(key)))
        cut = backend.sync_cut()
        results.append((cut.states, collect(cut), cut.timers))
        cut.release()
    assert results[0] == results[1] == results[2]
    entries = results[0][1]
    by_state = sorted(entries, key=lambda e: (e[1], e[0]))  # cut order: key group, then state
    assert entries == by_state
    # The entries hold exactly the model's timers in the documented layout.
    expected = model_entries(model)
    assert sorted(entries) == sorted(expected)
    assert len(entries) > 200


def test_snapshot_during_firing(backends: Backends, variant: str) -> None:
    backend = backends.make(variant)
    service = backend.timer_service
    timers = {(t, encoded(k)) for k in KEYS for t in range(0, 100, 9)}
    for t, k in timers:
        backend.set_current_key(k.decode())
        service.register_event_time_timer(t)
    fired: list[tuple[int, bytes]] = []
    cuts: list[tuple[KeyedStateCut, list[tuple[str, int, Entry]]]] = []

    def on_timer(key: str, timestamp: int) -> None:
        fired.append((timestamp, encoded(key)))
        if len(fired) == 137:
            cut = backend.sync_cut()
            cuts.append((cut, collect(cut)))
            cut.release()

    assert service.advance_watermark(60, on_timer) == len([t for t, _ in timers if t <= 60])
    assert fired == sorted(t for t in timers if t[0] <= 60)
    ((cut, entries),) = cuts
    assert cut.timers is not None and cut.timers.clocks.watermark == 60
    assert cut.timers.counts["event"] == len(timers) - 137
    for target_variant in VARIANTS:
        target = backends.make(target_variant)
        restore_cut(target, cut, entries)
        refired: list[tuple[int, bytes]] = []
        restored = target.timer_service
        assert restored.current_watermark == 60
        # The restored backend fires what had not fired at the cut, and nothing else.
        restored.advance_watermark(60, recorder(refired))
        assert refired == fired[137:]
        restored.advance_watermark(MAX_TIMESTAMP, recorder(refired))
        assert sorted(fired[:137] + refired) == sorted(timers)


def test_restore_into_key_group_ranges_and_merge_clocks(backends: Backends, variant: str) -> None:
    sources = []
    model = Model()
    for watermark in (40, 25):
        source = backends.make(variant)
        service = source.timer_service
        for i, key in enumerate(KEYS):
            source.set_current_key(key)
            service.register_event_time_timer(watermark * 10 + i)
            model.timers["event"].add((watermark * 10 + i, encoded(key)))
        service.advance_watermark(watermark, lambda k, t: None)
        service.advance_processing_time(watermark * 2, lambda k, t: None)
        cut = source.sync_cut()
        sources.append((cut, collect(cut)))
        cut.release()
    halves = [KeyGroupRange(0, 40), KeyGroupRange(41, M - 1)]
    seen: list[tuple[int, bytes]] = []
    for half in halves:
        target = backends.make(variant, key_group_range=half)
        for cut, entries in sources:
            restore_cut(target, cut, entries)
        service = target.timer_service
        assert service.current_watermark == 25 and service.current_processing_time == 50
        mine: list[tuple[int, bytes]] = []
        service.advance_watermark(MAX_TIMESTAMP, recorder(mine))
        assert mine == sorted(t for t in model.timers["event"] if key_group(t[1]) in half)
        seen += mine
    assert sorted(seen) == sorted(model.timers["event"])


def test_restore_after_the_service_is_in_use_is_rejected(backends: Backends, variant: str) -> None:
    backend = backends.make(variant)
    backend.timer_service.advance_watermark(5, lambda k, t: None)
    cut = backend.sync_cut()
    entries = collect(cut)
    cut.release()
    target = backends.make(variant)
    target.timer_service  # noqa: B018  (in use)
    with pytest.raises(StateAccessError, match="restore before timer_service"):
        restore_cut(target, cut, entries)


def test_empty_cut_has_clocks_and_no_timer_states(backends: Backends, variant: str) -> None:
    backend = backends.make(variant)
    cut = backend.sync_cut()
    assert cut.states == [] and cut.timers == TimerSnapshotInfo.empty(TimerClocks())
    cut.release()


def test_rocksdb_reopen_keeps_timers_and_clocks(tmp_path: Path, backends: Backends) -> None:
    directory = tmp_path / "reused"
    options: dict[str, Any] = {"max_parallelism": M, "key_group_range": FULL_RANGE}
    backend = RocksDBKeyedStateBackend(directory, **options)
    backend.set_current_key("a")
    backend.timer_service.register_processing_time_timer(70)
    backend.timer_service.register_event_time_timer(30)
    backend.timer_service.advance_watermark(20, lambda k, t: None)
    backend.close()
    # Reopened twice, the first time without using the timers.
    RocksDBKeyedStateBackend(directory, open_existing=True, **options).close()
    reopened = backends.make("rocksdb", reopen=directory)
    cut = reopened.sync_cut()
    cut.release()
    assert cut.timers is not None
    assert cut.timers.counts == {"event": 1, "processing": 1}
    assert cut.timers.earliest == {"event": 30, "processing": 70}
    service = reopened.timer_service
    assert service.current_watermark == 20
    fired: list[tuple[str, int]] = []
    service.advance_watermark(30, lambda k, t: fired.append((k, t)))
    service.advance_processing_time(100, lambda k, t: fired.append((k, t)))
    assert fired == [("a", 30), ("a", 70)]


def test_descending_registrations_fire_in_order(backends: Backends, variant: str) -> None:
    backend = backends.make(variant)
    service = backend.timer_service
    expected = set()
    for t in range(400, 0, -1):
        for key in KEYS[:3]:
            backend.set_current_key(key)
            service.register_processing_time_timer(t)
            expected.add((t, encoded(key)))
    fired: list[tuple[int, bytes]] = []
    assert service.advance_processing_time(200, recorder(fired)) == 600
    assert service.advance_processing_time(400, recorder(fired)) == 600
    assert fired == sorted(expected)


def test_restore_into_a_reopened_rocksdb_counts_all_timers(
    tmp_path: Path, backends: Backends
) -> None:
    directory = tmp_path / "reused"
    options: dict[str, Any] = {"max_parallelism": M, "key_group_range": FULL_RANGE}
    backend = RocksDBKeyedStateBackend(directory, **options)
    backend.set_current_key("a")
    backend.timer_service.register_event_time_timer(10)
    backend.close()
    source = backends.make("heap")
    source.set_current_key("b")
    source.timer_service.register_event_time_timer(20)
    cut = source.sync_cut()
    entries = collect(cut)
    cut.release()
    reopened = backends.make("rocksdb", reopen=directory)
    restore_cut(reopened, cut, entries)
    merged = reopened.sync_cut()
    merged.release()
    assert merged.timers is not None and merged.timers.counts["event"] == 2
    fired: list[tuple[int, bytes]] = []
    reopened.timer_service.advance_watermark(MAX_TIMESTAMP, recorder(fired))
    assert fired == [(10, b"a"), (20, b"b")]


@pytest.mark.parametrize("variant", ["rocksdb-cache-2", BATCHED])
def test_changes_beyond_the_cache_are_counted_when_read(
    tmp_path: Path, backends: Backends, variant: str
) -> None:
    """Registering and deleting beyond a key group's cached timers reads nothing then: the
    changes wait and are applied (existence read, duplicates dropped) before anything
    reads the stores or writes them out. Counts, cuts, a close and a reopen taken in the
    middle of a batch must all see exactly the model's timers."""
    directory = tmp_path / "reused"
    options: dict[str, Any] = {"max_parallelism": M, "key_group_range": FULL_RANGE}
    backend = RocksDBKeyedStateBackend(directory, **options)
    backend._timer_cache_entries = 2
    service = backend.timer_service
    model = Model()
    rng = random.Random(11)
    keys = KEYS[:4]  # few keys and timestamps: many duplicates and deletes of existing timers

    def check(backend: KeyedStateBackend) -> None:
        cut = backend.sync_cut()
        entries = collect(cut)
        cut.release()
        assert cut.timers is not None
        assert cut.timers.counts == {d: len(model.timers[d]) for d in DOMAINS}
        assert sorted(entries) == sorted(model_entries(model))

    with ExitStack() as stack:
        for step in range(600):
            if variant == BATCHED and step % 100 == 0:
                stack.close()
                stack.enter_context(backend.batch())
            domain, key, timestamp = rng.choice(DOMAINS), rng.choice(keys), rng.randrange(40)
            backend.set_current_key(key)
            if rng.random() < 0.6:
                register(service, domain, timestamp)
                model.timers[domain].add((timestamp, encoded(key)))
            else:
                delete(service, domain, timestamp)
                model.timers[domain].discard((timestamp, encoded(key)))
            if step % 150 == 75:
                check(backend)
        backend.set_current_key(keys[0])
        assert listed(service, "event") == sorted(
            t for t, k in model.timers["event"] if k == encoded(keys[0])
        )
        register(service, "event", 1000)  # beyond the cache, waiting when the backend closes
        model.timers["event"].add((1000, encoded(keys[0])))
        backend.close()
    reopened = backends.make("rocksdb", reopen=directory)
    check(reopened)
    fired: list[tuple[int, bytes]] = []
    reopened.timer_service.advance_watermark(MAX_TIMESTAMP, recorder(fired))
    assert fired == sorted(model.timers["event"])
