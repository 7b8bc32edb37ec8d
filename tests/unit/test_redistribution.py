"""Redistribution of operator state and key-group ranges, checked against plain Python."""

from __future__ import annotations

from ast import literal_eval
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statebackend.backends.operator import NamedStateCut, OperatorStateCut
from statebackend.backends.operator_redistribution import redistribute_cut
from statebackend.errors import ConfigurationError, IncompatibleStateError
from statebackend.keygroups import KeyGroupRange, compute_key_group_range_for_operator_index
from statebackend.redistribution import (
    DistributionMode,
    StateSlice,
    assign_key_group_ranges,
    plan_split,
)

SPLIT, UNION, BROADCAST = DistributionMode.SPLIT, DistributionMode.UNION, DistributionMode.BROADCAST
SERIALIZERS = {"value": {"name": "repr"}}


class OperatorStateList(NamedTuple):
    """One named state of one subtask with readable elements (broadcast: (key, value))."""

    mode: DistributionMode
    elements: list


def _encode(mode: DistributionMode, element):
    if mode is BROADCAST:
        return repr(element[0]).encode(), repr(element[1]).encode()
    return repr(element).encode()


def _decode(mode: DistributionMode, entry):
    if mode is BROADCAST:
        return literal_eval(entry[0].decode()), literal_eval(entry[1].decode())
    return literal_eval(entry.decode())


def _cuts(old: list[dict[str, OperatorStateList]]) -> list[OperatorStateCut]:
    return [
        OperatorStateCut(
            {
                name: NamedStateCut(
                    state.mode, SERIALIZERS, tuple(_encode(state.mode, e) for e in state.elements)
                )
                for name, state in states.items()
            }
        )
        for states in old
    ]


def redistribute_operator_state(old: list[dict[str, OperatorStateList]], new_p: int):
    """``redistribute_cut`` of every new subtask, over cuts holding ``old``'s elements."""
    cuts = _cuts(old)
    return [
        {
            name: OperatorStateList(
                state.mode, [_decode(state.mode, entry) for entry in state.entries]
            )
            for name, state in redistribute_cut(cuts, subtask, new_p).states.items()
        }
        for subtask in range(new_p)
    ]


def _old_states(lengths_by_name: dict[str, list[int]], mode: DistributionMode):
    """Per old subtask, name -> list of distinguishable elements (name, old subtask, index)."""
    parallelism = len(next(iter(lengths_by_name.values())))
    return [
        {
            name: OperatorStateList(mode, [(name, subtask, i) for i in range(lengths[subtask])])
            for name, lengths in lengths_by_name.items()
        }
        for subtask in range(parallelism)
    ]


def _reference_split(lengths_by_name: dict[str, list[int]], new_p: int):
    """Flink's round robin, element by element: per new subtask, name -> elements."""
    result: list[dict[str, list]] = [{} for _ in range(new_p)]
    start = 0
    for name in sorted(lengths_by_name):
        lengths = lengths_by_name[name]
        everything = [(name, s, i) for s, n in enumerate(lengths) for i in range(n)]
        base, extra = divmod(len(everything), new_p)
        position = 0
        for chunk in range(new_p):
            size = base + 1 if chunk < extra else base
            result[(start + chunk) % new_p][name] = everything[position : position + size]
            position += size
        start = (start + extra) % new_p
    return result


lengths_strategy = st.integers(min_value=1, max_value=10).flatmap(
    lambda p: st.dictionaries(
        st.sampled_from(["a", "b", "c", "offsets"]),
        st.lists(st.integers(min_value=0, max_value=15), min_size=p, max_size=p),
        min_size=1,
        max_size=4,
    )
)


@settings(max_examples=300, deadline=None)
@given(lengths_by_name=lengths_strategy, new_p=st.integers(min_value=1, max_value=10))
def test_split_loses_nothing_duplicates_nothing_and_keeps_order(lengths_by_name, new_p):
    old = _old_states(lengths_by_name, SPLIT)
    new = redistribute_operator_state(old, new_p)

    assert len(new) == new_p
    for name, lengths in lengths_by_name.items():
        everything = [(name, s, i) for s, n in enumerate(lengths) for i in range(n)]
        shares = [subtask[name].elements for subtask in new]
        assert all(subtask[name].mode is SPLIT for subtask in new)
        assert sorted(e for share in shares for e in share) == everything
        for share in shares:
            assert share == sorted(share)  # old-subtask order, then each old list's order
        if new_p != len(lengths):
            sizes = [len(share) for share in shares]
            assert max(sizes) - min(sizes) <= 1
    if new_p != len(next(iter(lengths_by_name.values()))):
        expected = _reference_split(lengths_by_name, new_p)
        assert [{n: s.elements for n, s in subtask.items()} for subtask in new] == expected


@settings(max_examples=100, deadline=None)
@given(lengths_by_name=lengths_strategy)
def test_same_parallelism_keeps_every_list_in_place(lengths_by_name):
    old = _old_states(lengths_by_name, SPLIT)
    new = redistribute_operator_state(old, len(old))
    assert [{n: list(s.elements) for n, s in subtask.items()} for subtask in new] == [
        {n: list(s.elements) for n, s in sorted(subtask.items())} for subtask in old
    ]


@settings(max_examples=100, deadline=None)
@given(lengths_by_name=lengths_strategy, new_p=st.integers(min_value=1, max_value=10))
def test_union_gives_every_subtask_everything_in_order(lengths_by_name, new_p):
    new = redistribute_operator_state(_old_states(lengths_by_name, UNION), new_p)
    for name, lengths in lengths_by_name.items():
        everything = [(name, s, i) for s, n in enumerate(lengths) for i in range(n)]
        assert all(subtask[name] == OperatorStateList(UNION, everything) for subtask in new)


@pytest.mark.parametrize(("old_p", "new_p"), [(1, 4), (3, 2), (2, 2), (4, 7)])
def test_broadcast_gives_every_subtask_a_copy(old_p, new_p):
    entries = [("rule", 1), ("limit", 2)]
    old = [{"rules": OperatorStateList(BROADCAST, list(entries))} for _ in range(old_p)]
    new = redistribute_operator_state(old, new_p)
    assert [subtask["rules"] for subtask in new] == [OperatorStateList(BROADCAST, entries)] * new_p


def test_broadcast_takes_the_copies_round_robin_and_in_place_at_same_parallelism():
    old = [{"m": OperatorStateList(BROADCAST, [("copy", s)])} for s in range(3)]
    assert [s["m"].elements for s in redistribute_operator_state(old, 3)] == [
        [("copy", 0)],
        [("copy", 1)],
        [("copy", 2)],
    ]
    assert [s["m"].elements[0][1] for s in redistribute_operator_state(old, 5)] == [0, 1, 2, 0, 1]


def test_kafka_offsets_four_partitions_on_two_subtasks():
    old = [
        {"offsets": OperatorStateList(SPLIT, [("KP1", 10), ("KP2", 20)])},
        {"offsets": OperatorStateList(SPLIT, [("KP3", 30), ("KP4", 40)])},
    ]
    (merged,) = redistribute_operator_state(old, 1)
    assert merged["offsets"].elements == [("KP1", 10), ("KP2", 20), ("KP3", 30), ("KP4", 40)]
    spread = redistribute_operator_state(old, 4)
    assert [s["offsets"].elements for s in spread] == [
        [("KP1", 10)],
        [("KP2", 20)],
        [("KP3", 30)],
        [("KP4", 40)],
    ]


def test_split_rotates_the_longer_chunks_across_state_names():
    old = [{name: OperatorStateList(SPLIT, [name]) for name in ("c", "a", "b")}]
    new = redistribute_operator_state(old, 2)
    # sorted names: "a" goes to subtask 0, then the start moves on: "b" to 1, "c" to 0
    assert [sorted(n for n, s in subtask.items() if s.elements) for subtask in new] == [
        ["a", "c"],
        ["b"],
    ]
    assert all(list(subtask) == ["a", "b", "c"] for subtask in new)


def test_plan_split_slices_the_concatenation():
    assert plan_split([3, 0, 2], 2) == [
        [StateSlice(0, 0, 3)],
        [StateSlice(2, 0, 2)],
    ]
    assert plan_split([3, 0, 2], 3, start_offset=1) == [
        [StateSlice(2, 1, 2)],
        [StateSlice(0, 0, 2)],
        [StateSlice(0, 2, 3), StateSlice(2, 0, 1)],
    ]
    assert plan_split([], 2) == [[], []]


def test_a_name_with_two_modes_is_incompatible():
    old = [
        {"offsets": OperatorStateList(SPLIT, [1])},
        {"offsets": OperatorStateList(UNION, [2])},
    ]
    with pytest.raises(IncompatibleStateError, match="'offsets'"):
        redistribute_operator_state(old, 2)


@pytest.mark.parametrize("new_p", [0, -1, 1.5])
def test_new_parallelism_must_be_positive(new_p):
    cuts = _cuts([{"a": OperatorStateList(SPLIT, [1])}])
    with pytest.raises(ConfigurationError):
        redistribute_cut(cuts, 0, new_p)
    with pytest.raises(ConfigurationError):
        plan_split([1], new_p)


def test_negative_lengths_are_rejected():
    with pytest.raises(ConfigurationError):
        plan_split([2, -1], 2)


def _parallelism_pairs():
    for m in (1, 7, 128, 1000):
        for old_p in range(1, min(m, 12) + 1):
            for new_p in range(1, min(m, 12) + 1):
                yield m, old_p, new_p


@pytest.mark.parametrize(("m", "old_p", "new_p"), list(_parallelism_pairs()))
def test_key_group_assignment_matches_brute_force(m, old_p, new_p):
    old_ranges = [compute_key_group_range_for_operator_index(m, old_p, i) for i in range(old_p)]
    assignments = assign_key_group_ranges(m, old_ranges, new_p)

    assert [a.subtask for a in assignments] == list(range(new_p))
    for a in assignments:
        owned = [g for g in range(m) if g * new_p // m == a.subtask]
        assert list(a.key_group_range) == owned
        holders = sorted({g * old_p // m for g in owned})
        assert [s.old_subtask for s in a.old_subtasks] == holders
        for source in a.old_subtasks:
            assert list(source.key_groups) == [
                g for g in owned if g * old_p // m == source.old_subtask
            ]


def test_key_group_assignment_rejects_bad_input():
    ranges = [KeyGroupRange(0, 63), KeyGroupRange(64, 127)]
    with pytest.raises(ConfigurationError):
        assign_key_group_ranges(128, ranges, 0)
    with pytest.raises(ConfigurationError):
        assign_key_group_ranges(128, ranges, 129)
    with pytest.raises(IncompatibleStateError, match="max parallelism 64"):
        assign_key_group_ranges(64, ranges, 2)
