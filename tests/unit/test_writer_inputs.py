"""New operator state of a written savepoint: each subtask's share, by mode."""

from __future__ import annotations

import pytest

from statebackend.checkpoint.writer import OperatorStateInput
from statebackend.errors import ConfigurationError
from statebackend.redistribution import DistributionMode
from statebackend.serializers import IntSerializer, StrSerializer


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
