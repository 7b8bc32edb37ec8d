"""Rebuild a subtask's keyed state from a batch manifest: base checkpoint + changelog.

A subtask whose local copy is missing or stale loads exactly the key groups of its range:
those of the manifest's base checkpoint (``restore.restore_keyed_state``: ranged reads or
the incremental download), then, batch by batch in ascending order, the changes of every
accepted record whose key-group range intersects its own, read with one ranged read per
record. Except on local disks, the records' reads run ahead of their replay, as many at
once as the storage's transfer threads and at most ``RECORD_BYTES_AHEAD`` bytes ahead; the
replay keeps their order, and a record that cannot be read fails the rebuild when its
turn comes, as if it had been read then. (A local read has no latency to hide, and its
Python steps on another thread only contend with the replay for the GIL.) With the
storage's signing key the manifest's signature was checked when it was loaded, and the
base checkpoint and every record are read through ``verified_reads``: only bytes matching
their signed SHA-256 are replayed. The old and the new parallelism may differ, and may
have changed between batches: each record carries its own key-group range.

The operator state of a keyed subtask (its user function's ``CheckpointedFunction``
state) is not replayed: each record holds a full copy, so ``rebuild_operator_state``
redistributes the copies in the records of the manifest's newest batch (or, when they
hold none, the base checkpoint's) to the new subtask.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass

from statebackend.backends.keyed import KeyedStateBackend, StateMetaInfo
from statebackend.backends.operator import OperatorStateBackend, OperatorStateCut
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import CheckpointFileSystem
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
from statebackend.keygroups import KeyGroupRange
from statebackend.snapshot.changelog_format import (
    ChangelogHandle,
    changes_range,
    read_changes,
    read_operator_state,
)
from statebackend.snapshot.operator_format import OperatorStateReader

RECORD_BYTES_AHEAD = 64 << 20
"""At most this many bytes of records are read ahead of their replay (at least one
record, however long)."""


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
    replays = [
        _Replay(number, handle, key_groups, changelog.record_path(handle))
        for number, batch in enumerate(manifest.operators.get(operator_id, ()))
        for handle in batch.subtasks
        if (key_groups := handle.key_group_range.intersection(owned))
    ]
    manifests_dir = changelog.layout.manifests_dir
    threads = 0 if changelog.fs.is_local else changelog.storage.transfer_threads
    with (
        verified_reads(changelog.fs, manifests_dir, manifest.files(), key) as reads,
        closing(_read_ahead(reads, replays, threads)) as fetched,
    ):
        clocks_replayed = False  # of the records of the batch replayed last
        previous_batch = -1
        for replay, data in zip(replays, fetched, strict=True):
            handle, path = replay.handle, replay.path
            if replay.batch != previous_batch:
                clocks_replayed, previous_batch = False, replay.batch
            read = (
                ()
                if path is None
                else list(read_changes(data.read_range, path, handle, replay.key_groups))
            )
            backend.replay(
                handle.key_serializer,
                handle.states,
                read,
                handle.timers,
                clocks_replayed,
                source=path,
            )
            clocks_replayed = clocks_replayed or handle.timers is not None
            changes += len(read)
            records += path is not None
    return RebuildResult(base_entries, changes, records)


@dataclass(frozen=True)
class _Replay:
    """One record to replay: its batch (the manifest's index), handle, the key groups
    of the rebuilt subtask it holds and its file (None: the batch had no changes)."""

    batch: int
    handle: ChangelogHandle
    key_groups: KeyGroupRange
    path: str | None

    def span(self) -> tuple[int, int] | None:
        """(start, length) of the ranged read its replay makes (None: it reads nothing)."""
        return None if self.path is None else changes_range(self.handle, self.key_groups)


class _Fetched:
    """A record's bytes read ahead: ``read_range`` gives them for the range they were
    read for, and reads any other range from ``reads`` (``read_changes`` asks for exactly
    that range)."""

    def __init__(
        self, reads: CheckpointFileSystem, span: tuple[int, int] | None, data: bytes | None
    ) -> None:
        self._reads = reads
        self._span = span
        self._data = data

    def read_range(self, path: str, start: int, length: int) -> bytes:
        if self._data is not None and (start, length) == self._span:
            return self._data
        return self._reads.read_range(path, start, length)


def _read_ahead(
    reads: CheckpointFileSystem, replays: Sequence[_Replay], threads: int
) -> Generator[_Fetched, None, None]:
    """Each of ``replays``' bytes, in order, read through ``reads`` with up to ``threads``
    reads running ahead of the caller, at most ``RECORD_BYTES_AHEAD`` bytes (at least
    one read). A read that failed raises its error when the caller reaches its record;
    reads not started when the caller stops are not made, those running are waited for.
    With no ``threads`` nothing is read ahead: each record is read in its turn."""
    if threads < 1:
        for _ in replays:
            yield _Fetched(reads, None, None)
        return
    spans = [replay.span() for replay in replays]
    reading = [
        (replay.path, span)
        for replay, span in zip(replays, spans, strict=True)
        if replay.path is not None and span is not None
    ]
    pending: deque[Future[bytes]] = deque()
    started = ahead = 0  # reads started; bytes of the pending ones
    with ThreadPoolExecutor(threads, thread_name_prefix="statebackend-changelog") as pool:

        def start_more() -> None:
            nonlocal started, ahead
            while started < len(reading) and len(pending) < threads:
                path, (start, length) = reading[started]
                if pending and ahead + length > RECORD_BYTES_AHEAD:
                    return
                pending.append(pool.submit(reads.read_range, path, start, length))
                started += 1
                ahead += length

        try:
            start_more()
            for replay, span in zip(replays, spans, strict=True):
                if replay.path is None or span is None:
                    yield _Fetched(reads, None, None)
                    continue
                data = pending.popleft().result()
                ahead -= span[1]
                start_more()
                yield _Fetched(reads, span, data)
        finally:
            for future in pending:
                future.cancel()


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
