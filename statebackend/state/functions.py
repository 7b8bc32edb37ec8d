"""The operator state a user function keeps itself (FLIP-8): Flink's CheckpointedFunction
and ListCheckpointed, and the operator state store they are handed.

A runtime calls ``initialize_state`` once per subtask, before the function sees data,
with the subtask's share of the restored state (split, union or broadcast, by each
state's mode), and ``snapshot_state`` at each synchronous cut. The store is
``backends.operator.OperatorStateBackend``; the Protocols here say what a function may
rely on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from statebackend.serializers import PickleSerializer, Serializer

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


class OperatorListStateView(Protocol[T]):
    """A named list of one subtask (split or union state)."""

    def get(self) -> list[T]:
        """The elements, in the order they were added."""

    def add(self, value: T) -> None:
        """Append ``value``."""

    def add_all(self, values: Iterable[T]) -> None:
        """Append all ``values``, or none of them if one cannot be encoded."""

    def update(self, values: Iterable[T]) -> None:
        """Replace the elements by ``values``."""

    def clear(self) -> None:
        """Remove all elements."""


class BroadcastStateView(Protocol[K, V]):
    """A named map that every subtask holds a copy of."""

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of ``key``, or ``default``."""

    def put(self, key: K, value: V) -> None:
        """Map ``key`` to ``value``."""

    def put_all(self, mapping: Mapping[K, V]) -> None:
        """Put every entry of ``mapping``, or none of them if one cannot be encoded."""

    def remove(self, key: K) -> None:
        """Remove ``key`` if it is present."""

    def contains(self, key: K) -> bool:
        """Whether ``key`` has a value."""

    def items(self) -> Iterator[tuple[K, V]]:
        """The (key, value) pairs."""

    def is_empty(self) -> bool:
        """Whether the map has no entries."""

    def clear(self) -> None:
        """Remove all entries."""


class OperatorStateStore(Protocol):
    """The operator state of one subtask, as a user function sees it (Flink's
    OperatorStateStore)."""

    @property
    def is_restored(self) -> bool:
        """Whether the state was restored from a checkpoint (else it starts empty)."""

    def get_list_state(self, name: str, serializer: Serializer[T]) -> OperatorListStateView[T]:
        """Split list state ``name``: on rescale its elements are divided among subtasks."""

    def get_union_list_state(
        self, name: str, serializer: Serializer[T]
    ) -> OperatorListStateView[T]:
        """Union list state ``name``: on restore every subtask gets all elements."""

    def get_broadcast_state(
        self, name: str, key_serializer: Serializer[K], value_serializer: Serializer[V]
    ) -> BroadcastStateView[K, V]:
        """Broadcast map state ``name``: on restore every subtask gets a copy."""

    def set_raw_state(self, partitions: Sequence[bytes]) -> None:
        """Replace the subtask's raw partitions (split on rescale, each one whole)."""

    def get_raw_state(self) -> list[bytes]:
        """The raw partitions set here or restored to this subtask."""


@dataclass(frozen=True)
class FunctionInitializationContext:
    """What ``CheckpointedFunction.initialize_state`` gets: the subtask's operator state."""

    operator_state_store: OperatorStateStore

    @property
    def is_restored(self) -> bool:
        """Whether the state was restored from a checkpoint (else it starts empty)."""
        return self.operator_state_store.is_restored


@dataclass(frozen=True)
class FunctionSnapshotContext:
    """What ``CheckpointedFunction.snapshot_state`` gets: the checkpoint and the state."""

    checkpoint_id: int
    operator_state_store: OperatorStateStore


@runtime_checkable
class CheckpointedFunction(Protocol):
    """A function that keeps operator state itself (Flink's CheckpointedFunction)."""

    def initialize_state(self, ctx: FunctionInitializationContext) -> None:
        """Register states (and read them back when ``ctx.is_restored``); called first."""

    def snapshot_state(self, ctx: FunctionSnapshotContext) -> None:
        """Bring the registered states up to date for checkpoint ``ctx.checkpoint_id``."""


@runtime_checkable
class ListCheckpointed(Protocol):
    """A function whose state is one redistributable list (Flink's ListCheckpointed)."""

    def snapshot_state(self, checkpoint_id: int) -> list[Any]:
        """The elements to checkpoint; on rescale they are split among subtasks."""

    def restore_state(self, state: list[Any]) -> None:
        """Take back this subtask's share of the checkpointed elements."""


LIST_CHECKPOINTED_STATE_NAME = "_default_"
"""The split list state a ``ListCheckpointed`` function's elements are stored under."""


class ListCheckpointedAdapter:
    """Runs a ``ListCheckpointed`` function as a ``CheckpointedFunction``.

    Its elements are stored as split list state ``LIST_CHECKPOINTED_STATE_NAME``, encoded
    with ``serializer`` (pickle unless given).
    """

    def __init__(
        self, function: ListCheckpointed, serializer: Serializer[Any] | None = None
    ) -> None:
        self.function = function
        self.serializer: Serializer[Any] = serializer or PickleSerializer()

    def initialize_state(self, ctx: FunctionInitializationContext) -> None:
        """Restore the function's elements when the state was restored."""
        state = ctx.operator_state_store.get_list_state(
            LIST_CHECKPOINTED_STATE_NAME, self.serializer
        )
        if ctx.is_restored:
            self.function.restore_state(state.get())

    def snapshot_state(self, ctx: FunctionSnapshotContext) -> None:
        """Store the function's current elements for the checkpoint."""
        ctx.operator_state_store.get_list_state(
            LIST_CHECKPOINTED_STATE_NAME, self.serializer
        ).update(self.function.snapshot_state(ctx.checkpoint_id))


def as_checkpointed_function(function: object) -> CheckpointedFunction | None:
    """``function`` itself if it is a CheckpointedFunction, wrapped if it is
    ListCheckpointed, None if it keeps no operator state."""
    if isinstance(function, CheckpointedFunction):
        return function
    if isinstance(function, ListCheckpointed):
        return ListCheckpointedAdapter(function)
    return None
