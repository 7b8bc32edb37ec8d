"""A value state in a batch keeps its writes and decoded values (``ValueStateImpl``) and
hands the writes to its store at once (``StateStore.put_values``): the same operations
on a RocksDB backend with and without batches give the same reads, the same changelog
records and the same bytes in a cut; and both match a plain-Python model."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

from statebackend.backends.heap import HeapStateStore
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.backends.stores import CurrentKey
from statebackend.errors import SerializationError
from statebackend.keygroups import KeyGroupRange, assign_to_key_group
from statebackend.serializers import (
    IntSerializer,
    PickleSerializer,
    RowTupleSerializer,
    Serializer,
    StrSerializer,
)
from statebackend.state.descriptors import ValueStateDescriptor

M = 16
PLAIN = RowTupleSerializer(
    StructType([StructField("count", LongType()), StructField("name", StringType())]).json()
)
WITH_LIST = RowTupleSerializer(
    StructType([StructField("items", ArrayType(LongType())), StructField("n", LongType())]).json()
)
KEYS = [f"k{i}" for i in range(12)]


def plain_value(rng: random.Random) -> tuple[int, str]:
    return rng.randrange(-5, 1000), rng.choice(["", "a", "bé", "xyz"])


def list_value(rng: random.Random) -> tuple[list[int], int]:
    return [rng.randrange(10) for _ in range(rng.randrange(3))], rng.randrange(100)


SERIALIZERS: dict[str, tuple[Serializer[Any], Any]] = {
    "row-tuple": (PLAIN, plain_value),
    "row-tuple-with-list": (WITH_LIST, list_value),
    "pickle": (PickleSerializer(), list_value),
    "int": (IntSerializer(), lambda rng: rng.randrange(-(10**6), 10**6)),
}


def make(tmp_path: Path, name: str) -> RocksDBKeyedStateBackend:
    backend = RocksDBKeyedStateBackend(
        tmp_path / name,
        max_parallelism=M,
        key_group_range=KeyGroupRange(0, M - 1),
        key_serializer=StrSerializer(),
    )
    backend.enable_changelog()
    return backend


def random_ops(seed: int, make_value: Any, count: int = 600) -> list[tuple[str, str, Any]]:
    """(op, key, value) with ops "get", "exists", "update", "clear", "mutate" (change the
    value a get returned, in place if it is mutable), "drain", "cut", "keys" and
    "rebatch" (end the batch, open the next)."""
    rng = random.Random(seed)
    ops: list[tuple[str, str, Any]] = []
    for _ in range(count):
        op = rng.choices(
            ["get", "exists", "update", "clear", "mutate", "drain", "cut", "keys", "rebatch"],
            weights=[30, 15, 30, 5, 5, 2, 1, 1, 3],
        )[0]
        ops.append((op, rng.choice(KEYS), make_value(rng) if op == "update" else None))
    return ops


def drained(backend: KeyedStateBackend) -> dict[str, Any]:
    """The backend's changelog since the last drain, as plain dicts."""
    changes = backend.drain_changelog().changes
    return {name: dict(state.values) for name, state in changes.items()}


def cut_bytes(backend: KeyedStateBackend) -> list[tuple[str, int, Any]]:
    cut = backend.sync_cut()
    try:
        return [(name, group, entry) for group in range(M) for name, entry in cut.entries(group)]
    finally:
        cut.release()


def run(
    backend: KeyedStateBackend, serializer: Serializer[Any], ops: list[Any], batched: bool
) -> list[Any]:
    """Every op's observable result (reads, drained records, cut bytes, key lists)."""
    state = backend.get_state(ValueStateDescriptor("v", serializer))
    model: dict[str, Any] = {}
    seen: list[Any] = []
    batch = backend.batch(KEYS[::2]) if batched else None
    if batch is not None:
        batch.__enter__()
    for op, key, value in ops:
        backend.set_current_key(key)
        if op == "get":
            seen.append(state.value())
            assert seen[-1] == model.get(key)
        elif op == "exists":
            seen.append(state.value() is not None)
        elif op == "update":
            state.update(value)
            model[key] = value
        elif op == "clear":
            state.clear()
            model.pop(key, None)
        elif op == "mutate":
            got = state.value()
            if isinstance(got, tuple) and got and isinstance(got[0], list):
                got[0].append(99)  # the stored value must not change with it
            seen.append(state.value())
            assert seen[-1] == model.get(key)
        elif op == "drain":
            seen.append(drained(backend))
        elif op == "cut":
            seen.append(cut_bytes(backend))
        elif op == "keys":
            seen.append(sorted(backend.keys("v")))
            assert seen[-1] == sorted(model)
        elif op == "rebatch" and batch is not None:
            batch.__exit__(None, None, None)
            batch = backend.batch(KEYS[1::3])
            batch.__enter__()
    if batch is not None:
        batch.__exit__(None, None, None)
    seen.append(drained(backend))
    seen.append(cut_bytes(backend))
    return seen


@pytest.mark.parametrize("name", sorted(SERIALIZERS))
@pytest.mark.parametrize("seed", [1, 2])
def test_batched_value_state_matches_unbatched(tmp_path: Path, name: str, seed: int) -> None:
    serializer, make_value = SERIALIZERS[name]
    ops = random_ops(seed, make_value)
    plain, batched = make(tmp_path, "plain"), make(tmp_path, "batched")
    try:
        expected = run(plain, serializer, ops, batched=False)
        assert run(batched, serializer, ops, batched=True) == expected
    finally:
        plain.dispose()
        batched.dispose()


def test_a_batch_shares_decoded_values_only_of_immutable_serializers(tmp_path: Path) -> None:
    assert PLAIN.decodes_immutable and IntSerializer().decodes_immutable
    assert not WITH_LIST.decodes_immutable and not PickleSerializer().decodes_immutable
    backend = make(tmp_path, "b")
    try:
        plain = backend.get_state(ValueStateDescriptor("plain", PLAIN))
        mutable = backend.get_state(ValueStateDescriptor("mutable", WITH_LIST))
        backend.set_current_key("a")
        plain.update((1, "x"))
        mutable.update(([1], 2))
        with backend.batch(["a"]):
            backend.set_current_key("a")
            assert plain.value() is plain.value()  # decoded once in the batch
            first = mutable.value()
            first[0].append(7)
            assert mutable.value() == ([1], 2) and mutable.value() is not first
    finally:
        backend.dispose()


def test_a_value_that_does_not_fit_fails_at_update_in_a_batch(tmp_path: Path) -> None:
    backend = make(tmp_path, "b")
    try:
        state = backend.get_state(ValueStateDescriptor("v", PLAIN))
        with backend.batch(["a"]):
            backend.set_current_key("a")
            state.update((1, "x"))
            with pytest.raises(SerializationError):
                state.update(("not a long", "x"))
            assert state.value() == (1, "x")
        assert drained(backend) == {
            "v": {CurrentKey.of(group("a"), b"a").prefix: PLAIN.serialize((1, "x"))}
        }
    finally:
        backend.dispose()


def group(key: str) -> int:
    return assign_to_key_group(key.encode(), M)


def test_put_values_is_put_and_delete_one_by_one(tmp_path: Path) -> None:
    currents = [CurrentKey.of(group(k), k.encode()) for k in KEYS]
    values = {c.prefix: (None if i % 3 == 0 else f"v{i}".encode()) for i, c in enumerate(currents)}
    one_by_one, at_once = HeapStateStore(is_map=False), HeapStateStore(is_map=False)
    for current in currents:
        one_by_one.put(current, b"old")
        at_once.put(current, b"old")
    for current in currents:
        value = values[current.prefix]
        if value is None:
            one_by_one.delete(current)
        else:
            one_by_one.put(current, value)
    at_once.put_values(values)
    assert at_once.groups == one_by_one.groups
