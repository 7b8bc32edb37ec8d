"""The operator state of a keyed subtask's user function, on the executor (FLIP-8).

A user function the runtime runs per keyed subtask (StatefulJob's ``KeyedFunction``, a
``transform_with_state`` processor) that also implements ``CheckpointedFunction`` (or
``ListCheckpointed``) keeps non-keyed state per subtask: a buffer, offsets, a broadcast
rule set. It has the same lifecycle as the subtask's local keyed state
(``local_state``): the Spark task gets a freshly unpickled function every batch, so this
process keeps the function instance and its ``OperatorStateBackend`` of each subtask it
ran, with the version marker they are at (``LocalVersion.marker``: the batch and the
task attempt that ran it). A batch that reuses the local keyed copy and finds the live
function current (``LocalVersion.is_current``: at the batch before, left by the attempt
whose record its manifest accepted) goes on with it (``initialize_state`` is not
called again); any other batch (first batch, another worker or host, a retried attempt,
an attempt of a batch whose manifest accepted another, a rescale) takes the plan's
function, restores its operator state at the batch before
(the newest manifest's records, or the checkpoint restored from; redistributed by mode
to the subtask at the current parallelism) and calls ``initialize_state`` with it.

The live entry is taken out of the table when a batch starts and put back only when the
batch committed its local state, so a failed attempt never leaves function state that a
retry could continue from: the retry restores the state of the last committed batch,
exactly as its keyed state is rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from statebackend.backends.operator import OperatorStateBackend, OperatorStateCut
from statebackend.checkpoint.changelog_restore import rebuild_operator_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.restore import restore_operator_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.spark.local_state import LocalVersion, restore_version
from statebackend.spark.process_cache import ProcessCache
from statebackend.state.functions import (
    CheckpointedFunction,
    FunctionInitializationContext,
    FunctionSnapshotContext,
    as_checkpointed_function,
)

_Function = TypeVar("_Function")


@dataclass(frozen=True)
class FunctionRun(Generic[_Function]):
    """A keyed subtask's user function for a batch and, if it is checkpointed, its
    operator state."""

    function: _Function
    checkpointed: CheckpointedFunction | None = None
    operator_state: OperatorStateBackend | None = None

    def snapshot(self, batch_id: int) -> OperatorStateCut | None:
        """Call ``snapshot_state`` (its context's ``checkpoint_id`` is the batch id: every
        batch is a durable cut) and return the operator state's cut; None if the
        function keeps no operator state."""
        if self.checkpointed is None or self.operator_state is None:
            return None
        self.checkpointed.snapshot_state(FunctionSnapshotContext(batch_id, self.operator_state))
        return self.operator_state.sync_cut()


LIVE_FUNCTIONS = 64
"""How many subtasks' live functions a process keeps (of any jobs): the least recently
run beyond it are dropped (their next batch here restores them, as on another worker)."""

_LIVE: ProcessCache[tuple[str, int], tuple[dict[str, Any], FunctionRun[Any]]] = ProcessCache(
    LIVE_FUNCTIONS
)
"""This process's live functions: (local root, subtask) -> (version marker, run)."""


def restore_function_state(
    storage: CheckpointStorage, version: LocalVersion, operator_id: str, subtask: int
) -> OperatorStateBackend:
    """The operator state of ``operator_id``'s subtask ``subtask`` at
    ``version.previous_batch``: from manifest ``restore_manifest``, else checkpoint
    ``restore_dir``, else fresh (not restored).

    Raises CheckpointUnreadableError naming the source if it cannot be read, so that the
    driver falls back to an older checkpoint.
    """
    parallelism = version.parallelism

    def from_manifest(changelog: ChangelogStorage, manifest: BatchManifest) -> OperatorStateBackend:
        return rebuild_operator_state(changelog, manifest, operator_id, subtask, parallelism)

    def from_checkpoint(
        reads: CheckpointFileSystem, restore_dir: str, metadata: CheckpointMetadata
    ) -> OperatorStateBackend:
        restored = restore_operator_state(
            reads, restore_dir, metadata, operator_id, subtask, parallelism
        )
        return restored if restored.is_restored else OperatorStateBackend(OperatorStateCut())

    restored = restore_version(
        storage,
        version,
        f"subtask {subtask} of {operator_id} (its function's operator state)",
        from_manifest,
        from_checkpoint,
    )
    return OperatorStateBackend() if restored is None else restored


def start_function(
    function: _Function,
    root: Path,
    subtask: int,
    version: LocalVersion,
    keyed_state_reused: bool,
    restore: Callable[[], OperatorStateBackend],
    checkpointed_of: Callable[[_Function], CheckpointedFunction | None] = (
        as_checkpointed_function
    ),
) -> FunctionRun[_Function]:
    """The function to run subtask ``subtask``'s batch with: the live one if the local
    keyed state was reused and this process holds the function current
    (``version.is_current``: at ``previous_batch``, left by the attempt its manifest
    accepted), else ``function`` initialized (``initialize_state`` of
    ``checkpointed_of(function)``, the part of it that keeps operator state) with the
    operator state ``restore()`` returns. Functions without operator state are run as
    given."""
    key = (str(root), subtask)
    live = _LIVE.pop(key)
    stale = [
        k
        for k, (marker, _) in _LIVE.items()
        if k[0] == key[0] and not version.is_current(marker, k[1])
    ]
    for other in stale:
        _LIVE.pop(other)  # left behind by a batch this process did not run (or not accepted)
    checkpointed = checkpointed_of(function)
    if checkpointed is None:
        return FunctionRun(function)
    if live is not None and keyed_state_reused and version.is_current(live[0], subtask):
        return live[1]
    operator_state: OperatorStateBackend = restore()
    checkpointed.initialize_state(FunctionInitializationContext(operator_state))
    return FunctionRun(function, checkpointed, operator_state)


def keep_function(
    run: FunctionRun[Any],
    root: Path,
    subtask: int,
    version: LocalVersion,
    batch_id: int,
    attempt: str,
) -> None:
    """Keep ``run`` live in this process as subtask ``subtask`` at ``batch_id``, run by
    task attempt ``attempt`` (the one its changelog record names), once the batch
    committed its local state."""
    if run.checkpointed is not None:
        _LIVE.put((str(root), subtask), (version.marker(batch_id, attempt), run))
