"""Metrics of a job's batches, checkpoints, restores and failures, kept with the job.

Flink answers "are checkpoints getting slower, which subtask is hot, what did the last
failover cost" from its checkpoint history and metrics; Spark from
``StreamingQueryProgress``. We keep one structured record per batch, checkpoint, restore
and failure (``BatchMetrics``, ``CheckpointMetrics``, ``RestoreMetrics``,
``FailureMetrics``) in a history next to the checkpoints, and emit each one through
Python ``logging`` (logger ``statebackend.checkpoint.metrics``, level INFO, a one-line message; the
record's JSON in the log record's ``metrics`` attribute), so ``statebackend report`` can
plot a job after the fact and a log pipeline can follow it live.

History layout, one directory per run of the job::

    <job dir>/metrics/<start ms, 13 digits>-<run id>/<segment, 8 digits>.jsonl

Each line is one record's JSON (``"kind"`` names its type). Object stores cannot append,
so the history never appends: it rewrites the run's current segment whole (one atomic
write through ``CheckpointFileSystem``) with each record, and starts a new segment once
the current one holds ``segment_bytes``. A record is therefore durable as soon as
``record`` returns, and a segment is never seen half-written. Before a new segment is
started the oldest segments of the job (over all runs; a run's directory goes with its
last segment) are deleted until at most ``max_segments`` remain, so the history holds at
most ``max_segments`` x (``segment_bytes`` + one record) bytes: 4 MiB and a little by
default. Writing a record costs one write of at most that segment.

Metrics never fail the job: a record that cannot be written is logged as a warning and
kept only in memory (``MetricsHistory.latest``). ``read_history`` skips lines it cannot
parse and records of kinds it does not know (written by a newer release).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.layout import METRICS_DIR, join, validate_id
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.errors import MALFORMED_DOCUMENT, CheckpointError, ConfigurationError
from statebackend.snapshot.incremental import IncrementalKeyedStateHandle

if TYPE_CHECKING:
    from statebackend.backends.changelog import ChangeSet
    from statebackend.backends.keyed import KeyedStateBackend

SEGMENT_SUFFIX = ".jsonl"
DEFAULT_SEGMENT_BYTES = 64 << 10
DEFAULT_MAX_SEGMENTS = 64

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubtaskState:
    """One subtask's state in a checkpoint: bytes of its snapshot files and, when the
    subtask counted them, its entries (None: not counted)."""

    operator_id: str
    subtask: int
    state_bytes: int
    entries: int | None = None


@dataclass(frozen=True)
class BatchMetrics:
    """One micro-batch: records read and written, distinct keys touched, where its time
    went (seconds reading the source, shuffling, in the keyed function, in the
    synchronous cut, waiting for a previous checkpoint) and the changelog bytes written.

    The batch's durable part is ``changelog_seconds`` (the slowest subtask's drain,
    encoding and write of its changelog record) plus ``manifest_seconds`` (the driver's
    commit of the batch manifest).

    What the state did, as every keyed subtask counts it (``state_counts``; what
    Spark's ``StateOperatorProgress`` reports): state entries at the end of the batch
    (``state_rows``, timers not counted; None where not counted:
    ``KeyedStateBackend.counted_entries``) and the memory they took
    (``state_memory_bytes``, as the storage estimates it; None if it does not),
    entries written and removed (by their last change in the batch:
    ``backends.changelog.ChangeCounts``), timers registered, removed (deleted or fired)
    and fired (every call to register or delete one, as Spark counts them), late input
    rows dropped, and the slowest subtask's seconds firing timers."""

    batch_id: int
    records_in: int
    records_out: int
    keys_touched: int
    source_seconds: float = 0.0
    shuffle_seconds: float = 0.0
    keyed_seconds: float = 0.0
    sync_cut_seconds: float = 0.0
    waiting_seconds: float = 0.0
    changelog_bytes: int = 0
    changelog_seconds: float = 0.0
    manifest_seconds: float = 0.0
    state_rows: int | None = None
    state_memory_bytes: int | None = None
    state_rows_written: int = 0
    state_rows_removed: int = 0
    timers_registered: int = 0
    timers_removed: int = 0
    timers_fired: int = 0
    late_rows: int = 0
    timer_seconds: float = 0.0
    at: float = field(default_factory=time.time)

    def describe(self) -> str:
        """A one-line summary for the log."""
        return (
            f"batch {self.batch_id}: {self.records_in} records in, {self.records_out} out, "
            f"{self.keys_touched} keys; source {self.source_seconds:.3f} s, shuffle "
            f"{self.shuffle_seconds:.3f} s, keyed {self.keyed_seconds:.3f} s, sync cut "
            f"{self.sync_cut_seconds:.3f} s, waiting {self.waiting_seconds:.3f} s; "
            f"changelog {self.changelog_bytes} B in {self.changelog_seconds:.3f} s, "
            f"manifest {self.manifest_seconds:.3f} s"
        )


@dataclass(frozen=True)
class CheckpointMetrics:
    """One completed checkpoint: the batch it cut, bytes uploaded (full snapshots, new
    incremental files, changelogs), the longest synchronous cut of a subtask, the
    background upload's duration, trigger-to-complete duration, and each subtask's
    state."""

    checkpoint_id: int
    batch_id: int | None
    full_bytes: int
    incremental_bytes: int
    changelog_bytes: int
    sync_seconds: float
    upload_seconds: float
    duration_seconds: float
    subtasks: tuple[SubtaskState, ...] = ()
    at: float = field(default_factory=time.time)

    @property
    def uploaded_bytes(self) -> int:
        """Bytes uploaded for this checkpoint, all kinds."""
        return self.full_bytes + self.incremental_bytes + self.changelog_bytes

    def describe(self) -> str:
        """A one-line summary for the log."""
        state = sum(s.state_bytes for s in self.subtasks)
        return (
            f"checkpoint {self.checkpoint_id} (batch {self.batch_id}): uploaded "
            f"{self.uploaded_bytes} B (full {self.full_bytes}, incremental "
            f"{self.incremental_bytes}, changelog {self.changelog_bytes}); sync "
            f"{self.sync_seconds:.3f} s, upload {self.upload_seconds:.3f} s, total "
            f"{self.duration_seconds:.3f} s; state {state} B in {len(self.subtasks)} subtasks"
        )


@dataclass(frozen=True)
class RestoreMetrics:
    """A restore of subtasks' state: from which checkpoint (its directory), bytes read
    from checkpoint storage, seconds it took (the slowest subtask), subtasks restored."""

    checkpoint: str
    restored_bytes: int
    seconds: float
    subtasks: int
    at: float = field(default_factory=time.time)

    def describe(self) -> str:
        """A one-line summary for the log."""
        return (
            f"restored {self.subtasks} subtasks from {self.checkpoint}: "
            f"{self.restored_bytes} B in {self.seconds:.3f} s"
        )


@dataclass(frozen=True)
class FailureMetrics:
    """A failure the job recovered from (or did not): the batch it hit, the error's first
    line, and what recovered it (e.g. ``"restore from <checkpoint>"``, ``"retry"``,
    ``"fallback to <checkpoint>"``, ``"none: the run failed"``)."""

    batch_id: int | None
    error: str
    recovery: str
    at: float = field(default_factory=time.time)

    def describe(self) -> str:
        """A one-line summary for the log."""
        return f"failure in batch {self.batch_id}: {self.error}; recovery: {self.recovery}"


MetricsRecord = BatchMetrics | CheckpointMetrics | RestoreMetrics | FailureMetrics
"""Any record of the history."""

_KINDS: dict[str, type[MetricsRecord]] = {
    "batch": BatchMetrics,
    "checkpoint": CheckpointMetrics,
    "restore": RestoreMetrics,
    "failure": FailureMetrics,
}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


def kind_of(record: MetricsRecord) -> str:
    """The record's ``kind`` in JSON: ``batch``, ``checkpoint``, ``restore`` or ``failure``."""
    return _KIND_OF[type(record)]


def record_to_json(record: MetricsRecord) -> dict[str, Any]:
    """The record as a JSON-able dict with its ``kind``."""
    return {"kind": kind_of(record), **asdict(record)}


def record_from_json(data: dict[str, Any]) -> MetricsRecord | None:
    """The inverse of ``record_to_json``; None for a kind this release does not know.

    Raises TypeError or ValueError if the fields do not fit the kind.
    """
    cls = _KINDS.get(data.get("kind", ""))
    if cls is None:
        return None
    fields = {name: value for name, value in data.items() if name != "kind"}
    if cls is CheckpointMetrics:
        subtasks = fields.get("subtasks", ())
        if not isinstance(subtasks, list | tuple):
            raise TypeError(f"subtasks {subtasks!r} is not a list")
        fields["subtasks"] = tuple(_typed(SubtaskState, **s) for s in subtasks)
    return _typed(cls, **fields)


_FIELD_TYPES: dict[str, Callable[[Any], bool]] = {
    "int": lambda value: type(value) is int,
    "int | None": lambda value: value is None or type(value) is int,
    "float": lambda value: type(value) in (int, float),
    "str": lambda value: type(value) is str,
    "tuple[SubtaskState, ...]": lambda value: isinstance(value, tuple),
}
"""Whether a value read from JSON fits a record field, by the field's annotation."""


def _typed(cls: type[Any], **fields: Any) -> Any:
    """``cls(**fields)``; TypeError if a field's value is not of the field's type (a
    number given as text would otherwise fail later, where the record is used)."""
    types = {f.name: str(f.type) for f in dataclass_fields(cls)}
    for name, value in fields.items():
        check = _FIELD_TYPES.get(types.get(name, ""))
        if check is not None and not check(value):
            raise TypeError(f"{name} {value!r} is not of type {types[name]}")
    return cls(**fields)


def subtask_states(
    metadata: CheckpointMetadata, entries: dict[tuple[str, int], int] | None = None
) -> tuple[SubtaskState, ...]:
    """Each subtask's state bytes in ``metadata`` (keyed, operator and raw keyed state;
    operator state inlined in ``_metadata`` too), with its entry count from ``entries``
    (by (operator, subtask)) where given."""
    counts = entries or {}
    states = []
    for operator_id, snapshot in sorted(metadata.operators.items()):
        for ack in snapshot.subtasks:
            size = (0 if ack.keyed is None else ack.keyed.size) + (
                0 if ack.raw_keyed is None else ack.raw_keyed.size
            )
            if ack.operator_state is not None:
                size += ack.operator_state.size
            key = (operator_id, ack.subtask)
            states.append(SubtaskState(operator_id, ack.subtask, size, counts.get(key)))
    return tuple(states)


def state_counts(
    changes: ChangeSet,
    backend: KeyedStateBackend,
    *,
    timers_registered: int = 0,
    timers_deleted: int = 0,
    timers_fired: int = 0,
    late_rows: int = 0,
    timer_seconds: float = 0.0,
) -> dict[str, Any]:
    """A keyed subtask's ``BatchMetrics`` fields of what its state did in a batch: the
    batch's drained ``changes`` counted (``ChangeSet.counts``), the entries and memory
    ``backend`` holds now, and what the subtask counted itself while running the batch:
    calls registering and deleting timers, timers fired (deleted too, as Spark counts
    them), late rows dropped, seconds firing timers (none where its function has no
    timers and drops no rows)."""
    changed = changes.counts()
    return {
        "state_rows": backend.counted_entries(),
        "state_memory_bytes": backend.estimated_memory_bytes(),
        "state_rows_written": changed.rows_written,
        "state_rows_removed": changed.rows_removed,
        "timers_registered": timers_registered,
        "timers_removed": timers_deleted + timers_fired,
        "timers_fired": timers_fired,
        "late_rows": late_rows,
        "timer_seconds": timer_seconds,
    }


def combine_batches(
    batch_id: int,
    parts: Sequence[BatchMetrics],
    waiting_seconds: float = 0.0,
    manifest_seconds: float = 0.0,
) -> BatchMetrics:
    """Batch ``batch_id``'s metrics from its subtasks' (``parts``, each a subtask's own
    counts and seconds): counts and bytes summed, each phase the slowest subtask's seconds,
    ``waiting_seconds`` the driver's wait for a previous checkpoint, ``manifest_seconds``
    the driver's commit of the batch manifest."""
    return BatchMetrics(
        batch_id=batch_id,
        records_in=sum(p.records_in for p in parts),
        records_out=sum(p.records_out for p in parts),
        keys_touched=sum(p.keys_touched for p in parts),
        source_seconds=max((p.source_seconds for p in parts), default=0.0),
        shuffle_seconds=max((p.shuffle_seconds for p in parts), default=0.0),
        keyed_seconds=max((p.keyed_seconds for p in parts), default=0.0),
        sync_cut_seconds=max((p.sync_cut_seconds for p in parts), default=0.0),
        waiting_seconds=waiting_seconds,
        changelog_bytes=sum(p.changelog_bytes for p in parts),
        changelog_seconds=max((p.changelog_seconds for p in parts), default=0.0),
        manifest_seconds=manifest_seconds,
        state_rows=_sum_if_all(p.state_rows for p in parts),
        state_memory_bytes=_sum_if_all(p.state_memory_bytes for p in parts),
        state_rows_written=sum(p.state_rows_written for p in parts),
        state_rows_removed=sum(p.state_rows_removed for p in parts),
        timers_registered=sum(p.timers_registered for p in parts),
        timers_removed=sum(p.timers_removed for p in parts),
        timers_fired=sum(p.timers_fired for p in parts),
        late_rows=sum(p.late_rows for p in parts),
        timer_seconds=max((p.timer_seconds for p in parts), default=0.0),
    )


def _sum_if_all(counts: Iterable[int | None]) -> int | None:
    """The sum of ``counts``; None if any is None (a subtask did not count)."""
    values = list(counts)
    return None if None in values else sum(v for v in values if v is not None)


def with_job_seconds(
    batch: BatchMetrics, job_seconds: float, subtasks: Iterable[tuple[BatchMetrics, float]]
) -> BatchMetrics:
    """``batch`` with the time its Spark job (``job_seconds``) took beyond its slowest
    subtask as ``shuffle_seconds`` (source and shuffle). ``subtasks`` holds each subtask's
    metrics and restore seconds; a subtask's time is its restore, keyed work, changelog
    write and sync cut."""
    slowest = max(
        (
            restore + p.keyed_seconds + p.changelog_seconds + p.sync_cut_seconds
            for p, restore in subtasks
        ),
        default=0.0,
    )
    return replace(batch, shuffle_seconds=max(0.0, job_seconds - slowest))


def checkpoint_metrics(
    metadata: CheckpointMetadata,
    *,
    batch_id: int | None,
    sync_seconds: float,
    upload_seconds: float,
    changelog_bytes: int = 0,
    previous: CheckpointMetadata | None = None,
    entries: dict[tuple[str, int], int] | None = None,
) -> CheckpointMetrics:
    """The metrics of the completed checkpoint ``metadata``: full bytes are its full
    keyed, raw keyed and operator-state files; incremental bytes the files of its
    incremental snapshots that ``previous`` (the checkpoint before, if known) does not
    reference, i.e. the ones uploaded for it (not the small ones inline in
    ``_metadata``); duration from trigger to completion."""
    reused = {f.path for f in previous.files()} if previous is not None else set()
    full = incremental = 0
    for snapshot in metadata.operators.values():
        for ack in snapshot.subtasks:
            if isinstance(ack.keyed, IncrementalKeyedStateHandle):
                keyed_files = ack.keyed.files()
                incremental += sum(f.size for f in keyed_files if f.path not in reused)
                full += sum(f.size for f in ack.files()) - sum(f.size for f in keyed_files)
            else:
                full += sum(f.size for f in ack.files())
    return CheckpointMetrics(
        checkpoint_id=metadata.checkpoint_id,
        batch_id=batch_id,
        full_bytes=full,
        incremental_bytes=incremental,
        changelog_bytes=changelog_bytes,
        sync_seconds=sync_seconds,
        upload_seconds=upload_seconds,
        duration_seconds=metadata.completed_at - metadata.triggered_at,
        subtasks=subtask_states(metadata, entries),
    )


class HistoryEntry(NamedTuple):
    """A record read back from the history, with the directory name of its run
    (``<start ms>-<run id>``, so runs sort by start)."""

    run: str
    record: MetricsRecord


class MetricsHistory:
    """The metrics history of one run of a job (see the module docstring).

    ``record`` writes a record durably and logs it; ``latest`` holds the newest record of
    each kind, like Spark's ``StreamingQuery.lastProgress``. Thread-safe.
    """

    def __init__(
        self,
        fs: CheckpointFileSystem,
        job_dir: str,
        run_id: str,
        *,
        started_at: float | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        max_segments: int = DEFAULT_MAX_SEGMENTS,
    ) -> None:
        if segment_bytes < 1 or max_segments < 1:
            raise ConfigurationError(
                f"metrics history bounds segment_bytes={segment_bytes}, "
                f"max_segments={max_segments} are invalid: give both >= 1"
            )
        self._fs = fs
        self._metrics_dir = join(job_dir, METRICS_DIR)
        started_ms = int((time.time() if started_at is None else started_at) * 1000)
        self.run = f"{started_ms:013d}-{validate_id(run_id, 'run id')}"
        self._run_dir = join(self._metrics_dir, self.run)
        self._segment_bytes = segment_bytes
        self._max_segments = max_segments
        self._lock = threading.Lock()
        self._segment = -1
        self._lines: list[str] = []
        self._size = segment_bytes  # so that the first record starts segment 0
        self.latest: dict[str, MetricsRecord] = {}
        """The newest record of each kind (``batch``, ``checkpoint``, ...)."""

    def record(self, record: MetricsRecord) -> None:
        """Log ``record``, keep it as the latest of its kind and write it to the history
        (a failed write is logged, never raised)."""
        line = json.dumps(record_to_json(record), sort_keys=True, separators=(",", ":"))
        _log.info("%s", record.describe(), extra={"metrics": record_to_json(record)})
        with self._lock:
            self.latest[kind_of(record)] = record
            try:
                if self._size >= self._segment_bytes:
                    self._start_segment()
                self._lines.append(line)
                data = ("\n".join(self._lines) + "\n").encode("utf-8")
                self._fs.write_atomic(self._segment_path(self._segment), data)
                self._size = len(data)
            except CheckpointError as exc:
                _log.warning("could not write metrics to %s: %s", self._run_dir, exc)

    def _segment_path(self, segment: int) -> str:
        return join(self._run_dir, f"{segment:08d}{SEGMENT_SUFFIX}")

    def _start_segment(self) -> None:
        """Begin the next segment, first deleting the job's oldest segments so that at most
        ``max_segments`` exist with it."""
        self._segment += 1
        self._lines = []
        self._size = 0
        segments = list_segments(self._fs, self._metrics_dir)
        excess = len(segments) + 1 - self._max_segments
        emptied: dict[str, int] = {}
        for run, path in segments[: max(excess, 0)]:
            self._fs.delete(path)
            emptied[run] = emptied.get(run, 0) + 1
        for run, deleted in emptied.items():
            if run != self.run and deleted == sum(1 for r, _ in segments if r == run):
                self._fs.delete(join(self._metrics_dir, run), recursive=True)


def list_segments(fs: CheckpointFileSystem, metrics_dir: str) -> list[tuple[str, str]]:
    """(run, segment path) of every history segment in ``metrics_dir``, oldest first."""
    found = []
    for run in fs.list_dir(metrics_dir):
        run_dir = join(metrics_dir, run)
        names = sorted(n for n in fs.list_dir(run_dir) if n.endswith(SEGMENT_SUFFIX))
        found += [(run, join(run_dir, name)) for name in names]
    return found


def read_history(fs: CheckpointFileSystem, job_dir: str) -> list[HistoryEntry]:
    """Every record in the job's metrics history, oldest run first, in the order written.

    Lines that cannot be parsed are skipped with a warning; kinds this release does not
    know are skipped. A job without a history has none: [].
    """
    entries = []
    segments = list_segments(fs, join(job_dir, METRICS_DIR))
    for (run, path), data in zip(segments, fs.read_files([p for _, p in segments]), strict=True):
        if isinstance(data, CheckpointError):
            raise data
        for number, line in enumerate(data.splitlines(), 1):
            try:
                record = record_from_json(json.loads(line))
            except MALFORMED_DOCUMENT as exc:
                _log.warning("skipping line %d of %s: %s", number, path, exc)
                continue
            if record is not None:
                entries.append(HistoryEntry(run, record))
    return entries


_R = TypeVar("_R", BatchMetrics, CheckpointMetrics, RestoreMetrics, FailureMetrics)


def records_of(entries: Iterable[HistoryEntry], cls: type[_R]) -> list[_R]:
    """The records of type ``cls`` among ``entries``, in order."""
    return [entry.record for entry in entries if isinstance(entry.record, cls)]
