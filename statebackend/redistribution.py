"""Who gets which state on restore: pure functions over operator-state lists and key groups.

Operator state follows Flink's ``RoundRobinOperatorStateRepartitioner``:

- **split**: the old subtasks' lists, concatenated in old-subtask order, are cut into
  ``P`` consecutive chunks of ``total // P`` elements, the first ``total % P`` chunks one
  longer. Chunk ``k`` goes to new subtask ``(start + k) % P``; ``start`` begins at 0 and,
  from one state name to the next (names in sorted order), moves on by ``total % P``, so
  the longer chunks do not always land on the same subtasks.
- **union**: every new subtask gets the concatenation of all old lists.
- **broadcast**: every old subtask holds a copy; new subtask ``i`` gets the copy of the
  ``i % n``-th of the ``n`` old subtasks that hold the state (Flink's choice).

When the parallelism is unchanged, split and broadcast state stay where they were.

The planning functions work on lengths and return slices, so that a restore can read only
the elements it needs; ``backends.operator_redistribution`` applies a plan to operator state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from statebackend.errors import ConfigurationError, IncompatibleStateError
from statebackend.keygroups import (
    KeyGroupRange,
    check_parallelism,
    compute_key_group_range_for_operator_index,
)


class DistributionMode(Enum):
    """How one named operator state is redistributed on restore."""

    SPLIT = "split"
    UNION = "union"
    BROADCAST = "broadcast"


class StateSlice(NamedTuple):
    """Elements ``begin`` (inclusive) to ``end`` (exclusive) of one old subtask's list."""

    old_subtask: int
    begin: int
    end: int


class StateLayout(NamedTuple):
    """What a plan needs to know of one old subtask's named state: its mode and length."""

    mode: DistributionMode
    length: int


class StatePlan(NamedTuple):
    """A new subtask's share of one named state: the old slices to read, in order."""

    mode: DistributionMode
    slices: tuple[StateSlice, ...]


def _check_new_parallelism(new_parallelism: int) -> None:
    if not isinstance(new_parallelism, int) or new_parallelism < 1:
        raise ConfigurationError(
            f"new parallelism {new_parallelism!r} is invalid: it must be an integer >= 1"
        )


def plan_split(
    lengths_per_old_subtask: Sequence[int], new_parallelism: int, start_offset: int = 0
) -> list[list[StateSlice]]:
    """Cut the concatenation of lists of the given lengths into ``new_parallelism`` chunks.

    Chunk ``k`` (``total // P`` elements, plus one for the first ``total % P`` chunks) goes
    to new subtask ``(start_offset + k) % P``. Returns, per new subtask, the non-empty
    slices it gets, in old-subtask order; together they cover every element exactly once.
    """
    _check_new_parallelism(new_parallelism)
    if any(not isinstance(n, int) or n < 0 for n in lengths_per_old_subtask):
        raise ConfigurationError(
            f"list lengths {list(lengths_per_old_subtask)!r} are invalid: "
            f"they must be integers >= 0"
        )
    base, extra = divmod(sum(lengths_per_old_subtask), new_parallelism)
    plan: list[list[StateSlice]] = [[] for _ in range(new_parallelism)]
    old, position = 0, 0
    for chunk in range(new_parallelism):
        wanted = base + (1 if chunk < extra else 0)
        target = plan[(start_offset + chunk) % new_parallelism]
        while wanted > 0:
            while position == lengths_per_old_subtask[old]:
                old, position = old + 1, 0
            taken = min(wanted, lengths_per_old_subtask[old] - position)
            target.append(StateSlice(old, position, position + taken))
            position += taken
            wanted -= taken
    return plan


def state_modes(old: Sequence[Mapping[str, StateLayout]]) -> dict[str, DistributionMode]:
    """The mode of every state name, sorted by name; IncompatibleStateError on a conflict."""
    modes: dict[str, DistributionMode] = {}
    for subtask, states in enumerate(old):
        for name, layout in states.items():
            known = modes.setdefault(name, layout.mode)
            if known is not layout.mode:
                raise IncompatibleStateError(
                    f"operator state {name!r} is {known.value} state in one old subtask but "
                    f"{layout.mode.value} state in old subtask {subtask}: a state name must "
                    f"keep one distribution mode"
                )
    return dict(sorted(modes.items()))


def _whole(old_subtask: int, lengths: Sequence[int]) -> tuple[StateSlice, ...]:
    """All of one old subtask's list, as one slice (none when the list is empty)."""
    length = lengths[old_subtask]
    return (StateSlice(old_subtask, 0, length),) if length else ()


def plan_operator_state(
    old: Sequence[Mapping[str, StateLayout]], new_parallelism: int
) -> list[dict[str, StatePlan]]:
    """Per new subtask, for every state name (sorted), which old elements it gets.

    ``old`` has one mapping per old subtask (name -> mode and length); a name missing from
    an old subtask counts as an empty list there. Every new subtask gets an entry for every
    name, possibly with no slices.
    """
    _check_new_parallelism(new_parallelism)
    modes = state_modes(old)
    plan: list[dict[str, StatePlan]] = [{} for _ in range(new_parallelism)]
    split_start = 0
    for name, mode in modes.items():
        lengths = [states[name].length if name in states else 0 for states in old]
        if mode is DistributionMode.UNION:
            everything = tuple(s for i in range(len(old)) for s in _whole(i, lengths))
            shares = [everything] * new_parallelism
        elif mode is DistributionMode.BROADCAST:
            holders = [i for i, states in enumerate(old) if name in states]
            shares = [_whole(holders[i % len(holders)], lengths) for i in range(new_parallelism)]
        elif new_parallelism == len(old):
            shares = [_whole(i, lengths) for i in range(new_parallelism)]
        else:
            shares = [tuple(s) for s in plan_split(lengths, new_parallelism, split_start)]
            split_start = (split_start + sum(lengths) % new_parallelism) % new_parallelism
        for subtask_plan, share in zip(plan, shares, strict=True):
            subtask_plan[name] = StatePlan(mode, share)
    return plan


class KeyGroupSource(NamedTuple):
    """An old subtask and the part of its key-group range that a new subtask takes over."""

    old_subtask: int
    key_groups: KeyGroupRange


@dataclass(frozen=True)
class KeyedAssignment:
    """A new subtask's key-group range and the old subtasks (in order) that hold parts of it."""

    subtask: int
    key_group_range: KeyGroupRange
    old_subtasks: tuple[KeyGroupSource, ...]


def assign_key_group_ranges(
    max_parallelism: int, old_ranges: Sequence[KeyGroupRange], new_parallelism: int
) -> list[KeyedAssignment]:
    """For each new subtask, its key-group range and every old range that intersects it.

    Raises ConfigurationError for an invalid new parallelism (or one above
    ``max_parallelism``) and IncompatibleStateError when an old range reaches outside
    ``0 .. max_parallelism - 1`` (the state was written with another max parallelism).
    """
    check_parallelism(new_parallelism, max_parallelism)
    for subtask, old_range in enumerate(old_ranges):
        if old_range and (old_range.start < 0 or old_range.end >= max_parallelism):
            raise IncompatibleStateError(
                f"old subtask {subtask} holds key groups {old_range.start}..{old_range.end}, "
                f"outside max parallelism {max_parallelism}: restore with the max parallelism "
                f"the state was written with"
            )
    assignments = []
    for subtask in range(new_parallelism):
        new_range = compute_key_group_range_for_operator_index(
            max_parallelism, new_parallelism, subtask
        )
        sources = (
            KeyGroupSource(old, new_range.intersection(old_range))
            for old, old_range in enumerate(old_ranges)
        )
        assignments.append(
            KeyedAssignment(subtask, new_range, tuple(s for s in sources if s.key_groups))
        )
    return assignments
