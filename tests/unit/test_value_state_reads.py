"""A value state remembers its last read (``ValueStateImpl``, serializers with immutable
decoded values): the same operations, with reads repeated, writes, clears, drains, cuts
and batches in between, give the same reads, changelog records and cut bytes on a RocksDB
backend with and without batches and on the heap backend, as a plain-Python model does."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

from statebackend.backends.heap import HeapKeyedStateBackend
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


def make(tmp_path: Path, name: str) -> KeyedStateBackend:
    options: dict[str, Any] = {
        "max_parallelism": M,
        "key_group_range": KeyGroupRange(0, M - 1),
        "key_serializer": StrSerializer(),
    }
    backend: KeyedStateBackend
    if name == "heap":
        backend = HeapKeyedStateBackend(**options)
    else:
        backend = RocksDBKeyedStateBackend(tmp_path / name, **options)
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
@pytest.mark.parametrize("seed", [1])
def test_value_state_reads_match_with_and_without_batches_and_on_heap(
    tmp_path: Path, name: str, seed: int
) -> None:
    serializer, make_value = SERIALIZERS[name]
    ops = random_ops(seed, make_value)
    plain, batched, heap = (
        make(tmp_path, "plain"),
        make(tmp_path, "batched"),
        make(tmp_path, "heap"),
    )
    try:
        expected = run(plain, serializer, ops, batched=False)
        assert run(batched, serializer, ops, batched=True) == expected
        assert run(heap, serializer, ops, batched=False) == expected
    finally:
        plain.dispose()
        batched.dispose()
        heap.dispose()


def test_a_state_remembers_decoded_values_only_of_immutable_serializers(tmp_path: Path) -> None:
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
            assert plain.value() is plain.value()  # decoded once
            first = mutable.value()
            first[0].append(7)
            assert mutable.value() == ([1], 2) and mutable.value() is not first
    finally:
        backend.dispose()


def test_a_value_that_does_not_fit_fails_at_update_and_changes_nothing(tmp_path: Path) -> None:
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


@pytest.mark.parametrize("name", ["rocksdb", "heap"])
def test_a_remembered_read_is_forgotten_by_a_write(tmp_path: Path, name: str) -> None:
    backend = make(tmp_path, name)
    try:
        state = backend.get_state(ValueStateDescriptor("v", PLAIN))
        with backend.batch(["a"]):
            backend.set_current_key("a")  # one record for all the calls below
            assert state.value() is None
            state.update((1, "x"))
            assert state.value() == (1, "x") == state.value()
            state.update((2, "y"))
            assert state.value() == (2, "y")
            state.clear()
            assert state.value() is None
            state.update((3, "z"))
            state.update(None)
            assert state.value() is None
    finally:
        backend.dispose()
