"""``statebackend plan``: who would get what on a restore at another parallelism.

Nothing is restored: the assignment comes from ``checkpoint.restore.plan_restore``;
only the values of small operator states are read to show them.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from statebackend.checkpoint.restore import SubtaskPlan, plan_restore
from statebackend.checkpoint.writer import Written
from statebackend.snapshot.operator_format import OperatorStateReader
from statebackend.tools.location import CheckpointRef
from statebackend.tools.reader import decode_operator_state, operator_of
from statebackend.tools.report import key_group_bytes, split_key_groups

MAX_SHOWN_VALUES = 64
"""Operator states with at most this many elements in the checkpoint have their values
shown."""


def plan_operator(
    ref: CheckpointRef, operator_id: str, parallelism: int, planned: Written | None = None
) -> list[dict[str, Any]]:
    """Per new subtask of ``operator_id`` at ``parallelism``: its key-group range, the
    bytes it reads from which old subtasks, and its operator-state elements as slices
    ``[old subtask, first, end)`` (with their values where the state is small: records as
    ``statebackend.tools.reader.decode_operator_state`` gives them, read from the old
    subtasks' files: only those states, each stored range once, however many new subtasks
    get it). ``planned`` hears (operator, subtask) as each new subtask's plan is done."""
    snapshot = operator_of(ref, operator_id)
    totals: dict[str, int] = {}
    for handle in snapshot.operator_handles():
        for name, info in (handle.states if handle else {}).items():
            totals[name] = totals.get(name, 0) + len(info.elements)
    small = {name for name, total in totals.items() if total <= MAX_SHOWN_VALUES}
    # A union state's ranges are the same for every new subtask: each is read once.
    reader = OperatorStateReader(
        snapshot.operator_handles(), ref.directory, cache(ref.fs.read_range)
    )
    plans = []
    for plan in plan_restore(ref.metadata, operator_id, parallelism):
        restored = (
            dict(reader.restore_cut(plan.subtask, parallelism, small).states) if small else {}
        )
        operator_state = {}
        for name, slices in sorted(plan.operator_elements.items()):
            share: dict[str, Any] = {
                "elements": sum(end - begin for _, begin, end in slices),
                "slices": [list(s) for s in slices],
            }
            if name in small:
                share["values"] = decode_operator_state(restored[name])
            operator_state[name] = share
        plans.append(
            {
                "subtask": plan.subtask,
                "key_group_range": plan.key_group_range.to_json(),
                "keyed_bytes": plan.keyed_bytes,
                "keyed_sources": keyed_sources_json(plan),
                "operator_state": operator_state,
            }
        )
        if planned is not None:
            planned(operator_id, plan.subtask)
    return plans


def keyed_sources_json(plan: SubtaskPlan) -> list[dict[str, Any]]:
    """The old subtasks a new subtask's restore reads keyed state from, as JSON: the old
    subtask, the key groups it reads there and their bytes."""
    return [
        {"old_subtask": s.old_subtask, "key_groups": s.key_groups.to_json(), "bytes": size}
        for s, size in zip(plan.keyed_sources, plan.keyed_source_bytes, strict=True)
    ]


def plan_imbalance(ref: CheckpointRef, operator_id: str, parallelism: int) -> float | None:
    """max/mean of the keyed bytes the new subtasks of ``operator_id`` would hold at
    ``parallelism`` (as ``statebackend report`` computes it); None without keyed state."""
    groups = key_group_bytes(operator_of(ref, operator_id), ref.metadata.max_parallelism)
    return None if groups is None else split_key_groups(groups.bytes, parallelism).imbalance


def plan_checkpoint(
    ref: CheckpointRef,
    parallelism: int,
    operator_id: str | None = None,
    planned: Written | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """``plan_operator`` for one operator, or for every operator of the checkpoint."""
    return {
        op: plan_operator(ref, op, parallelism, planned) for op in plan_operators(ref, operator_id)
    }


def plan_operators(ref: CheckpointRef, operator_id: str | None = None) -> list[str]:
    """The operators ``plan_checkpoint`` plans: ``operator_id``, or all of the checkpoint."""
    return sorted(ref.metadata.operators) if operator_id is None else [operator_id]
