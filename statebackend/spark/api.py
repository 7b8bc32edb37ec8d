"""What a user writes: a keyed function over the records of a micro-batch, with state.

``open(ctx)`` runs once per keyed subtask and micro-batch, before any record: it
registers state descriptors with ``ctx.get_state``. ``process(key, values, ctx)`` gets
all records of one key in the batch (in arrival order) and yields output rows (JSON-able
values, written to the job's output). State returned by ``ctx.get_state`` always acts on
the key being processed.

A keyed function may also keep operator (non-keyed) state per subtask by implementing
``state.functions.CheckpointedFunction`` (or ``ListCheckpointed``): ``initialize_state``
runs once when a subtask (re)starts, before ``open``, with its split, union and broadcast
states restored for its subtask index at the current parallelism; ``snapshot_state`` runs
at the end of every batch (its ``checkpoint_id`` is the batch id), and the state is
stored with the batch's changelog record and in every checkpoint
(``spark/function_state.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.state.descriptors import StateDescriptor
from statebackend.state.interfaces import State


class KeyedContext:
    """A keyed function's view of its subtask: state access and where it runs."""

    def __init__(self, backend: KeyedStateBackend, subtask: int, batch_id: int) -> None:
        self._backend = backend
        self.subtask = subtask
        self.batch_id = batch_id

    def get_state(self, descriptor: StateDescriptor) -> State:
        """The state ``descriptor`` describes, scoped to the key being processed."""
        return self._backend.get_state(descriptor)

    @property
    def current_key(self) -> Any:
        """The key being processed (None in ``open``)."""
        return self._backend.current_key


class KeyedFunction(ABC):
    """Processes the records of a micro-batch key by key, keeping keyed state.

    Instances are pickled to the executors: keep state in ``ctx.get_state`` (or, per
    subtask, in operator state: see the module docstring), not in attributes (attributes
    set in ``open`` or ``initialize_state`` are fine for state handles).
    """

    def open(self, ctx: KeyedContext) -> None:  # noqa: B027 - optional hook
        """Register states (``ctx.get_state``); called before the batch's first key."""

    @abstractmethod
    def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Iterable[Any]:
        """Handle all records of ``key`` in this batch; yield output rows."""


class RecordFunction(KeyedFunction):
    """A keyed function written record by record."""

    def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Iterator[Any]:
        """Call ``process_record`` for each record of ``key``, in order."""
        for record in values:
            yield from self.process_record(key, record, ctx)

    @abstractmethod
    def process_record(self, key: Any, record: Any, ctx: KeyedContext) -> Iterable[Any]:
        """Handle one record of ``key``; yield output rows."""
