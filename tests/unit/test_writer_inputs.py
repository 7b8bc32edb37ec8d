"""The savepoint writer without Spark: new operator state shared out by mode, and new
keyed state of every kind written at P and restored at P'."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.checkpoint.writer import (
    OperatorRewrite,
    OperatorStateInput,
    Row,
    SavepointWriter,
)
from statebackend.errors import ConfigurationError
from statebackend.keygroups import compute_key_group_range_for_operator_index
from statebackend.redistribution import DistributionMode
from statebackend.serializers import IntSerializer, StrSerializer, TupleSerializer
from statebackend.state.descriptors import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    ValueStateDescriptor,
)
from statebackend.state.ttl import StateTtlConfig


@pytest.mark.parametrize("mode", [DistributionMode.SPLIT, DistributionMode.UNION])
@pytest.mark.parametrize("parallelism", [1, 3, 4, 11])
def test_list_elements_are_cut_into_consecutive_chunks(
    mode: DistributionMode, parallelism: int
) -> None:
    elements = list(range(10))
    state = OperatorStateInput("s", elements, mode, IntSerializer())
    shares = [
        [IntSerializer().deserialize(e) for e in state.cut_for(i, parallelism).entries]
        for i in range(parallelism)
    ]
    # Flink's split: chunks of 10 // P, the first 10 % P one longer, in order.
    base, extra = divmod(len(elements), parallelism)
    sizes = [base + (1 if i < extra else 0) for i in range(parallelism)]
    assert [len(share) for share in shares] == sizes
    assert [e for share in shares for e in share] == elements
    assert all(state.cut_for(i, parallelism).mode is mode for i in range(parallelism))


def test_broadcast_state_is_copied_to_every_subtask() -> None:
    rules = {"a": 1, "b": 2}
    state = OperatorStateInput(
        "rules", rules, DistributionMode.BROADCAST, IntSerializer(), StrSerializer()
    )
    for i in range(3):
        entries = state.cut_for(i, 3).entries
        decoded = {
            StrSerializer().deserialize(k): IntSerializer().deserialize(v) for k, v in entries
        }
        assert decoded == rules


def test_broadcast_state_needs_a_mapping() -> None:
    state = OperatorStateInput("rules", [1, 2], DistributionMode.BROADCAST)
    with pytest.raises(ConfigurationError, match="needs a mapping"):
        state.cut_for(0, 1)


class Average(AggregateFunction[int, tuple[int, int], float]):
    """Average of the added integers; the accumulator is (sum, count)."""

    def create_accumulator(self) -> tuple[int, int]:
        return (0, 0)

    def add(self, value: int, accumulator: tuple[int, int]) -> tuple[int, int]:
        return (accumulator[0] + value, accumulator[1] + 1)

    def get_result(self, accumulator: tuple[int, int]) -> float:
        return accumulator[0] / accumulator[1]

    def merge(self, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        return (a[0] + b[0], a[1] + b[1])


def test_every_keyed_kind_is_written_and_restores_at_another_parallelism(
    tmp_path: Path,
) -> None:
    """Rows of the five kinds (one with a TTL) written at P=2 restore at P=3 through the
    state interfaces, with the descriptors' serializers recorded."""
    descriptors: list[StateDescriptor] = [
        ValueStateDescriptor("count", IntSerializer(), ttl=StateTtlConfig(3600)),
        ListStateDescriptor("events", IntSerializer()),
        MapStateDescriptor("attrs", StrSerializer(), IntSerializer()),
        ReducingStateDescriptor("total", operator.add, IntSerializer()),
        AggregatingStateDescriptor(
            "average", Average(), TupleSerializer(IntSerializer(), IntSerializer())
        ),
    ]
    keys = [f"k{n}" for n in range(50)]
    values: list[dict[str, Any]] = [
        {k: n for n, k in enumerate(keys)},
        {k: [n, n + 1] for n, k in enumerate(keys)},
        {k: {"a": n} for n, k in enumerate(keys)},
        {k: n * 10 for n, k in enumerate(keys)},
        {k: (n, 2) for n, k in enumerate(keys)},
    ]
    rewrite = OperatorRewrite("op", 2, keyed_states=tuple(descriptors), from_source=False)
    writer = SavepointWriter(tmp_path.as_uri() + "/sp", 16)
    rows: list[list[Row]] = [[], []]
    for index, by_key in enumerate(values):
        for key, value in by_key.items():
            rows[rewrite.subtask_of(key, 16, descriptors[index].name)].append((index, key, value))
    acks = [writer.write_subtask(rewrite, i, rows[i]) for i in range(2)]
    directory = writer.complete(acks, job_id="j")

    storage = CheckpointStorage(directory, "x")
    metadata = storage.load(directory)
    handle = metadata.operators["op"].subtasks[0].keyed
    assert handle is not None
    stored = {meta.name: meta.serializers for meta in handle.states}
    assert stored["count"]["value"]["identity"] == "ttl"
    found: list[dict[str, Any]] = [{} for _ in descriptors]
    for i in range(3):
        backend = HeapKeyedStateBackend(
            max_parallelism=16, key_group_range=compute_key_group_range_for_operator_index(16, 3, i)
        )
        restore_keyed_state(backend, storage.fs, directory, metadata, "op")
        states: list[Any] = [backend.get_state(d) for d in descriptors]
        for key in backend.keys("count"):
            backend.set_current_key(key)
            found[0][key] = states[0].value()
            found[1][key] = states[1].get()
            found[2][key] = dict(states[2].items())
            found[3][key] = states[3].get()
            found[4][key] = states[4].get()
    assert found[:4] == values[:4]
    assert found[4] == {key: n / 2 for key, (n, _) in values[4].items()}
