"""One suite for both keyed backends (heap and RocksDB): every state kind, TTL, errors,
a randomized comparison with a plain-Python model, and snapshot cut / restore.

Expectations come from a plain-Python model of the state (dicts and lists), never from
the backend under test.
"""

from __future__ import annotations

import copy
import operator
import random
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import (
    KeyedStateBackend,
    KeyedStateCut,
    StateMetaInfo,
    stored_reader,
)
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.backends.stores import Entry
from statebackend.errors import (
    ConfigurationError,
    IncompatibleStateError,
    SerializationError,
    StateAccessError,
    StateBackendError,
)
from statebackend.keygroups import KeyGroupRange, assign_to_key_group
from statebackend.serializers import (
    FloatSerializer,
    IntSerializer,
    JsonSerializer,
    PickleSerializer,
    Serializer,
    StrSerializer,
    TupleSerializer,
)
from statebackend.state.descriptors import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    ValueStateDescriptor,
)
from statebackend.state.interfaces import (
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    State,
    ValueState,
)
from statebackend.state.ttl import StateTtlConfig, TtlUpdateType

M = 128
FULL_RANGE = KeyGroupRange(0, M - 1)
KINDS = ["heap", "rocksdb"]
BATCHED = "rocksdb-batched"
"""A RocksDB backend whose every state call runs in a batch (``KeyedStateBackend.batch``):
``run_ops`` ends the batch and opens the next one every ``BATCH_OPS`` operations,
prefetching the keys of the first half of them, so the suite covers reads from the
multi-get, single reads of keys not prefetched, buffered writes, and their commit."""
BATCH_OPS = 40
OPEN_BATCHES: dict[KeyedStateBackend, ExitStack] = {}


class FakeClock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now

    def at(self, offset: float) -> None:
        """Set the time to ``offset`` seconds after the start."""
        self.now = 1_000.0 + offset


class Backends:
    """Creates backends of either kind and disposes of all of them at teardown."""

    def __init__(self, tmp_path: Path, clock: FakeClock) -> None:
        self.tmp_path = tmp_path
        self.clock = clock
        self.created: list[KeyedStateBackend] = []

    def make(
        self,
        kind: str,
        *,
        key_group_range: KeyGroupRange = FULL_RANGE,
        max_parallelism: int = M,
        key_serializer: Serializer[Any] | None = None,
    ) -> KeyedStateBackend:
        """A fresh backend of ``kind`` ("heap" or "rocksdb")."""
        options: dict[str, Any] = {
            "max_parallelism": max_parallelism,
            "key_group_range": key_group_range,
            "key_serializer": key_serializer,
            "clock": self.clock,
        }
        backend: KeyedStateBackend
        if kind == "heap":
            backend = HeapKeyedStateBackend(**options)
        else:
            local_dir = self.tmp_path / f"rocksdb-{len(self.created)}"
            backend = RocksDBKeyedStateBackend(local_dir, **options)
        self.created.append(backend)
        if kind == BATCHED:
            OPEN_BATCHES[backend] = ExitStack()
            if key_serializer is None:  # KEYS are strings
                rebatch(backend, KEYS)
        return backend

    def dispose_all(self) -> None:
        for backend in self.created:
            stack = OPEN_BATCHES.pop(backend, None)
            if stack is not None:
                stack.close()
            backend.dispose()


def rebatch(backend: KeyedStateBackend, keys: Iterable[str]) -> None:
    """End a batched backend's batch and open the next one, prefetching those of
    ``keys`` in its key-group range (nothing for other backends)."""
    stack = OPEN_BATCHES.get(backend)
    if stack is None:
        return
    stack.close()
    owned = backend.key_group_range
    stack.enter_context(backend.batch(k for k in keys if key_group(k) in owned))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def backends(tmp_path: Path, clock: FakeClock) -> Iterator[Backends]:
    factory = Backends(tmp_path, clock)
    yield factory
    factory.dispose_all()


@pytest.fixture(params=[*KINDS, BATCHED])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def backend(backends: Backends, kind: str) -> KeyedStateBackend:
    return backends.make(kind)


class Average(AggregateFunction[float, tuple[float, int], "float | None"]):
    """The mean of the added numbers; accumulator (sum, count)."""

    def create_accumulator(self) -> tuple[float, int]:
        return 0.0, 0

    def add(self, value: float, accumulator: tuple[float, int]) -> tuple[float, int]:
        return accumulator[0] + value, accumulator[1] + 1

    def get_result(self, accumulator: tuple[float, int]) -> float | None:
        return accumulator[0] / accumulator[1] if accumulator[1] else None

    def merge(self, a: tuple[float, int], b: tuple[float, int]) -> tuple[float, int]:
        return a[0] + b[0], a[1] + b[1]


def make_descriptors(ttl: StateTtlConfig | None = None) -> dict[str, StateDescriptor]:
    """One descriptor of every kind, by name."""
    return {
        "value": ValueStateDescriptor("value", IntSerializer(), ttl=ttl),
        "list": ListStateDescriptor("list", IntSerializer(), ttl=ttl),
        "map": MapStateDescriptor("map", StrSerializer(), IntSerializer(), ttl=ttl),
        "reducing": ReducingStateDescriptor("reducing", operator.add, IntSerializer(), ttl=ttl),
        "aggregating": AggregatingStateDescriptor(
            "aggregating", Average(), TupleSerializer(FloatSerializer(), IntSerializer()), ttl=ttl
        ),
    }


def register(backend: KeyedStateBackend, ttl: StateTtlConfig | None = None) -> dict[str, Any]:
    """Every kind of state registered in ``backend``, by name."""
    return {name: backend.get_state(d) for name, d in make_descriptors(ttl).items()}


def key_group(key: str) -> int:
    return assign_to_key_group(key.encode("utf-8"), M)


# -- the plain-Python model ---------------------------------------------------------------

KEYS = [f"key-{i}" for i in range(50)]
USER_KEYS = [f"u{i}" for i in range(8)]
Op = tuple[str, str, str, Any]
"""(state name, key, action, argument)."""


class Model:
    """What every state should hold, as plain dicts."""

    def __init__(self) -> None:
        self.value: dict[str, int] = {}
        self.list: dict[str, list[int]] = {}
        self.map: dict[str, dict[str, int]] = {}
        self.reducing: dict[str, int] = {}
        self.aggregating: dict[str, tuple[float, int]] = {}

    def copy(self) -> Model:
        return copy.deepcopy(self)

    def apply(self, op: Op) -> Any:
        """Apply ``op``; return what a read op should observe (None for writes)."""
        name, key, action, arg = op
        if action == "clear":
            getattr(self, name).pop(key, None)
            return None
        if action == "read":
            return self.read(name, key)
        if name == "value":
            if arg is None:
                self.value.pop(key, None)
            else:
                self.value[key] = arg
        elif name == "list":
            if action == "add_all":
                if arg:
                    self.list.setdefault(key, []).extend(arg)
            elif arg:  # update
                self.list[key] = list(arg)
            else:
                self.list.pop(key, None)
        elif name == "map":
            if action == "put_all":
                self.map.setdefault(key, {}).update(arg)
            elif action == "remove":
                entries = self.map.get(key, {})
                entries.pop(arg, None)
                if not entries:
                    self.map.pop(key, None)
            elif action == "get":
                return self.map.get(key, {}).get(arg)
        elif name == "reducing":
            self.reducing[key] = self.reducing.get(key, 0) + arg
        elif name == "aggregating":
            total, count = self.aggregating.get(key, (0.0, 0))
            self.aggregating[key] = (total + arg, count + 1)
        return None

    def read(self, name: str, key: str) -> Any:
        """What a full read of ``name`` for ``key`` returns."""
        if name == "list":
            return list(self.list.get(key, []))
        if name == "map":
            return dict(self.map.get(key, {}))
        if name == "aggregating":
            if key not in self.aggregating:
                return None
            total, count = self.aggregating[key]
            return total / count
        return getattr(self, name).get(key)

    def keys(self, name: str) -> set[str]:
        return set(getattr(self, name))


def read_state(state: State) -> Any:
    """A full read of the current key's state, in the model's terms."""
    if isinstance(state, ValueState):
        return state.value()
    if isinstance(state, ListState):
        return state.get()
    if isinstance(state, MapState):
        return dict(state.items())
    assert isinstance(state, (ReducingState, AggregatingState))
    return state.get()


def apply_to_backend(backend: KeyedStateBackend, states: dict[str, Any], op: Op) -> Any:
    """Apply ``op`` to the backend's state; return what a read op observes."""
    name, key, action, arg = op
    backend.set_current_key(key)
    state = states[name]
    if action == "clear":
        state.clear()
    elif action == "read":
        return read_state(state)
    elif name == "value":
        state.update(arg)
    elif name == "list":
        if action == "add_all":
            if len(arg) == 1:
                state.add(arg[0])
            else:
                state.add_all(arg)
        else:
            state.update(arg)
    elif name == "map":
        if action == "put_all":
            if len(arg) == 1:
                ((user_key, value),) = arg.items()
                state.put(user_key, value)
            else:
                state.put_all(arg)
        elif action == "remove":
            state.remove(arg)
        elif action == "get":
            assert state.contains(arg) == (state.get(arg) is not None)
            return state.get(arg)
    else:
        state.add(arg)
    return None


def random_ops(seed: int, count: int, keys: list[str] = KEYS) -> list[Op]:
    """A reproducible mixed sequence of operations over every state kind."""
    rng = random.Random(seed)
    ops: list[Op] = []
    for _ in range(count):
        name = rng.choice(["value", "list", "map", "reducing", "aggregating"])
        key = rng.choice(keys)
        roll = rng.random()
        if roll < 0.08:
            ops.append((name, key, "clear", None))
        elif roll < 0.25:
            ops.append((name, key, "read", None))
        elif name == "value":
            ops.append((name, key, "update", None if roll < 0.3 else rng.randint(-(2**40), 2**40)))
        elif name == "list":
            values = [rng.randint(-50, 50) for _ in range(rng.choice([0, 1, 1, 2, 3]))]
            ops.append((name, key, "update" if roll < 0.35 else "add_all", values))
        elif name == "map":
            if roll < 0.4:
                ops.append((name, key, "remove", rng.choice(USER_KEYS)))
            elif roll < 0.55:
                ops.append((name, key, "get", rng.choice(USER_KEYS)))
            else:
                size = rng.choice([1, 1, 2, 3])
                entries = {rng.choice(USER_KEYS): rng.randint(-99, 99) for _ in range(size)}
                ops.append((name, key, "put_all", entries))
        else:
            ops.append((name, key, "add", rng.randint(-1000, 1000)))
    return ops


def run_ops(
    backend: KeyedStateBackend, states: dict[str, Any], model: Model, ops: list[Op]
) -> None:
    """Apply ``ops`` to both; every read must observe what the model says."""
    for position, op in enumerate(ops):
        if position % BATCH_OPS == 0:
            batch = ops[position : position + BATCH_OPS // 2]
            rebatch(backend, (key for _, key, _, _ in batch))
        expected = model.apply(op)
        observed = apply_to_backend(backend, states, op)
        assert observed == expected, op


def assert_matches_model(
    backend: KeyedStateBackend,
    states: dict[str, Any],
    model: Model,
    keys: list[str] = KEYS,
) -> None:
    """Every state of every key, and every state's key set, equal the model's."""
    for key in keys:
        backend.set_current_key(key)
        for name, state in states.items():
            assert read_state(state) == model.read(name, key), (name, key)
    for name in states:
        listed = list(backend.keys(name))
        assert len(listed) == len(set(listed)), name
        assert set(listed) == model.keys(name) & set(keys), name


# -- each state kind ----------------------------------------------------------------------


def test_value_state(backend: KeyedStateBackend) -> None:
    state = backend.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(state, ValueState)
    backend.set_current_key("a")
    assert state.value() is None
    state.update(1)
    backend.set_current_key("b")
    assert state.value() is None
    state.update(2)
    backend.set_current_key("a")
    assert state.value() == 1
    assert backend.current_key == "a"
    state.update(3)
    assert state.value() == 3
    state.update(None)
    assert state.value() is None
    state.update(4)
    state.clear()
    assert state.value() is None
    backend.set_current_key("b")
    assert state.value() == 2


def test_value_state_default(backend: KeyedStateBackend) -> None:
    state = backend.get_state(ValueStateDescriptor("v", JsonSerializer(), default=[0]))
    assert isinstance(state, ValueState)
    backend.set_current_key("a")
    assert state.value() == [0]
    state.update([1, 2])
    assert state.value() == [1, 2]
    state.clear()
    assert state.value() == [0]
    # Values are decoded fresh: mutating what a read returned changes nothing stored.
    state.update({"n": 1})
    state.value()["n"] = 2
    assert state.value() == {"n": 1}


@pytest.mark.parametrize("ttl", [None, StateTtlConfig(10)])
def test_a_mutable_default_is_not_shared(
    backend: KeyedStateBackend, ttl: StateTtlConfig | None
) -> None:
    # Callers mutate what they read for keys never written; each read starts afresh.
    state = backend.get_state(ValueStateDescriptor("v", PickleSerializer(), default=[], ttl=ttl))
    assert isinstance(state, ValueState)
    model: dict[str, list[int]] = {}
    for key in ["a", "b", "a"]:
        backend.set_current_key(key)
        read = state.value()
        assert read == model.get(key, [])
        read.append(1)
        assert state.value() == model.get(key, [])


def test_list_state(backend: KeyedStateBackend) -> None:
    state = backend.get_state(ListStateDescriptor("l", StrSerializer()))
    assert isinstance(state, ListState)
    backend.set_current_key("a")
    assert state.get() == []
    state.add("x")
    state.add_all(["y", "z"])
    state.add_all([])
    assert state.get() == ["x", "y", "z"]
    backend.set_current_key("b")
    assert state.get() == []
    state.update(["q"])
    backend.set_current_key("a")
    state.update(["p", ""])
    assert state.get() == ["p", ""]
    state.update([])
    assert state.get() == []
    assert set(backend.keys("l")) == {"b"}
    state.add("again")
    state.clear()
    assert state.get() == []
    backend.set_current_key("b")
    assert state.get() == ["q"]


def test_map_state(backend: KeyedStateBackend) -> None:
    state = backend.get_state(MapStateDescriptor("m", StrSerializer(), PickleSerializer()))
    assert isinstance(state, MapState)
    backend.set_current_key("a")
    assert state.is_empty()
    assert state.get("x") is None and not state.contains("x")
    state.put("x", 1)
    state.put_all({"y": [2], "z": {"three": 3}})
    assert state.get("x") == 1 and state.contains("y")
    assert dict(state.items()) == {"x": 1, "y": [2], "z": {"three": 3}}
    assert sorted(state.keys()) == ["x", "y", "z"]
    assert sorted(map(str, state.values())) == sorted(map(str, [1, [2], {"three": 3}]))
    state.put("x", 10)
    state.remove("y")
    state.remove("never-there")
    assert dict(state.items()) == {"x": 10, "z": {"three": 3}}
    backend.set_current_key("b")
    assert state.is_empty()
    state.put("x", -1)
    backend.set_current_key("a")
    # Changing the map while iterating over it is safe.
    for user_key, _ in state.items():
        state.remove(user_key)
    assert state.is_empty()
    state.put("w", 0)
    state.clear()
    assert state.is_empty() and state.get("w") is None
    assert set(backend.keys("m")) == {"b"}
    backend.set_current_key("b")
    assert dict(state.items()) == {"x": -1}


@pytest.mark.parametrize("ttl", [None, StateTtlConfig(10)])
def test_map_contains_an_entry_whose_value_is_none(
    backend: KeyedStateBackend, clock: FakeClock, ttl: StateTtlConfig | None
) -> None:
    state = backend.get_state(MapStateDescriptor("m", StrSerializer(), PickleSerializer(), ttl=ttl))
    assert isinstance(state, MapState)
    backend.set_current_key("a")
    clock.at(0)
    model: dict[str, Any] = {"none": None, "zero": 0}
    state.put_all(model)
    assert dict(state.items()) == model
    for user_key in ["none", "zero", "absent"]:
        assert state.contains(user_key) == (user_key in model), user_key
        assert state.get(user_key) == model.get(user_key), user_key
    if ttl is not None:
        clock.at(10)  # both entries expired
        assert not state.contains("none") and not state.contains("zero")
        assert dict(state.items()) == {}


def test_typed_user_keys_make_equal_keys_one_entry(backend: KeyedStateBackend) -> None:
    """As MapStateDescriptor documents: user keys are told apart by their bytes; pickle
    gives equal tuples different bytes when one shares an object, a typed serializer
    does not."""
    s1, s2 = "x" * 10, "".join(["x"] * 10)  # equal strings, two objects
    pickled = backend.get_state(MapStateDescriptor("pickled"))
    typed = backend.get_state(
        MapStateDescriptor("typed", TupleSerializer(StrSerializer(), StrSerializer()))
    )
    assert isinstance(pickled, MapState) and isinstance(typed, MapState)
    backend.set_current_key("a")
    model: dict[tuple[str, str], int] = {}
    for number, user_key in enumerate([(s1, s1), (s1, s2)]):
        pickled.put(user_key, number)
        typed.put(user_key, number)
        model[user_key] = number
    assert dict(typed.items()) == model
    assert len(list(pickled.items())) == 2  # documented: pickle keeps them apart


def test_map_entries_with_prefix_like_user_keys_stay_apart(backend: KeyedStateBackend) -> None:
    # Keys and user keys whose bytes are prefixes of each other must not mix.
    state = backend.get_state(MapStateDescriptor("m", StrSerializer(), IntSerializer()))
    assert isinstance(state, MapState)
    expected: dict[str, dict[str, int]] = {}
    for i, key in enumerate(["a", "ab", "a\x00", "b", "", "\xff"]):
        backend.set_current_key(key)
        entries = {"": i, "a": i + 1, "ab": i + 2, "\x00": i + 3}
        state.put_all(entries)
        expected[key] = entries
    backend.set_current_key("a")
    state.clear()
    expected.pop("a")
    for key, entries in expected.items():
        backend.set_current_key(key)
        assert dict(state.items()) == entries
    assert set(backend.keys("m")) == set(expected)


def test_reducing_state(backend: KeyedStateBackend) -> None:
    state = backend.get_state(ReducingStateDescriptor("r", max, IntSerializer()))
    assert isinstance(state, ReducingState)
    backend.set_current_key("a")
    assert state.get() is None
    for value in [3, 9, -1, 4]:
        state.add(value)
    assert state.get() == 9
    backend.set_current_key("b")
    state.add(-5)
    assert state.get() == -5
    backend.set_current_key("a")
    state.clear()
    assert state.get() is None
    state.add(1)
    assert state.get() == 1


def test_aggregating_state_average(backend: KeyedStateBackend) -> None:
    descriptor = AggregatingStateDescriptor(
        "avg", Average(), TupleSerializer(FloatSerializer(), IntSerializer())
    )
    state = backend.get_state(descriptor)
    assert isinstance(state, AggregatingState)
    rng = random.Random(3)
    expected: dict[str, list[int]] = {}
    for _ in range(300):
        key = rng.choice("abcde")
        value = rng.randint(-100, 100)
        backend.set_current_key(key)
        state.add(value)
        expected.setdefault(key, []).append(value)
    for key, values in expected.items():
        backend.set_current_key(key)
        assert state.get() == pytest.approx(sum(values) / len(values))
    backend.set_current_key("a")
    state.clear()
    assert state.get() is None
    backend.set_current_key("zzz")
    assert state.get() is None
    assert set(backend.keys("avg")) == set(expected) - {"a"}


def test_keys_lists_each_key_with_a_value_once(backend: KeyedStateBackend) -> None:
    states = register(backend)
    written = {f"k{i}" for i in range(300)}
    for key in written:
        backend.set_current_key(key)
        states["value"].update(1)
        states["list"].add_all([1, 2])
        states["map"].put_all({"a": 1, "b": 2, "c": 3})
        states["reducing"].add(1)
        states["aggregating"].add(1.0)
    for name in states:
        listed = list(backend.keys(name))
        assert len(listed) == len(written) and set(listed) == written
    for key in ["k1", "k2"]:
        backend.set_current_key(key)
        for state in states.values():
            state.clear()
    backend.set_current_key("k3")
    for user_key in "abc":
        states["map"].remove(user_key)
    assert set(backend.keys("map")) == written - {"k1", "k2", "k3"}
    assert set(backend.keys("value")) == written - {"k1", "k2"}
    with pytest.raises(StateAccessError, match="nope"):
        backend.keys("nope")


def test_same_name_same_kind_gives_the_same_state(backend: KeyedStateBackend) -> None:
    first = backend.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert backend.get_state(ValueStateDescriptor("v", IntSerializer())) is first


def test_one_name_as_two_kinds_is_rejected(backend: KeyedStateBackend) -> None:
    backend.get_state(ValueStateDescriptor("s", IntSerializer()))
    for descriptor in [
        ListStateDescriptor("s", IntSerializer()),
        MapStateDescriptor("s"),
        ReducingStateDescriptor("s", operator.add),
        AggregatingStateDescriptor("s", Average()),
    ]:
        with pytest.raises(StateAccessError, match="'s'"):
            backend.get_state(descriptor)


@pytest.mark.parametrize(
    "make",
    [
        lambda name: ValueStateDescriptor(name),
        lambda name: ListStateDescriptor(name),
        lambda name: MapStateDescriptor(name),
        lambda name: ReducingStateDescriptor(name, operator.add),
        lambda name: AggregatingStateDescriptor(name, Average()),
    ],
)
@pytest.mark.parametrize("name", ["default", ""])
def test_reserved_or_empty_name_is_rejected_by_the_descriptor(
    make: Callable[[str], StateDescriptor], name: str
) -> None:
    with pytest.raises(ConfigurationError, match=repr(name)):
        make(name)


def test_no_current_key(backend: KeyedStateBackend) -> None:
    state = backend.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(state, ValueState)
    with pytest.raises(StateAccessError, match="set_current_key"):
        state.value()


def test_none_key_is_rejected(backend: KeyedStateBackend) -> None:
    state = backend.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(state, ValueState)
    backend.set_current_key("a")
    state.update(1)
    with pytest.raises(StateAccessError, match="None"):
        backend.set_current_key(None)
    assert backend.current_key == "a" and state.value() == 1


def test_unencodable_key_is_rejected(backend: KeyedStateBackend) -> None:
    state = backend.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(state, ValueState)
    backend.set_current_key("a")
    state.update(1)
    with pytest.raises(SerializationError, match="str serializer"):
        backend.set_current_key(17)
    assert backend.current_key == "a" and state.value() == 1


def test_keys_outside_the_key_group_range_are_rejected(backends: Backends, kind: str) -> None:
    owned = KeyGroupRange(0, M // 2 - 1)
    backend = backends.make(kind, key_group_range=owned)
    states = register(backend)
    inside = [k for k in KEYS if key_group(k) in owned]
    outside = [k for k in KEYS if key_group(k) not in owned]
    assert inside and outside
    backend.set_current_key(inside[0])
    states["value"].update(7)
    states["map"].put("u", 1)
    for key in outside:
        with pytest.raises(StateAccessError) as info:
            backend.set_current_key(key)
        assert str(key_group(key)) in str(info.value)
        # Nothing changed: the previous key is still current, its state intact.
        assert backend.current_key == inside[0]
        states["value"].update(8)
        assert states["value"].value() == 8
        states["value"].update(7)
    assert dict(states["map"].items()) == {"u": 1}
    for name in states:
        assert set(backend.keys(name)) <= {inside[0]}


def test_backend_range_must_fit_max_parallelism(tmp_path: Path) -> None:
    with pytest.raises(StateAccessError):
        HeapKeyedStateBackend(max_parallelism=8, key_group_range=KeyGroupRange(0, 8))
    with pytest.raises(ConfigurationError):
        HeapKeyedStateBackend(max_parallelism=0, key_group_range=KeyGroupRange.empty())


def test_rocksdb_local_dir_must_be_empty(tmp_path: Path) -> None:
    (tmp_path / "leftover").write_text("x")
    with pytest.raises(
        StateBackendError, match=re.escape(f"directory {tmp_path} is not empty: give")
    ):
        RocksDBKeyedStateBackend(tmp_path, max_parallelism=M, key_group_range=FULL_RANGE)


def test_unencodable_values_leave_state_unchanged(backend: KeyedStateBackend) -> None:
    states = register(backend)
    backend.set_current_key("a")
    states["value"].update(1)
    states["list"].add_all([1, 2])
    states["map"].put("x", 1)
    states["reducing"].add(5)
    states["aggregating"].add(4.0)

    with pytest.raises(SerializationError, match="int serializer"):
        states["value"].update("one")
    with pytest.raises(SerializationError, match="int serializer"):
        states["value"].update(2**63)
    with pytest.raises(SerializationError, match="int serializer"):
        states["list"].add("three")
    with pytest.raises(SerializationError, match="int serializer"):
        states["list"].add_all([3, "four"])
    with pytest.raises(SerializationError, match="int serializer"):
        states["list"].update([9, 1.5])
    with pytest.raises(StateAccessError, match="None"):
        states["list"].add_all([3, None])
    with pytest.raises(SerializationError, match="int serializer"):
        states["map"].put_all({"y": 2, "z": "zwei"})
    with pytest.raises(SerializationError, match="str serializer"):
        states["map"].put(3, 3)
    with pytest.raises(StateAccessError, match="None"):
        states["map"].put(None, 3)
    with pytest.raises(SerializationError, match="int serializer"):
        states["reducing"].add(2**63 - 1)  # 5 + (2**63 - 1) overflows 64 bits
    with pytest.raises(SerializationError, match="float serializer"):
        states["aggregating"].add(1j)  # the sum becomes complex

    assert states["value"].value() == 1
    assert states["list"].get() == [1, 2]
    assert dict(states["map"].items()) == {"x": 1}
    assert states["reducing"].get() == 5
    assert states["aggregating"].get() == 4.0
    for name in states:
        assert set(backend.keys(name)) == {"a"}


def test_use_after_dispose_is_rejected(backends: Backends, kind: str) -> None:
    backend = backends.make(kind)
    states = register(backend)
    backend.set_current_key("a")
    states["value"].update(1)
    cut = backend.sync_cut()
    cut.release()
    backend.dispose()
    backend.dispose()  # idempotent
    with pytest.raises(StateAccessError, match="disposed"):
        backend.get_state(ValueStateDescriptor("other"))
    with pytest.raises(StateAccessError, match="disposed"):
        backend.set_current_key("a")
    with pytest.raises(StateAccessError, match="disposed"):
        backend.sync_cut()
    with pytest.raises(StateAccessError, match="disposed"):
        backend.keys("value")
    with pytest.raises(StateAccessError, match="disposed"):
        backend.restore(StrSerializer().config(), [], [])
    for operation in [
        lambda: states["value"].value(),
        lambda: states["value"].update(2),
        lambda: states["list"].get(),
        lambda: states["map"].get("x"),
        lambda: states["map"].put("x", 1),
        lambda: states["reducing"].add(1),
        lambda: states["aggregating"].get(),
        lambda: states["value"].clear(),
    ]:
        with pytest.raises(StateAccessError, match="disposed"):
            operation()
    if isinstance(backend, RocksDBKeyedStateBackend):
        assert not backend.local_dir.exists()


# -- TTL ---------------------------------------------------------------------------------

UPDATE_TYPES = [TtlUpdateType.ON_CREATE_AND_WRITE, TtlUpdateType.ON_READ_AND_WRITE]


@pytest.mark.parametrize("ttl_seconds", [0.0004, 0.0009, 0, -1, float("nan"), float("inf")])
def test_a_ttl_below_one_millisecond_is_rejected(ttl_seconds: float) -> None:
    # Expiries are whole milliseconds: 0.4 ms would round to 0, every value dead at once.
    with pytest.raises(ConfigurationError, match="at least 0.001"):
        StateTtlConfig(ttl_seconds)


def test_a_one_millisecond_ttl_keeps_a_value_for_one_millisecond(
    backend: KeyedStateBackend, clock: FakeClock
) -> None:
    state = backend.get_state(ValueStateDescriptor("v", IntSerializer(), ttl=StateTtlConfig(0.001)))
    assert isinstance(state, ValueState)
    backend.set_current_key("a")
    clock.at(0)
    state.update(1)
    assert state.value() == 1  # read at the instant it was written
    clock.at(0.001)
    assert state.value() is None


@pytest.mark.parametrize("update_type", UPDATE_TYPES)
def test_ttl_value_state(backend: KeyedStateBackend, clock: FakeClock, update_type: Any) -> None:
    ttl = StateTtlConfig(10, update_type)
    state = backend.get_state(ValueStateDescriptor("v", IntSerializer(), default=-1, ttl=ttl))
    assert isinstance(state, ValueState)
    on_read = update_type is TtlUpdateType.ON_READ_AND_WRITE
    backend.set_current_key("a")
    clock.at(0)
    state.update(1)
    clock.at(9.5)
    assert state.value() == 1  # refreshes to 19.5 when on read
    clock.at(10)  # expired exactly at write + TTL
    assert state.value() == (1 if on_read else -1)
    clock.at(19)
    assert state.value() == (1 if on_read else -1)
    clock.at(40)
    assert state.value() == -1
    # A write refreshes in both modes.
    clock.at(50)
    state.update(2)
    clock.at(55)
    state.update(3)
    clock.at(64)
    assert state.value() == 3
    clock.at(100)
    assert state.value() == -1
    assert list(backend.keys("v")) == []  # an expired value met on read is removed


@pytest.mark.parametrize("update_type", UPDATE_TYPES)
def test_ttl_list_elements(backend: KeyedStateBackend, clock: FakeClock, update_type: Any) -> None:
    ttl = StateTtlConfig(10, update_type)
    state = backend.get_state(ListStateDescriptor("l", IntSerializer(), ttl=ttl))
    assert isinstance(state, ListState)
    backend.set_current_key("a")
    clock.at(0)
    state.add(1)
    clock.at(5)
    state.add_all([2, 3])
    if update_type is TtlUpdateType.ON_CREATE_AND_WRITE:
        clock.at(9)
        assert state.get() == [1, 2, 3]
        clock.at(12)
        assert state.get() == [2, 3]
        # Dropping the expired element must not extend the others' time to live.
        clock.at(15)
        assert state.get() == []
    else:
        clock.at(8)
        assert state.get() == [1, 2, 3]  # all refreshed to 18
        clock.at(17)
        assert state.get() == [1, 2, 3]  # refreshed to 27
        clock.at(27)
        assert state.get() == []
    assert list(backend.keys("l")) == []
    clock.at(100)
    state.add(4)
    assert state.get() == [4]


@pytest.mark.parametrize("update_type", UPDATE_TYPES)
def test_ttl_map_entries(backend: KeyedStateBackend, clock: FakeClock, update_type: Any) -> None:
    ttl = StateTtlConfig(10, update_type)
    state = backend.get_state(MapStateDescriptor("m", StrSerializer(), IntSerializer(), ttl=ttl))
    assert isinstance(state, MapState)
    backend.set_current_key("a")
    clock.at(0)
    state.put_all({"a": 1, "b": 2})
    if update_type is TtlUpdateType.ON_CREATE_AND_WRITE:
        clock.at(5)
        state.put("b", 3)  # written again: lives until 15
        assert state.get("a") == 1  # a read does not refresh
        clock.at(12)
        assert state.get("a") is None and not state.contains("a")
        assert state.get("b") == 3
        assert dict(state.items()) == {"b": 3}
        clock.at(15)
        assert dict(state.items()) == {} and state.is_empty()
    else:
        clock.at(8)
        assert state.get("a") == 1  # a refreshed to 18, b not
        clock.at(12)
        assert state.get("b") is None
        assert dict(state.items()) == {"a": 1}  # a refreshed to 22
        clock.at(21)
        assert state.contains("a")  # refreshed to 31
        clock.at(31)
        assert dict(state.items()) == {}
    assert list(backend.keys("m")) == []


@pytest.mark.parametrize("update_type", UPDATE_TYPES)
def test_ttl_reducing_and_aggregating(
    backend: KeyedStateBackend, clock: FakeClock, update_type: Any
) -> None:
    states = register(backend, StateTtlConfig(10, update_type))
    on_read = update_type is TtlUpdateType.ON_READ_AND_WRITE
    backend.set_current_key("a")
    clock.at(0)
    states["reducing"].add(5)
    states["aggregating"].add(4.0)
    clock.at(3)
    states["reducing"].add(2)  # written at 3: lives until 13
    states["aggregating"].add(2.0)
    clock.at(12)
    assert states["reducing"].get() == 7  # refreshed to 22 when on read
    assert states["aggregating"].get() == 3.0
    clock.at(13)
    assert states["reducing"].get() == (7 if on_read else None)
    assert states["aggregating"].get() == (3.0 if on_read else None)
    clock.at(50)
    states["reducing"].add(1)
    states["aggregating"].add(1.0)
    assert states["reducing"].get() == 1
    assert states["aggregating"].get() == 1.0


def test_ttl_expired_values_never_returned_randomized(
    backend: KeyedStateBackend, clock: FakeClock
) -> None:
    # Writes at random times; every read must see exactly the values written within the
    # TTL (on create and write), computed by a plain model of write times.
    states = register(backend, StateTtlConfig(10))
    rng = random.Random(11)
    written: dict[str, tuple[int, float]] = {}
    elements: dict[str, list[tuple[int, float]]] = {}
    entries: dict[str, dict[str, tuple[int, float]]] = {}
    now = 0.0
    for step in range(1500):
        if step % BATCH_OPS == 0:
            rebatch(backend, KEYS[:5])
        now += rng.choice([0, 0.5, 1, 2, 3])
        clock.at(now)
        key = rng.choice(KEYS[:10])
        backend.set_current_key(key)
        value = rng.randint(0, 1000)
        choice = rng.random()
        if choice < 0.2:
            states["value"].update(value)
            written[key] = (value, now)
        elif choice < 0.4:
            alive = written.get(key)
            expected = alive[0] if alive and alive[1] + 10 > now else None
            assert states["value"].value() == expected
        elif choice < 0.55:
            states["list"].add(value)
            elements.setdefault(key, []).append((value, now))
        elif choice < 0.7:
            live = [(v, t) for v, t in elements.get(key, []) if t + 10 > now]
            elements[key] = live
            assert states["list"].get() == [v for v, _ in live]
        elif choice < 0.85:
            user_key = rng.choice("abc")
            states["map"].put(user_key, value)
            entries.setdefault(key, {})[user_key] = (value, now)
        else:
            expected_map = {u: v for u, (v, t) in entries.get(key, {}).items() if t + 10 > now}
            assert dict(states["map"].items()) == expected_map


# -- randomized comparison with the model -------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_random_operations_match_the_model(backend: KeyedStateBackend, seed: int) -> None:
    states = register(backend)
    model = Model()
    ops = random_ops(seed, 3000)
    for start in range(0, len(ops), 500):
        run_ops(backend, states, model, ops[start : start + 500])
        assert_matches_model(backend, states, model)


# -- snapshot cut and restore -------------------------------------------------------------


def collect(cut: KeyedStateCut) -> list[tuple[str, int, Entry]]:
    """Every entry of the cut, key group by key group."""
    return [
        (name, kg, entry) for kg in range(cut.max_parallelism) for name, entry in cut.entries(kg)
    ]


def cut_data(
    backend: KeyedStateBackend,
) -> tuple[dict[str, Any], list[StateMetaInfo], list[tuple[str, int, Entry]]]:
    """What a cut of ``backend`` carries (key serializer config, state meta infos and
    entries), the cut released: the arguments of ``restore``."""
    cut = backend.sync_cut()
    try:
        return cut.key_serializer, list(cut.states), collect(cut)
    finally:
        cut.release()


class CutData:
    """What a snapshot carries: key serializer config, state meta infos and entries."""

    def __init__(
        self,
        key_serializer: dict[str, Any],
        states: list[StateMetaInfo],
        entries: list[tuple[str, int, Entry]],
    ) -> None:
        self.key_serializer = key_serializer
        self.states = states
        self.entries = entries


def take_cut(
    backend: KeyedStateBackend, seed: int, count: int
) -> tuple[dict[str, Any], Model, Model, CutData]:
    """Register every state kind and run ``count`` random operations; cut, modify the
    backend afterwards, then read the cut: it must not see the changes. The states, the
    model now and at the cut, and the cut's data."""
    states = register(backend)
    model = Model()
    run_ops(backend, states, model, random_ops(seed, count))
    at_cut = model.copy()
    cut = backend.sync_cut()
    # Modify everything after the cut: new values, clears, new keys.
    run_ops(backend, states, model, random_ops(seed + 1000, 800, KEYS + ["late-1", "late-2"]))
    for key in KEYS[:10]:
        backend.set_current_key(key)
        for state in states.values():
            state.clear()
        model_clear(model, key)
    data = CutData(cut.key_serializer, list(cut.states), collect(cut))
    cut.release()
    return states, model, at_cut, data


def model_clear(model: Model, key: str) -> None:
    for name in ["value", "list", "map", "reducing", "aggregating"]:
        model.apply((name, key, "clear", None))


@pytest.mark.parametrize("target_kind", KINDS)
def test_snapshot_round_trip(backends: Backends, kind: str, target_kind: str) -> None:
    source = backends.make(kind)
    states, model, at_cut, data = take_cut(source, 7, 2000)
    assert {name for name, _, _ in data.entries} == set(states)
    assert [kg for _, kg, _ in data.entries] == sorted(kg for _, kg, _ in data.entries)
    for name, kg, (key, _, _) in data.entries:
        assert kg == assign_to_key_group(key, M), name

    target = backends.make(target_kind)
    target.restore(data.key_serializer, data.states, data.entries)
    restored = register(target)
    everything = KEYS + ["late-1", "late-2"]
    assert_matches_model(target, restored, at_cut, everything)
    # The source still has its later changes, and the restored backend keeps working.
    assert_matches_model(source, states, model, everything)
    run_ops(target, restored, at_cut, random_ops(8, 500))
    assert_matches_model(target, restored, at_cut, everything)


@pytest.mark.parametrize("target_kind", KINDS)
def test_restore_into_two_halves(backends: Backends, kind: str, target_kind: str) -> None:
    states, _, at_cut, data = take_cut(backends.make(kind), 21, 1500)
    halves = [KeyGroupRange(0, M // 2 - 1), KeyGroupRange(M // 2, M - 1)]
    seen: dict[str, set[str]] = {name: set() for name in states}
    for half in halves:
        target = backends.make(target_kind, key_group_range=half)
        target.restore(data.key_serializer, data.states, data.entries)
        restored = register(target)
        mine = [k for k in KEYS if key_group(k) in half]
        assert_matches_model(target, restored, at_cut, mine)
        for name in states:
            keys = set(target.keys(name))
            assert keys == {k for k in at_cut.keys(name) if key_group(k) in half}
            assert seen[name].isdisjoint(keys)
            seen[name] |= keys
        other = next(k for k in KEYS if key_group(k) not in half)
        with pytest.raises(StateAccessError):
            target.set_current_key(other)
    for name in states:
        assert seen[name] == at_cut.keys(name)


def test_heap_and_rocksdb_cuts_are_identical(backends: Backends, clock: FakeClock) -> None:
    cuts = []
    for kind in KINDS:
        backend = backends.make(kind)
        states = register(backend)
        ttl = backend.get_state(
            MapStateDescriptor("ttl-map", StrSerializer(), IntSerializer(), ttl=StateTtlConfig(60))
        )
        assert isinstance(ttl, MapState)
        clock.at(0)
        model = Model()
        run_ops(backend, states, model, random_ops(99, 2000))
        for i, key in enumerate(KEYS):
            backend.set_current_key(key)
            ttl.put(f"u{i % 3}", i)
        cuts.append(cut_data(backend))
    heap, rocksdb = cuts
    assert heap[0] == rocksdb[0]
    assert heap[1] == rocksdb[1]
    assert [meta.name for meta in heap[1]] == sorted(meta.name for meta in heap[1])
    assert len(heap[2]) > 300
    assert heap[2] == rocksdb[2]


def test_empty_backend_cut(backend: KeyedStateBackend) -> None:
    cut = backend.sync_cut()
    assert cut.states == [] and collect(cut) == []
    cut.release()
    register(backend)
    cut = backend.sync_cut()
    assert [meta.name for meta in cut.states] == sorted(make_descriptors())
    assert collect(cut) == []
    cut.release()
    cut.release()


def value_list_map(
    backend: KeyedStateBackend, serializer: Serializer[Any]
) -> tuple[ValueState, ListState, MapState]:
    """States ``v``, ``l`` and ``m`` (str keys) of ``backend``, their values in
    ``serializer``."""
    value = backend.get_state(ValueStateDescriptor("v", serializer))
    items = backend.get_state(ListStateDescriptor("l", serializer))
    entries = backend.get_state(MapStateDescriptor("m", StrSerializer(), serializer))
    assert isinstance(value, ValueState) and isinstance(items, ListState)
    assert isinstance(entries, MapState)
    return value, items, entries


@pytest.mark.parametrize("target_kind", KINDS)
def test_restore_migrates_int_to_float(backends: Backends, kind: str, target_kind: str) -> None:
    source = backends.make(kind)
    value, items, entries = value_list_map(source, IntSerializer())
    for i, key in enumerate(KEYS):
        source.set_current_key(key)
        value.update(i * 3)
        items.add_all([i, -i, 2**40])
        entries.put_all({"a": i, "b": -i})
    data = cut_data(source)

    target = backends.make(target_kind)
    target.restore(*data)
    new_value, new_items, new_entries = value_list_map(target, FloatSerializer())
    for i, key in enumerate(KEYS):
        target.set_current_key(key)
        restored_value = new_value.value()
        assert restored_value == float(i * 3) and isinstance(restored_value, float)
        restored_items = new_items.get()
        assert restored_items == [float(i), float(-i), float(2**40)]
        assert all(isinstance(x, float) for x in restored_items)
        assert dict(new_entries.items()) == {"a": float(i), "b": float(-i)}
        new_items.add(0.5)
        assert new_items.get()[-1] == 0.5
    # A cut of the migrated state records the new serializer.
    cut = target.sync_cut()
    by_name = {meta.name: meta for meta in cut.states}
    assert by_name["v"].serializers["value"] == FloatSerializer().config()
    assert by_name["l"].serializers["value"] == FloatSerializer().config()
    cut.release()


@pytest.mark.parametrize("target_kind", KINDS)
def test_restore_rejects_incompatible_serializers_and_kinds(
    backends: Backends, kind: str, target_kind: str
) -> None:
    source = backends.make(kind)
    words = source.get_state(ValueStateDescriptor("word", StrSerializer()))
    entries = source.get_state(MapStateDescriptor("m", StrSerializer(), IntSerializer()))
    assert isinstance(words, ValueState) and isinstance(entries, MapState)
    source.set_current_key("a")
    words.update("hello")
    entries.put("x", 1)
    data = cut_data(source)

    target = backends.make(target_kind)
    target.restore(*data)
    with pytest.raises(IncompatibleStateError, match="'word'"):
        target.get_state(ValueStateDescriptor("word", IntSerializer()))
    with pytest.raises(IncompatibleStateError, match="'word'"):
        target.get_state(ListStateDescriptor("word", StrSerializer()))
    with pytest.raises(IncompatibleStateError, match="'m'"):
        target.get_state(MapStateDescriptor("m", IntSerializer(), IntSerializer()))
    with pytest.raises(IncompatibleStateError, match="'word'"):
        target.get_state(ValueStateDescriptor("word", StrSerializer(), ttl=StateTtlConfig(5)))

    other = backends.make(target_kind)
    other.restore(*data)
    word = other.get_state(ValueStateDescriptor("word", StrSerializer()))
    assert isinstance(word, ValueState)
    other.set_current_key("a")
    assert word.value() == "hello"
    with pytest.raises(StateAccessError, match="restore before get_state"):
        other.restore(*data)


def test_restore_rejects_a_different_key_serializer(backends: Backends, kind: str) -> None:
    source = backends.make(kind)
    state = source.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(state, ValueState)
    source.set_current_key("a")
    state.update(1)
    data = cut_data(source)
    for target_kind in KINDS:
        target = backends.make(target_kind, key_serializer=PickleSerializer())
        with pytest.raises(IncompatibleStateError, match="key serializer"):
            target.restore(*data)


def test_restore_with_ttl_keeps_expiry(backends: Backends, kind: str, clock: FakeClock) -> None:
    source = backends.make(kind)
    ttl = StateTtlConfig(10)
    state = source.get_state(ValueStateDescriptor("v", IntSerializer(), ttl=ttl))
    assert isinstance(state, ValueState)
    clock.at(0)
    source.set_current_key("a")
    state.update(1)
    clock.at(5)
    source.set_current_key("b")
    state.update(2)
    data = cut_data(source)
    for target_kind in KINDS:
        target = backends.make(target_kind)
        target.restore(*data)
        restored = target.get_state(ValueStateDescriptor("v", FloatSerializer(), ttl=ttl))
        assert isinstance(restored, ValueState)
        clock.at(9)
        target.set_current_key("a")
        assert restored.value() == 1.0
        clock.at(12)
        assert restored.value() is None
        target.set_current_key("b")
        assert restored.value() == 2.0
        clock.at(15)
        assert restored.value() is None
        without_ttl = backends.make(target_kind)
        without_ttl.restore(*data)
        for descriptor in [
            ValueStateDescriptor("v", IntSerializer()),
            ValueStateDescriptor("v", PickleSerializer()),
        ]:
            with pytest.raises(IncompatibleStateError, match="'v'"):
                without_ttl.get_state(descriptor)


def test_rocksdb_cut_checkpoint_directory_lives_until_release(backends: Backends) -> None:
    backend = backends.make("rocksdb")
    assert isinstance(backend, RocksDBKeyedStateBackend)
    states = register(backend)
    run_ops(backend, states, Model(), random_ops(5, 300))
    before = set(backend.local_dir.iterdir())
    cut = backend.sync_cut()
    created = set(backend.local_dir.iterdir()) - before
    assert len(created) == 1
    (cut_dir,) = created
    assert cut_dir.is_dir() and any(cut_dir.rglob("CURRENT"))
    second = backend.sync_cut()
    assert len(set(backend.local_dir.iterdir()) - before) == 2
    collect(cut)
    cut.release()
    assert not cut_dir.exists()
    assert len(set(backend.local_dir.iterdir()) - before) == 1
    second.release()
    second.release()
    assert set(backend.local_dir.iterdir()) == before


# -- batches (``KeyedStateBackend.batch``) --------------------------------------------------


def test_a_batch_keeps_equal_keys_of_other_types_and_unhashable_keys_apart(
    backends: Backends, kind: str
) -> None:
    # 1 == 1.0 == True, but they serialize to three keys; a list key cannot be hashed.
    backend = backends.make(kind, key_serializer=PickleSerializer())
    state = backend.get_state(ValueStateDescriptor("v", PickleSerializer()))
    assert isinstance(state, ValueState)
    keys: list[Any] = [1, 1.0, True, [1, 2], (1,), (1.0,)]
    expected = {repr(key): [] for key in keys}
    for round_ in range(3):
        with backend.batch(keys[round_:]):
            for key in keys:
                backend.set_current_key(key)
                state.update((state.value() or []) + [round_])
                expected[repr(key)].append(round_)
    for key in keys:
        backend.set_current_key(key)
        assert state.value() == expected[repr(key)], key
    assert len(list(backend.keys("v"))) == len(keys)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_refuses_the_keys_set_current_key_refuses(backends: Backends, kind: str) -> None:
    """The read-ahead computes its keys' records all at once; a key that fails a check
    fails as ``set_current_key`` fails on it (in the heap backend too, which reads
    nothing ahead), and the others' records are the ones ``set_current_key`` computes."""
    half = KeyGroupRange(0, M // 2 - 1)
    backend = backends.make(kind, key_group_range=half)
    state = backend.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(state, ValueState)
    owned = [key for key in KEYS if key_group(key) in half]
    outside = next(key for key in KEYS if key_group(key) not in half)
    for bad, error, message in (
        (None, StateAccessError, "None cannot be a key"),
        (outside, StateAccessError, "outside this backend's key-group range"),
        (5, SerializationError, "str serializer"),
    ):
        with pytest.raises(error, match=message), backend.batch([*owned[:3], bad]):
            pass
    with backend.batch(owned):
        for number, key in enumerate(owned):
            backend.set_current_key(key)
            state.update(number)
    for number, key in enumerate(owned):
        backend.set_current_key(key)
        assert state.value() == number


def test_a_batch_writes_when_it_ends_and_before_cuts_and_drains(backends: Backends) -> None:
    backend = backends.make("rocksdb")
    backend.enable_changelog()
    state = backend.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(state, ValueState)
    with pytest.raises(StateAccessError, match="already open"), backend.batch(["a"]):
        backend.set_current_key("a")
        state.update(1)
        cut = backend.sync_cut()
        one = IntSerializer().serialize(1)
        assert [entry for _, _, entry in collect(cut)] == [(b"a", b"", one)]
        cut.release()
        backend.set_current_key("b")
        state.update(2)
        assert len(backend.drain_changelog()) == 2
        with backend.batch([]):
            pass
    assert isinstance(backend, RocksDBKeyedStateBackend)
    backend.close()  # the batch's writes are in the database that close() keeps
    reopened = RocksDBKeyedStateBackend(
        backend.local_dir, open_existing=True, max_parallelism=M, key_group_range=FULL_RANGE
    )
    backends.created.append(reopened)
    restored = reopened.get_state(ValueStateDescriptor("v", IntSerializer()))
    assert isinstance(restored, ValueState)
    for key, value in (("a", 1), ("b", 2)):
        reopened.set_current_key(key)
        assert restored.value() == value


def test_estimated_entries_counts_values_map_entries_and_timers(backend: KeyedStateBackend) -> None:
    """What a checkpoint's metrics record per subtask: every distinct (state, key) value,
    every map entry and every timer, as a plain count of what was written (RocksDB's
    estimate is exact for distinct keys written once, as here)."""
    states = register(backend)
    rng = random.Random(5)
    model: dict[tuple[str, str], int] = {}
    for n in range(300):
        key = f"user-{n}"
        backend.set_current_key(key)
        states["value"].update(n)
        model[("value", key)] = 1
        if rng.random() < 0.5:
            users = {f"u{i}" for i in range(rng.randint(1, 4))}
            states["map"].put_all({u: 1 for u in users})
            model[("map", key)] = len(users)
        if rng.random() < 0.3:
            backend.timer_service.register_event_time_timer(1000 + n)
            model[("timer", key)] = 2  # by time and by key
    assert backend.estimated_entries() == sum(model.values())


def test_a_map_state_declared_with_other_user_keys_is_one_line_naming_both() -> None:
    """The refusal names the state, the stored and the declared user keys as a processor
    declares them, and what to do, in one line."""
    stored = StateMetaInfo.of(MapStateDescriptor("m", StrSerializer(), IntSerializer()))
    declared = MapStateDescriptor("m", IntSerializer(), IntSerializer())
    with pytest.raises(IncompatibleStateError) as refused:
        stored_reader(stored, declared)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"map state 'm' was stored with user keys {StrSerializer()!r}, which "
        f"{IntSerializer()!r} cannot read"
    )
    assert message.endswith("declare the user key as it was stored, or give the state another name")
