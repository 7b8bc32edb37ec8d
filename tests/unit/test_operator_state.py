"""The operator state backend: state kinds, cuts, restore with redistribution, protocols."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from statebackend.backends.operator import OperatorStateBackend, OperatorStateCut
from statebackend.backends.operator_redistribution import redistribute_cut
from statebackend.errors import (
    ConfigurationError,
    IncompatibleStateError,
    SerializationError,
    StateAccessError,
)
from statebackend.redistribution import DistributionMode
from statebackend.serializers import (
    FloatSerializer,
    IntSerializer,
    JsonSerializer,
    StrSerializer,
    TupleSerializer,
)
from statebackend.state.functions import (
    LIST_CHECKPOINTED_STATE_NAME,
    CheckpointedFunction,
    FunctionInitializationContext,
    FunctionSnapshotContext,
    ListCheckpointedAdapter,
    as_checkpointed_function,
)

OFFSET = TupleSerializer(StrSerializer(), IntSerializer())


def redistribute_cuts(old: Sequence[OperatorStateCut], new_p: int) -> list[OperatorStateCut]:
    """Every new subtask's cut, as a restore at ``new_p`` gives it."""
    return [redistribute_cut(old, subtask, new_p) for subtask in range(new_p)]


def test_list_state_api():
    state = OperatorStateBackend().get_list_state("offsets", OFFSET)
    assert state.get() == []
    state.add(("p0", 1))
    state.add_all([("p1", 2), ("p2", 3)])
    assert state.get() == [("p0", 1), ("p1", 2), ("p2", 3)]
    state.update([("p9", 9)])
    assert state.get() == [("p9", 9)]
    state.clear()
    assert state.get() == []


def test_union_list_state_api_and_same_object_on_second_request():
    backend = OperatorStateBackend()
    state = backend.get_union_list_state("seen", StrSerializer())
    state.add_all(["a", "b"])
    assert backend.get_union_list_state("seen", StrSerializer()) is state
    assert state.get() == ["a", "b"]
    assert state.mode is DistributionMode.UNION


def test_broadcast_state_api():
    rules = OperatorStateBackend().get_broadcast_state("rules", StrSerializer(), JsonSerializer())
    assert rules.is_empty()
    rules.put("limit", {"max": 3})
    rules.put_all({"mode": "strict", "limit": {"max": 5}})
    assert rules.get("limit") == {"max": 5}
    assert rules.get("absent") is None
    assert rules.get("absent", "fallback") == "fallback"
    assert rules.contains("mode") and not rules.contains("absent")
    assert list(rules.keys()) == ["limit", "mode"]
    assert list(rules.values()) == [{"max": 5}, "strict"]
    assert dict(rules.items()) == {"limit": {"max": 5}, "mode": "strict"}
    rules.remove("limit")
    rules.remove("absent")
    assert dict(rules.items()) == {"mode": "strict"}
    rules.clear()
    assert rules.is_empty()


def test_raw_state_is_carried_as_opaque_partitions():
    backend = OperatorStateBackend()
    assert backend.get_raw_state() == []
    backend.set_raw_state([b"\x00one", bytearray(b"two")])
    assert backend.get_raw_state() == [b"\x00one", b"two"]
    with pytest.raises(SerializationError):
        backend.set_raw_state(b"not a list of partitions")
    with pytest.raises(SerializationError):
        backend.set_raw_state(["text"])
    assert OperatorStateBackend(backend.sync_cut()).get_raw_state() == [b"\x00one", b"two"]


def test_a_name_under_two_modes_is_a_state_access_error():
    backend = OperatorStateBackend()
    backend.get_list_state("s", IntSerializer())
    with pytest.raises(StateAccessError, match="'s'"):
        backend.get_union_list_state("s", IntSerializer())
    with pytest.raises(StateAccessError, match="'s'"):
        backend.get_broadcast_state("s", IntSerializer(), IntSerializer())


@pytest.mark.parametrize("name", ["default", ""])
def test_reserved_and_empty_names_are_rejected(name):
    backend = OperatorStateBackend()
    with pytest.raises(ConfigurationError):
        backend.get_list_state(name, IntSerializer())
    with pytest.raises(ConfigurationError):
        backend.get_broadcast_state(name, IntSerializer(), IntSerializer())


def test_an_unencodable_value_leaves_the_state_unchanged():
    backend = OperatorStateBackend()
    numbers = backend.get_list_state("numbers", IntSerializer())
    numbers.add_all([1, 2])
    for change in (
        lambda: numbers.add("three"),
        lambda: numbers.add_all([3, "four"]),
        lambda: numbers.update([5, None]),
    ):
        with pytest.raises(SerializationError):
            change()
        assert numbers.get() == [1, 2]
    table = backend.get_broadcast_state("table", StrSerializer(), IntSerializer())
    table.put("a", 1)
    for change in (
        lambda: table.put("b", "not an int"),
        lambda: table.put(2, 2),
        lambda: table.put_all({"c": 3, "d": 1.5}),
    ):
        with pytest.raises(SerializationError):
            change()
        assert dict(table.items()) == {"a": 1}


def test_sync_cut_is_unaffected_by_later_changes():
    backend = OperatorStateBackend()
    numbers = backend.get_list_state("numbers", IntSerializer())
    table = backend.get_broadcast_state("table", StrSerializer(), IntSerializer())
    numbers.add_all([1, 2])
    table.put("a", 1)
    backend.set_raw_state([b"raw"])
    cut = backend.sync_cut()

    numbers.add(3)
    table.put("b", 2)
    table.remove("a")
    backend.set_raw_state([])

    assert cut.states["numbers"].entries == (
        IntSerializer().serialize(1),
        IntSerializer().serialize(2),
    )
    assert cut.states["numbers"].serializers == {"value": IntSerializer().config()}
    assert cut.states["table"].entries == ((b"a", IntSerializer().serialize(1)),)
    assert cut.raw == (b"raw",)
    with pytest.raises(TypeError):
        cut.states["other"] = cut.states["numbers"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cut.raw = ()


def _subtask(offsets, seen, rules, raw):
    backend = OperatorStateBackend()
    backend.get_list_state("offsets", OFFSET).add_all(offsets)
    backend.get_union_list_state("seen", StrSerializer()).add_all(seen)
    backend.get_broadcast_state("rules", StrSerializer(), IntSerializer()).put_all(rules)
    backend.set_raw_state(raw)
    return backend.sync_cut()


def test_restore_round_trip_through_redistribution():
    rules = {"limit": 3}
    old = [
        _subtask([("p0", 10), ("p1", 11)], ["x"], rules, [b"r0"]),
        _subtask([("p2", 12), ("p3", 13)], ["y", "z"], rules, [b"r1"]),
    ]
    for new_p in (1, 2, 3, 4):
        restored = [OperatorStateBackend(cut) for cut in redistribute_cuts(old, new_p)]
        assert all(backend.is_restored for backend in restored)
        offsets = [b.get_list_state("offsets", OFFSET).get() for b in restored]
        assert sorted(o for share in offsets for o in share) == [
            ("p0", 10),
            ("p1", 11),
            ("p2", 12),
            ("p3", 13),
        ]
        assert max(map(len, offsets)) - min(map(len, offsets)) <= 1
        for b in restored:
            assert b.get_union_list_state("seen", StrSerializer()).get() == ["x", "y", "z"]
            table = b.get_broadcast_state("rules", StrSerializer(), IntSerializer())
            assert dict(table.items()) == rules
        assert sorted(p for b in restored for p in b.get_raw_state()) == [b"r0", b"r1"]
        if new_p == 2:
            assert offsets == [[("p0", 10), ("p1", 11)], [("p2", 12), ("p3", 13)]]


def test_restored_states_never_asked_for_are_carried_into_the_next_cut():
    old = _subtask([("p0", 1)], ["x"], {"k": 1}, [b"raw"])
    backend = OperatorStateBackend(old)
    backend.get_union_list_state("seen", StrSerializer()).add("y")
    cut = backend.sync_cut()
    assert cut.states["offsets"] == old.states["offsets"]
    assert cut.states["rules"] == old.states["rules"]
    assert cut.raw == (b"raw",)
    assert [StrSerializer().deserialize(e) for e in cut.states["seen"].entries] == ["x", "y"]


def test_a_fresh_backend_is_not_restored_and_an_empty_restored_share_is():
    assert not OperatorStateBackend().is_restored
    assert OperatorStateBackend(OperatorStateCut()).is_restored


def test_restore_migrates_int_to_float():
    old = OperatorStateBackend()
    old.get_list_state("sums", IntSerializer()).add_all([1, -2])
    old.get_broadcast_state("weights", StrSerializer(), IntSerializer()).put("w", 7)

    backend = OperatorStateBackend(old.sync_cut())
    sums = backend.get_list_state("sums", FloatSerializer())
    assert sums.get() == [1.0, -2.0]
    assert all(isinstance(v, float) for v in sums.get())
    weights = backend.get_broadcast_state("weights", StrSerializer(), FloatSerializer())
    assert dict(weights.items()) == {"w": 7.0}
    cut = backend.sync_cut()
    assert cut.states["sums"].serializers == {"value": FloatSerializer().config()}
    assert cut.states["weights"].serializers["value"] == FloatSerializer().config()


def test_re_requesting_with_a_compatible_serializer_migrates_in_place():
    backend = OperatorStateBackend()
    state = backend.get_list_state("sums", IntSerializer())
    state.add(4)
    assert backend.get_list_state("sums", FloatSerializer()) is state
    assert state.get() == [4.0]


def test_restore_with_an_incompatible_serializer_names_the_state():
    old = OperatorStateBackend()
    old.get_list_state("names", StrSerializer()).add("alice")
    backend = OperatorStateBackend(old.sync_cut())
    with pytest.raises(IncompatibleStateError, match="'names'"):
        backend.get_list_state("names", IntSerializer())
    # the failed request changed nothing: the state is still there for a compatible one
    assert backend.get_list_state("names", StrSerializer()).get() == ["alice"]


def test_restore_as_another_mode_is_incompatible():
    old = OperatorStateBackend()
    old.get_list_state("offsets", IntSerializer()).add(1)
    backend = OperatorStateBackend(old.sync_cut())
    with pytest.raises(IncompatibleStateError, match="'offsets'"):
        backend.get_union_list_state("offsets", IntSerializer())


def test_redistributing_cuts_with_different_serializers_is_incompatible():
    a, b = OperatorStateBackend(), OperatorStateBackend()
    a.get_list_state("values", IntSerializer()).add(1)
    b.get_list_state("values", StrSerializer()).add("1")
    with pytest.raises(IncompatibleStateError, match="'values'"):
        redistribute_cuts([a.sync_cut(), b.sync_cut()], 1)


class OffsetSource:
    """A ListCheckpointed source: one (partition, offset) entry per partition it reads."""

    def __init__(self, offsets=None):
        self.offsets = dict(offsets or {})

    def snapshot_state(self, checkpoint_id: int) -> list:
        return sorted(self.offsets.items())

    def restore_state(self, state: list) -> None:
        self.offsets = dict(state)


def _snapshot(function, checkpoint_id):
    backend = OperatorStateBackend()
    checkpointed = as_checkpointed_function(function)
    assert checkpointed is not None
    checkpointed.initialize_state(FunctionInitializationContext(backend))
    checkpointed.snapshot_state(FunctionSnapshotContext(checkpoint_id, backend))
    return backend.sync_cut()


def test_list_checkpointed_adapter_round_trip_with_rescale():
    cuts = [
        _snapshot(OffsetSource({"KP1": 5, "KP2": 6}), 7),
        _snapshot(OffsetSource({"KP3": 7, "KP4": 8}), 7),
    ]
    assert LIST_CHECKPOINTED_STATE_NAME in cuts[0].states

    (merged_cut,) = redistribute_cuts(cuts, 1)
    merged = OffsetSource()
    ListCheckpointedAdapter(merged).initialize_state(
        FunctionInitializationContext(OperatorStateBackend(merged_cut))
    )
    assert merged.offsets == {"KP1": 5, "KP2": 6, "KP3": 7, "KP4": 8}

    spread = [OffsetSource() for _ in range(4)]
    for source, cut in zip(spread, redistribute_cuts(cuts, 4), strict=True):
        ListCheckpointedAdapter(source).initialize_state(
            FunctionInitializationContext(OperatorStateBackend(cut))
        )
    assert [s.offsets for s in spread] == [{"KP1": 5}, {"KP2": 6}, {"KP3": 7}, {"KP4": 8}]


def test_list_checkpointed_is_not_restored_on_a_fresh_start():
    source = OffsetSource({"KP1": 1})
    ListCheckpointedAdapter(source).initialize_state(
        FunctionInitializationContext(OperatorStateBackend())
    )
    assert source.offsets == {"KP1": 1}


class CountingFunction:
    """A CheckpointedFunction keeping a count in union list state."""

    def __init__(self):
        self.count = 0
        self.restored = None

    def initialize_state(self, ctx: FunctionInitializationContext) -> None:
        self.state = ctx.operator_state_store.get_union_list_state("count", IntSerializer())
        self.restored = ctx.is_restored
        if ctx.is_restored:
            self.count = sum(self.state.get())

    def snapshot_state(self, ctx: FunctionSnapshotContext) -> None:
        self.state.update([self.count])


def test_checkpointed_function_round_trip():
    first = CountingFunction()
    assert as_checkpointed_function(first) is first
    assert isinstance(first, CheckpointedFunction)
    first.count = 5
    cut = _snapshot(first, 1)
    assert first.restored is False

    second = CountingFunction()
    second.initialize_state(FunctionInitializationContext(OperatorStateBackend(cut)))
    assert second.restored is True
    assert second.count == 5


def test_functions_without_state_are_not_checkpointed():
    assert as_checkpointed_function(object()) is None
    assert isinstance(as_checkpointed_function(OffsetSource()), ListCheckpointedAdapter)
