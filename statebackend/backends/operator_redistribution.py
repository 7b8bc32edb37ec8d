"""The one way operator state is divided among new subtasks on restore.

``redistribute_cut`` gives new subtask ``i`` of ``P`` its share of the old subtasks'
operator state, following ``redistribution.plan_operator_state`` (split, union and
broadcast as Flink's ``RoundRobinOperatorStateRepartitioner``; raw partitions as split
state). It reads the old state through ``OperatorStateSource``, so the same function
serves in-memory cuts (``OperatorStateCut``) and checkpointed handles, which read only
the slices the new subtask gets (``snapshot.operator_format``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from statebackend.backends.operator import Entry, NamedStateCut, OperatorStateCut
from statebackend.errors import IncompatibleStateError
from statebackend.redistribution import DistributionMode, StateLayout, plan_operator_state
from statebackend.serializers import SerializerConfig

_RAW = "raw"


class OperatorStateSource(Protocol):
    """One old subtask's operator state, as a redistribution reads it."""

    def state_layouts(self) -> Mapping[str, StateLayout]:
        """Mode and element count of every named state."""

    def state_serializers(self) -> Mapping[str, Mapping[str, SerializerConfig]]:
        """The serializer configs (by role) every named state was written with."""

    def raw_count(self) -> int:
        """How many raw partitions it holds."""

    def read_elements(self, name: str, begin: int, end: int) -> Sequence[Entry]:
        """Elements ``begin`` to ``end`` (exclusive) of state ``name``."""

    def read_raw(self, begin: int, end: int) -> Sequence[bytes]:
        """Raw partitions ``begin`` to ``end`` (exclusive)."""


def _serializers(old: Sequence[OperatorStateSource]) -> dict[str, Mapping[str, SerializerConfig]]:
    """The serializers of every state name; IncompatibleStateError if old subtasks differ."""
    known: dict[str, Mapping[str, SerializerConfig]] = {}
    for subtask, source in enumerate(old):
        for name, serializers in source.state_serializers().items():
            first = known.setdefault(name, serializers)
            if dict(first) != dict(serializers):
                raise IncompatibleStateError(
                    f"operator state {name!r} was written with serializers {dict(first)} and "
                    f"{dict(serializers)} (old subtask {subtask}): its elements cannot be "
                    f"merged; restore from a checkpoint written by one version of the job"
                )
    return known


def redistribute_cut(
    old: Sequence[OperatorStateSource], subtask: int, new_parallelism: int
) -> OperatorStateCut:
    """The operator state new subtask ``subtask`` of ``new_parallelism`` restores from the
    old subtasks' ``old`` (in old-subtask order).

    Raises IncompatibleStateError when a state name has different modes or serializers
    in different old subtasks, ConfigurationError for an invalid parallelism.
    """
    serializers = _serializers(old)
    plan = plan_operator_state([s.state_layouts() for s in old], new_parallelism)[subtask]
    states = {
        name: NamedStateCut(
            share.mode,
            serializers[name],
            tuple(
                element
                for piece in share.slices
                for element in old[piece.old_subtask].read_elements(name, piece.begin, piece.end)
            ),
        )
        for name, share in plan.items()
    }
    raw_layouts = [{_RAW: StateLayout(DistributionMode.SPLIT, s.raw_count())} for s in old]
    raw_plan = plan_operator_state(raw_layouts, new_parallelism)[subtask][_RAW]
    raw = tuple(
        partition
        for piece in raw_plan.slices
        for partition in old[piece.old_subtask].read_raw(piece.begin, piece.end)
    )
    return OperatorStateCut(states, raw)
