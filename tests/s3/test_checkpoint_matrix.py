"""The FLIP-8 test plan as a matrix: checkpoint at parallelism P, restore at P'.

One operator holds keyed state of all five kinds (value, list, map, reducing,
aggregating) and operator state of all three modes (split, union, broadcast). For every
pair P -> P' in {1, 2, 3, 4, 7}, on the heap and RocksDB backends (restoring into the
other kind for some P'), on ``file://`` and ``s3://``, and with the three compression
codecs, every key's state and every operator-state element must come back exactly once
and equal a plain-Python model of the operations that were applied.

The checkpoint of each (backend, storage, P) is written once and cached for the module;
each test restores it at one P'.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import (
    plan_restore,
    restore_keyed_state,
    restore_operator_state,
)
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import IntSerializer, StrSerializer, TupleSerializer
from statebackend.state.descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from tests.conftest import Storage
from tests.unit.test_writer_inputs import Average

MAX_PARALLELISM = 128
PARALLELISMS = (1, 2, 3, 4, 7)
KEYS = [f"user-{n}" for n in range(200)]
OPERATOR = "enrich"
CODECS = ("none", "lz4", "zstd")


def _add(a: int, b: int) -> int:
    return a + b


def descriptors() -> dict[str, Any]:
    """The operator's five keyed states, by name."""
    return {
        "count": ValueStateDescriptor("count", IntSerializer(), default=0),
        "events": ListStateDescriptor("events", IntSerializer()),
        "attrs": MapStateDescriptor("attrs", StrSerializer(), IntSerializer()),
        "total": ReducingStateDescriptor("total", _add, IntSerializer()),
        "average": AggregatingStateDescriptor(
            "average", Average(), TupleSerializer(IntSerializer(), IntSerializer())
        ),
    }


@dataclass
class KeyModel:
    """The plain-Python expectation of one key's five states."""

    count: int | None = None
    events: list[int] | None = None
    attrs: dict[str, int] | None = None
    total: int | None = None
    average_sum: int = 0
    average_n: int = 0

    def snapshot(self) -> dict[str, Any]:
        """The values a restore must reproduce (None: the key has no such state)."""
        return {
            "count": self.count,
            "events": list(self.events) if self.events else None,
            "attrs": dict(self.attrs) if self.attrs else None,
            "total": self.total,
            "average": self.average_sum / self.average_n if self.average_n else None,
        }


@dataclass
class Built:
    """A completed checkpoint and the model of what it holds."""

    storage: Storage
    checkpoint_id: int
    compression: str
    keyed: dict[str, dict[str, Any]]
    split: list[list[int]]
    union: list[list[str]]
    broadcast: dict[str, int]


def make_backend(kind: str, local_dir: Path, parallelism: int, index: int) -> KeyedStateBackend:
    """A keyed backend of ``kind`` for subtask ``index`` of ``parallelism``."""
    key_groups = compute_key_group_range_for_operator_index(MAX_PARALLELISM, parallelism, index)
    if kind == "rocksdb":
        return RocksDBKeyedStateBackend(
            local_dir, max_parallelism=MAX_PARALLELISM, key_group_range=key_groups
        )
    return HeapKeyedStateBackend(max_parallelism=MAX_PARALLELISM, key_group_range=key_groups)


def restore_kind(kind: str, new_parallelism: int) -> str:
    """The backend kind a checkpoint of ``kind`` restores into at P': the other kind when
    P' is odd, so that both directions are covered."""
    return kind if new_parallelism % 2 == 0 else {"heap": "rocksdb", "rocksdb": "heap"}[kind]


def subtask_of(key: str, parallelism: int) -> int:
    """The subtask that owns ``key`` (Flink's formulas, computed here independently)."""
    group = assign_to_key_group(key.encode(), MAX_PARALLELISM)
    return compute_operator_index_for_key_group(MAX_PARALLELISM, parallelism, group)


def apply_random_operations(
    rng: random.Random, backends: list[KeyedStateBackend], models: dict[str, KeyModel], n: int
) -> None:
    """``n`` random operations on random keys, applied to the backends and to ``models``."""
    parallelism = len(backends)
    states: list[dict[str, Any]] = [
        {name: b.get_state(d) for name, d in descriptors().items()} for b in backends
    ]
    for _ in range(n):
        key = rng.choice(KEYS)
        index = subtask_of(key, parallelism)
        backend, state, model = backends[index], states[index], models.setdefault(key, KeyModel())
        backend.set_current_key(key)
        op = rng.randrange(9)
        value = rng.randrange(-1000, 1000)
        if op == 0:
            state["count"].update(value)
            model.count = value
        elif op == 1:
            state["count"].update(state["count"].value() + 1)
            model.count = (model.count or 0) + 1
        elif op == 2:
            state["events"].add(value)
            model.events = [*(model.events or []), value]
        elif op == 3:
            replacement = [rng.randrange(100) for _ in range(rng.randrange(4))]
            state["events"].update(replacement)
            model.events = replacement
        elif op == 4:
            attr = f"a{rng.randrange(6)}"
            state["attrs"].put(attr, value)
            model.attrs = {**(model.attrs or {}), attr: value}
        elif op == 5:
            attr = f"a{rng.randrange(6)}"
            state["attrs"].remove(attr)
            if model.attrs:
                model.attrs.pop(attr, None)
        elif op == 6:
            state["total"].add(value)
            model.total = value if model.total is None else model.total + value
        elif op == 7:
            state["average"].add(value)
            model.average_sum += value
            model.average_n += 1
        else:
            state["count"].clear()
            model.count = None


_CACHE: dict[tuple[str, str, int], Built] = {}


def build_checkpoint(
    kind: str, storage: Storage, parallelism: int, local_root: Path, seed: int
) -> Built:
    """Run the operator at ``parallelism``, checkpoint it, change it further; return the
    model of the state at the checkpoint."""
    rng = random.Random(seed)
    compression = CODECS[parallelism % len(CODECS)]
    checkpoints = CheckpointStorage(
        storage.url,
        "job",
        storage_options=storage.storage_options,
        compression=compression,
    )
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=MAX_PARALLELISM)
    backends = [
        make_backend(kind, local_root / f"{kind}-{parallelism}-{i}", parallelism, i)
        for i in range(parallelism)
    ]
    try:
        models: dict[str, KeyModel] = {}
        apply_random_operations(rng, backends, models, 1500)
        split = [[i * 1000 + j for j in range(rng.randrange(0, 6))] for i in range(parallelism)]
        union = [[f"w{i}-{j}" for j in range(rng.randrange(1, 4))] for i in range(parallelism)]
        broadcast = {f"rule-{n}": rng.randrange(100) for n in range(5)}
        operators = []
        for i in range(parallelism):
            ops = OperatorStateBackend()
            ops.get_list_state("offsets", IntSerializer()).add_all(split[i])
            ops.get_union_list_state("watermarks", StrSerializer()).add_all(union[i])
            ops.get_broadcast_state("rules", StrSerializer(), IntSerializer()).put_all(broadcast)
            operators.append(ops)

        checkpoint_id = coordinator.trigger({OPERATOR: parallelism})
        futures = []
        for i in range(parallelism):
            target = checkpoints.snapshot_target(checkpoint_id, OPERATOR, i)
            futures.append(
                (
                    backends[i].snapshot(checkpoint_id, target),
                    target.write_operator_snapshot(checkpoint_id, operators[i].sync_cut()),
                )
            )
        expected = {key: model.snapshot() for key, model in models.items()}
        # Processing goes on while the snapshot uploads: none of this is in the checkpoint.
        apply_random_operations(rng, backends, models, 300)
        for ops in operators:
            ops.get_list_state("offsets", IntSerializer()).add(-1)
            ops.get_broadcast_state("rules", StrSerializer(), IntSerializer()).put("late", 1)
        for i, (keyed, operator_state) in enumerate(futures):
            ack = SubtaskAck(
                OPERATOR,
                i,
                parallelism,
                keyed.result(),
                operator_state.result(),
                coordinator.run_id,
            )
            checkpoints.write_ack(checkpoint_id, ack)
        assert coordinator.poll(checkpoint_id) is not None
    finally:
        for backend in backends:
            backend.dispose()
        checkpoints.close()
    return Built(storage, checkpoint_id, compression, expected, split, union, broadcast)


def read_keyed(backend: KeyedStateBackend) -> dict[str, dict[str, Any]]:
    """Every key's five states as read through the state interfaces, asserting that no
    key is listed twice for a state."""
    states: dict[str, Any] = {name: backend.get_state(d) for name, d in descriptors().items()}
    keys_per_state = {name: list(backend.keys(name)) for name in states}
    for name, keys in keys_per_state.items():
        assert len(keys) == len(set(keys)), f"state {name} lists a key twice"
    found: dict[str, dict[str, Any]] = {}
    for key in sorted({k for keys in keys_per_state.values() for k in keys}):
        backend.set_current_key(key)
        events = states["events"].get()
        attrs = dict(states["attrs"].items())
        found[key] = {
            "count": states["count"].value() if key in keys_per_state["count"] else None,
            "events": events or None,
            "attrs": attrs or None,
            "total": states["total"].get(),
            "average": states["average"].get(),
        }
    return found


def expected_split(split: list[list[int]], new_parallelism: int) -> list[list[int]]:
    """Flink's round-robin split of one state, computed independently: the old lists
    concatenated and cut into consecutive chunks (the first ``total % P'`` one longer)."""
    flat = [element for elements in split for element in elements]
    if len(split) == new_parallelism:
        return [list(elements) for elements in split]
    base, extra = divmod(len(flat), new_parallelism)
    out, start = [], 0
    for i in range(new_parallelism):
        size = base + (1 if i < extra else 0)
        out.append(flat[start : start + size])
        start += size
    return out


@pytest.fixture(scope="module")
def local_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Local directories of the RocksDB backends of this module."""
    return tmp_path_factory.mktemp("matrix-local")


@pytest.mark.parametrize("new_parallelism", PARALLELISMS)
@pytest.mark.parametrize("parallelism", PARALLELISMS)
@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_rescale(
    kind: str,
    parallelism: int,
    new_parallelism: int,
    checkpoint_url: Storage,
    local_root: Path,
) -> None:
    """Checkpoint at P with ``kind``, restore at P' (into the other kind when P' is odd):
    all state is there exactly once and equals the model."""
    scheme = checkpoint_url.url.split("://", 1)[0]
    cache_key = (kind, scheme, parallelism)
    if cache_key not in _CACHE:
        seed = parallelism * 31 + len(kind)
        _CACHE[cache_key] = build_checkpoint(
            kind, checkpoint_url, parallelism, local_root / scheme, seed
        )
    built = _CACHE[cache_key]
    target_kind = restore_kind(kind, new_parallelism)

    checkpoints = CheckpointStorage(
        built.storage.url, "job", storage_options=built.storage.storage_options
    )
    metadata = checkpoints.load(built.checkpoint_id)
    directory = checkpoints.resolve(built.checkpoint_id)
    assert metadata.operators[OPERATOR].parallelism == parallelism
    assert {
        ack.keyed.compression for ack in metadata.operators[OPERATOR].subtasks if ack.keyed
    } <= {built.compression, "none"}
    plans = plan_restore(metadata, OPERATOR, new_parallelism)
    assert [plan.subtask for plan in plans] == list(range(new_parallelism))

    restored: dict[str, dict[str, Any]] = {}
    splits, unions, broadcasts = [], [], []
    local = local_root / f"restore-{kind}-{scheme}-{parallelism}-{new_parallelism}"
    for i in range(new_parallelism):
        backend = make_backend(target_kind, local / str(i), new_parallelism, i)
        try:
            assert plans[i].key_group_range == backend.key_group_range
            restore_keyed_state(backend, checkpoints.fs, directory, metadata, OPERATOR)
            for key, values in read_keyed(backend).items():
                assert key not in restored, f"{key} restored into two subtasks"
                assert subtask_of(key, new_parallelism) == i
                restored[key] = values
        finally:
            backend.dispose()
        ops = restore_operator_state(
            checkpoints.fs, directory, metadata, OPERATOR, i, new_parallelism
        )
        assert ops.is_restored
        splits.append(ops.get_list_state("offsets", IntSerializer()).get())
        unions.append(ops.get_union_list_state("watermarks", StrSerializer()).get())
        broadcasts.append(
            dict(ops.get_broadcast_state("rules", StrSerializer(), IntSerializer()).items())
        )

    expected_keyed = {
        key: values
        for key, values in built.keyed.items()
        if any(v is not None for v in values.values())
    }
    assert restored == expected_keyed

    all_split = [e for elements in built.split for e in elements]
    assert Counter(e for elements in splits for e in elements) == Counter(all_split)
    # One split state: its chunks start at new subtask 0, in old-subtask order.
    assert splits == expected_split(built.split, new_parallelism)
    all_union = sorted(e for union in built.union for e in union)
    for union in unions:
        assert sorted(union) == all_union
    assert broadcasts == [built.broadcast] * new_parallelism
    # Restored exactly what the plan said each subtask would read.
    for plan, split in zip(plans, splits, strict=True):
        slices = plan.operator_elements["offsets"]
        assert sum(end - begin for _, begin, end in slices) == len(split)
    checkpoints.close()


def test_key_groups_cover_every_key_once() -> None:
    """The model's own partitioning sanity: at every P the ranges tile 0..M-1."""
    for parallelism in PARALLELISMS:
        ranges = [
            compute_key_group_range_for_operator_index(MAX_PARALLELISM, parallelism, i)
            for i in range(parallelism)
        ]
        covered = [g for r in ranges for g in r]
        assert covered == list(range(MAX_PARALLELISM))
        assert all(isinstance(r, KeyGroupRange) for r in ranges)
