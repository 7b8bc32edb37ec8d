"""Restore at any parallelism: plan who gets what, then read only that.

For a new parallelism P', new subtask i owns the key-group range of (M, P', i); it reads
the key groups of that range from every old keyed handle that intersects it (ranged
reads by the handle's index; an incremental handle is downloaded whole, opened as a
read-only RocksDB and only those key groups are streamed out), and its share of the
operator state by the old handles' element spans, per distribution mode.
``plan_restore`` computes the same without reading any state file, for
``statebackend plan``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import deque
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.backends.raw_keyed import RawKeyedState, RawKeyedStateCut
from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import CheckpointMetadata, OperatorSnapshot
from statebackend.errors import CheckpointNotFoundError, IncompatibleStateError
from statebackend.keygroups import KeyGroupRange, check_parallelism
from statebackend.redistribution import (
    KeyGroupSource,
    StateLayout,
    assign_key_group_ranges,
    plan_operator_state,
)
from statebackend.snapshot.handles import HandleFiles, resolve_path
from statebackend.snapshot.incremental import (
    IncrementalKeyedStateHandle,
    download_native_checkpoint,
    read_downloaded_runs,
)
from statebackend.snapshot.operator_format import OperatorStateReader
from statebackend.snapshot.raw_keyed_format import read_raw_keyed_streams


def check_max_parallelism(
    metadata: CheckpointMetadata | BatchManifest, requested: int | None
) -> int:
    """The max parallelism to run with: the checkpoint's (or batch manifest's), unless
    another was set explicitly (then IncompatibleStateError: key groups cannot be re-cut)."""
    if requested is not None and requested != metadata.max_parallelism:
        raise IncompatibleStateError(
            f"the checkpoint has max parallelism {metadata.max_parallelism} but "
            f"{requested} was set: key groups are fixed at a job's first checkpoint, so "
            f"restore with max parallelism {metadata.max_parallelism} (or leave it unset)"
        )
    return metadata.max_parallelism


def check_operators(
    metadata: CheckpointMetadata,
    operator_ids: set[str],
    allow_non_restored_state: bool,
    where: str = "CHECKPOINT",
) -> None:
    """IncompatibleStateError if the checkpoint (at ``where``) has state of operators the
    job (``operator_ids``) lacks, unless the caller allows non-restored state."""
    unknown = sorted(set(metadata.operators) - operator_ids)
    if unknown and not allow_non_restored_state:
        drops = " ".join(f"--drop-operator {operator}" for operator in unknown)
        raise IncompatibleStateError(
            f"{where} has state of operators {unknown}, which this job (operators "
            f"{sorted(operator_ids)}) does not have: use the operator id the state was "
            f"written with, or write a savepoint without it (`statebackend savepoint "
            f"transform --from {where} --to NEW_DIR {drops}`) and restore from that"
        )


def operator_snapshot(metadata: CheckpointMetadata, operator_id: str) -> OperatorSnapshot | None:
    """The operator's snapshot in the checkpoint (None: the operator starts empty)."""
    return metadata.operators.get(operator_id)


@dataclass(frozen=True)
class SubtaskPlan:
    """What new subtask ``subtask`` would restore."""

    subtask: int
    key_group_range: KeyGroupRange
    keyed_sources: tuple[KeyGroupSource, ...]
    """The old subtasks' key groups it reads, in old-subtask order."""
    keyed_source_bytes: tuple[int, ...]
    """Bytes it reads from each of ``keyed_sources``."""
    operator_elements: dict[str, list[tuple[int, int, int]]]
    """Per operator state: (old subtask, first element, end element) slices."""

    @property
    def keyed_bytes(self) -> int:
        """Bytes of keyed state this subtask reads."""
        return sum(self.keyed_source_bytes)


def plan_restore(
    metadata: CheckpointMetadata, operator_id: str, new_parallelism: int
) -> list[SubtaskPlan]:
    """Who gets what when ``operator_id`` restores at ``new_parallelism``; reads nothing."""
    check_parallelism(new_parallelism, metadata.max_parallelism)
    snapshot = operator_snapshot(metadata, operator_id)
    if snapshot is None:
        raise CheckpointNotFoundError(
            f"the checkpoint has no operator {operator_id!r}; it has {sorted(metadata.operators)}"
        )
    handles = [ack.keyed for ack in snapshot.subtasks]
    old_ranges = [h.key_group_range if h is not None else KeyGroupRange.empty() for h in handles]
    keyed = assign_key_group_ranges(metadata.max_parallelism, old_ranges, new_parallelism)
    layouts = [
        {}
        if h is None
        else {name: StateLayout(info.mode, len(info.elements)) for name, info in h.states.items()}
        for h in snapshot.operator_handles()
    ]
    operator_plan = plan_operator_state(layouts, new_parallelism)
    plans = []
    for assignment, shares in zip(keyed, operator_plan, strict=True):
        sources = [
            (source, handle.bytes_for(source.key_groups))
            for source in assignment.old_subtasks
            if (handle := handles[source.old_subtask]) is not None
        ]
        plans.append(
            SubtaskPlan(
                assignment.subtask,
                assignment.key_group_range,
                tuple(source for source, _ in sources),
                tuple(size for _, size in sources),
                {
                    name: [(s.old_subtask, s.begin, s.end) for s in share.slices]
                    for name, share in shares.items()
                },
            )
        )
    return plans


def restore_keyed_state(
    backend: KeyedStateBackend,
    fs: CheckpointFileSystem,
    checkpoint_dir: str,
    metadata: CheckpointMetadata,
    operator_id: str,
) -> int:
    """Load into ``backend`` the key groups of its range from the checkpoint.

    Full snapshots: reads only the intersecting key groups, by ranged reads run ahead of
    the decoding, verifying every frame. Incremental snapshots: downloads the
    intersecting handles' files (into the backend's ``scratch_dir``, else the system's
    temp directory; two handles at a time, ahead of their loading) and checks their
    checksums. Into a backend that accepts one (a fresh RocksDB backend), the
    incremental handle that covers most of its key groups is downloaded and becomes its
    data, clipped to its range by ``delete_range`` (as Flink does); every other source
    is read as sorted runs and loaded by ``backend.restore_sorted`` (RocksDB: written
    into SST files and ingested, without a put). Returns the number of entries copied (a
    native checkpoint that becomes the database is not copied: its entries do not count).
    """
    check_max_parallelism(metadata, backend.max_parallelism)
    snapshot = operator_snapshot(metadata, operator_id)
    if snapshot is None:
        return 0
    sources = [
        (handle, key_groups)
        for handle in snapshot.keyed_handles()
        if (key_groups := handle.key_group_range.intersection(backend.key_group_range))
    ]
    base = None
    incremental = [s for s in sources if isinstance(s[0], IncrementalKeyedStateHandle)]
    if incremental and backend.accepts_native_checkpoint():
        base = max(incremental, key=lambda source: len(source[1]))
        sources = [base, *(source for source in sources if source is not base)]
    handles = [h for h, _ in sources if isinstance(h, IncrementalKeyedStateHandle)]
    files = HandleFiles(fs, checkpoint_dir, fs.read_range, backend.scratch_dir)
    restored = 0
    with (
        tempfile.TemporaryDirectory(prefix="restore-", dir=backend.scratch_dir) as temporary,
        closing(_downloaded(fs, checkpoint_dir, handles, Path(temporary))) as downloads,
    ):
        for source in sources:
            handle, key_groups = source
            if not isinstance(handle, IncrementalKeyedStateHandle):
                runs = handle.read_runs(files, key_groups)
                where = ", ".join(files.path_of(file.path) for file in handle.files())
                restored += backend.restore_sorted(
                    handle.key_serializer, handle.states, runs, handle.timers, source=where
                )
                continue
            local = next(downloads)
            where = (
                f"{checkpoint_dir} (the incremental snapshot of key groups "
                f"{handle.key_group_range.start}..{handle.key_group_range.end})"
            )
            if source is base:
                backend.restore_native_checkpoint(
                    local, handle.key_serializer, handle.states, handle.timers, source=where
                )
                continue
            runs = read_downloaded_runs(local, handle, key_groups)
            restored += backend.restore_sorted(
                handle.key_serializer, handle.states, runs, handle.timers, source=where
            )
            shutil.rmtree(local)
    return restored


HANDLE_DOWNLOADS_AHEAD = 2
"""Incremental handles a restore downloads at once: the one it loads next and the one
after (so the download of the adopted database overlaps the next handle's, and each
handle's copy the download of the one after), each 4 files at a time."""


def _downloaded(
    fs: CheckpointFileSystem,
    checkpoint_dir: str,
    handles: list[IncrementalKeyedStateHandle],
    into: Path,
) -> Generator[Path, None, None]:
    """The directories the handles' files were downloaded into (one each under
    ``into``), in order, with up to ``HANDLE_DOWNLOADS_AHEAD`` downloads running ahead of
    the caller; downloads not started when the caller stops are not made."""
    ahead = HANDLE_DOWNLOADS_AHEAD
    remaining = iter(enumerate(handles))
    pending: deque[tuple[Path, Future[None]]] = deque()
    with ThreadPoolExecutor(ahead, thread_name_prefix="statebackend-restore") as pool:

        def start_more() -> None:
            while len(pending) < ahead and (item := next(remaining, None)) is not None:
                number, handle = item
                target = into / f"handle-{number}"
                target.mkdir()
                download = pool.submit(
                    download_native_checkpoint, fs, checkpoint_dir, handle, target
                )
                pending.append((target, download))

        try:
            start_more()
            while pending:
                target, download = pending.popleft()
                download.result()
                start_more()
                yield target
        finally:
            for _, download in pending:
                download.cancel()


def restore_operator_state(
    fs: CheckpointFileSystem,
    checkpoint_dir: str,
    metadata: CheckpointMetadata,
    operator_id: str,
    subtask: int,
    new_parallelism: int,
) -> OperatorStateBackend:
    """The operator state backend of new subtask ``subtask`` of ``new_parallelism``.

    Split state is divided among the new subtasks, union state goes to all, broadcast
    state is copied (``redistribution``). An operator absent from the checkpoint starts
    empty (and not restored).
    """
    snapshot = operator_snapshot(metadata, operator_id)
    if snapshot is None:
        return OperatorStateBackend()
    reader = OperatorStateReader(snapshot.operator_handles(), checkpoint_dir, fs.read_range)
    return OperatorStateBackend(reader.restore_cut(subtask, new_parallelism))


def restore_raw_keyed_state(
    fs: CheckpointFileSystem,
    checkpoint_dir: str,
    metadata: CheckpointMetadata,
    operator_id: str,
    key_group_range: KeyGroupRange,
) -> RawKeyedState:
    """The raw keyed state of the subtask owning ``key_group_range``: the streams of
    exactly those key groups, read by ranged reads from every old subtask that held some.

    An operator absent from the checkpoint starts empty (and not restored).
    """
    snapshot = operator_snapshot(metadata, operator_id)
    if snapshot is None:
        return RawKeyedState(key_group_range)
    streams: dict[int, bytes] = {}
    for handle in snapshot.raw_keyed_handles():
        key_groups = handle.key_group_range.intersection(key_group_range)
        if key_groups:
            path = resolve_path(checkpoint_dir, handle.path)
            streams.update(read_raw_keyed_streams(fs.read_range, path, handle, key_groups))
    return RawKeyedState(key_group_range, RawKeyedStateCut(key_group_range, streams))
