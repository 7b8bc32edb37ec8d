"""Rebuild a subtask's keyed state from a batch manifest: base checkpoint + changelog.

A subtask whose local copy is missing or stale loads exactly the key groups of its range:
those of the manifest's base checkpoint (``restore.restore_keyed_state``: ranged reads or
the incremental download), then, batch by batch in ascending order, the changes of every
accepted record whose key-group range intersects its own, read with one ranged read per
record. With the storage's signing key the manifest's signature was checked when it was
loaded, and the base checkpoint and every record are read through ``verified_reads``:
only bytes matching their signed SHA-256 are replayed. The old and the new parallelism
may differ, and may have changed between batches: each record carries its own key-group
range.

The operator state of a keyed subtask (its user function's ``CheckpointedFunction``
state) is not replayed: each record holds a full copy, so ``rebuild_operator_state``
redistributes the copies in the records of the manifest's newest batch (or, when they
hold none, the base checkpoint's) to the new subtask.
"""

from __future__ import annotations

from dataclasses import dataclass

from statebackend.backends.keyed import KeyedStateBackend, StateMetaInfo
from statebackend.backends.operator import OperatorStateBackend, OperatorStateCut
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.restore import restore_keyed_state, restore_operator_state
from statebackend.checkpoint.signing import verified_reads
from statebackend.checkpoint.storage import load_metadata
from statebackend.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    IncompatibleStateError,
)
from statebackend.snapshot.changelog_format import read_changes, read_operator_state
from statebackend.snapshot.operator_format import OperatorStateReader


@dataclass(frozen=True)
class RebuildResult:
    """What a rebuild read: entries of the base checkpoint, changes replayed, and records
    read (those that intersect the subtask's key groups and have changes)."""

    base_entries: int
    changes: int
    records: int


def rebuild_keyed_state(
    backend: KeyedStateBackend,
    changelog: ChangelogStorage,
    manifest: BatchManifest,
    operator_id: str,
) -> RebuildResult:
    """Load into ``backend`` (empty, before ``get_state``) the state of ``operator_id``
    at the end of ``manifest``'s batch, for the backend's key-group range.

    Raises IncompatibleStateError if the backend's max parallelism is not the
    manifest's, CheckpointCorruptedError naming the path of a missing or damaged base
    checkpoint or record.
    """
    if backend.max_parallelism != manifest.max_parallelism:
        raise IncompatibleStateError(
            f"manifest {manifest.batch_id} has max parallelism {manifest.max_parallelism} but "
            f"the backend {backend.max_parallelism}: rebuild with max parallelism "
            f"{manifest.max_parallelism}"
        )
    base_entries = 0
    key = changelog.storage.signing_key
    base = _base_metadata(changelog, manifest)
    if base is not None:
        directory, metadata = base
        with verified_reads(changelog.fs, directory, metadata.files(), key) as reads:
            base_entries = restore_keyed_state(backend, reads, directory, metadata, operator_id)
    changes = records = 0
    owned = backend.key_group_range
    manifests_dir = changelog.layout.manifests_dir
    with verified_reads(changelog.fs, manifests_dir, manifest.files(), key) as reads:
        for batch in manifest.operators.get(operator_id, ()):
            clocks_replayed = False  # of this batch's records
            for handle in batch.subtasks:
                key_groups = handle.key_group_range.intersection(owned)
                if not key_groups:
                    continue
                path = changelog.record_path(handle)
                read = (
                    ()
                    if path is None
                    else list(read_changes(reads.read_range, path, handle, key_groups))
                )
                backend.replay(
                    handle.key_serializer, handle.states, read, handle.timers, clocks_replayed
                )
                clocks_replayed = clocks_replayed or handle.timers is not None
                changes += len(read)
                records += path is not None
    return RebuildResult(base_entries, changes, records)


def _base_metadata(
    changelog: ChangelogStorage, manifest: BatchManifest
) -> tuple[str, CheckpointMetadata] | None:
    """The directory and ``_metadata`` of ``manifest``'s base checkpoint (None: it has
    none); CheckpointCorruptedError naming it if it is gone."""
    directory = changelog.base_directory(manifest)
    if directory is None:
        return None
    try:
        return directory, load_metadata(changelog.fs, directory, changelog.storage.signing_key)
    except CheckpointNotFoundError as exc:
        raise CheckpointCorruptedError(
            f"the base checkpoint {directory} of manifest {manifest.batch_id} is gone: {exc}"
        ) from exc


def stored_keyed_states(
    changelog: ChangelogStorage, manifest: BatchManifest, operator_id: str
) -> dict[str, StateMetaInfo]:
    """The keyed states of ``operator_id`` at the end of ``manifest``'s batch, by name, as
    the newest of its records that name them (else its base checkpoint) recorded them;
    CheckpointCorruptedError if the base checkpoint is gone."""
    found: dict[str, StateMetaInfo] = {}
    for records in reversed(manifest.operators.get(operator_id, ())):
        for handle in records.subtasks:
            for meta in handle.states:
                found.setdefault(meta.name, meta)
    base = _base_metadata(changelog, manifest)
    operator = None if base is None else base[1].operators.get(operator_id)
    stored = {} if operator is None else operator.keyed_states()
    return {**stored, **found}


def rebuild_operator_state(
    changelog: ChangelogStorage,
    manifest: BatchManifest,
    operator_id: str,
    subtask: int,
    parallelism: int,
) -> OperatorStateBackend:
    """The operator state of new subtask ``subtask`` of ``parallelism`` of ``operator_id``
    at the end of ``manifest``'s batch: the old subtasks' copies in the records of the
    manifest's newest batch (else in its base checkpoint) redistributed by mode.

    The backend is restored (``is_restored``), empty when no record or base holds
    operator state of the operator. Raises CheckpointCorruptedError naming the path of a
    missing or damaged record or base checkpoint.
    """
    batches = manifest.operators.get(operator_id, ())
    newest = batches[-1].subtasks if batches else ()
    key = changelog.storage.signing_key
    directory = changelog.layout.manifests_dir
    if any(handle.operator_state is not None for handle in newest):
        with verified_reads(changelog.fs, directory, manifest.files(), key) as reads:
            handles = [
                None if path is None else read_operator_state(reads.read_range, path, handle)
                for handle in newest
                for path in [changelog.record_path(handle)]
            ]
            reader = OperatorStateReader(handles, directory, reads.read_range)
            return OperatorStateBackend(reader.restore_cut(subtask, parallelism))
    base = _base_metadata(changelog, manifest)
    if base is None:
        return OperatorStateBackend(OperatorStateCut())
    base_dir, metadata = base
    with verified_reads(changelog.fs, base_dir, metadata.files(), key) as reads:
        restored = restore_operator_state(
            reads, base_dir, metadata, operator_id, subtask, parallelism
        )
    return restored if restored.is_restored else OperatorStateBackend(OperatorStateCut())
