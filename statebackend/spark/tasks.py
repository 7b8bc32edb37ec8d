"""The code a micro-batch runs on the executors: source subtasks and keyed subtasks.

The driver builds a ``SourcePlan`` and a ``KeyedPlan`` per batch; Spark ships them (and
the user's function) to the tasks. A source subtask reads its partitions and emits
``(keyed subtask, (RECORD, key, record))`` plus one ``(subtask, (MARKER, ...))`` with its
new offsets. A keyed subtask groups its records by key, runs the user's function over its
local RocksDB (reused, or rebuilt from the newest batch manifest), writes its output rows
and its batch's state changes (a changelog record, named by run and task attempt, with
the function's operator state if it keeps any: ``function_state``), takes
the checkpoint's synchronous cut if the batch is a checkpoint, and returns a small
``KeyedResult`` with the record's handle. The checkpoint's upload runs
on the worker's transfer threads and writes the subtask's ack when done, and the local
DB is closed on the worker's closer thread; the task waits for neither (except on a run's
final checkpoint, or without Python worker reuse).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.operator import OperatorStateCut
from statebackend.backends.rocksdb import set_memory_limit
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.metrics import BatchMetrics, state_counts
from statebackend.checkpoint.signing import SigningKey
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointCancelledError, StateBackendError
from statebackend.keygroups import assign_to_key_group, compute_operator_index_for_key_group
from statebackend.serializers import Serializer
from statebackend.spark.api import KeyedContext, KeyedFunction
from statebackend.spark.function_state import (
    keep_function,
    restore_function_state,
    start_function,
)
from statebackend.spark.heartbeat import UploadHeartbeat, heartbeat_path
from statebackend.spark.local_state import LocalVersion, local_keyed_state
from statebackend.spark.process_cache import ProcessCache
from statebackend.spark.source import KeyOf, LogSource, Offsets

RECORD = 0
MARKER = 1
_OUTPUT_BATCH = re.compile(r"batch-([0-9]+)")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorageSpec:
    """How to open the job's checkpoint storage on an executor."""

    checkpoint_dir: str
    job_id: str
    storage_options: dict[str, Any]
    transfer_threads: int
    compression: str
    incremental: bool = False
    signing_key: SigningKey | None = None
    rocksdb_memory: int | None = None
    """The memory all RocksDB instances of an executor process share (None: unbounded)."""

    def _cache_key(self) -> str:
        return json.dumps(
            [
                self.checkpoint_dir,
                self.job_id,
                self.storage_options,
                self.transfer_threads,
                self.compression,
                self.incremental,
                None if self.signing_key is None else self.signing_key.sign(b"cache key"),
            ],
            sort_keys=True,
            default=str,
        )

    def open(self) -> CheckpointStorage:
        """This process's storage for the spec (kept across tasks, for the
        ``CACHED_STORAGES`` jobs used last, so that its transfer threads outlive the task
        that started an upload). Bounds the process's RocksDB memory by ``rocksdb_memory``
        first, so that the databases it opens share it."""
        set_memory_limit(self.rocksdb_memory)
        key = self._cache_key()
        storage = _STORAGES.get(key)
        if storage is None:
            storage = CheckpointStorage(
                self.checkpoint_dir,
                self.job_id,
                storage_options=self.storage_options,
                transfer_threads=self.transfer_threads,
                compression=self.compression,
                incremental=self.incremental,
                signing_key=self.signing_key,
            )
            _STORAGES.put(key, storage)
        return storage


CACHED_STORAGES = 8
"""How many jobs' storages a process keeps open: the least recently used beyond it
stops its transfer threads once their uploads are done (``CheckpointStorage.close``
without waiting), so that a worker serving many jobs does not keep a pool for each."""

_STORAGES: ProcessCache[str, CheckpointStorage] = ProcessCache(
    CACHED_STORAGES, lambda storage: storage.close(wait=False)
)


@dataclass(frozen=True)
class SourcePlan:
    """What source subtasks read in one batch."""

    source: LogSource
    offsets: list[Offsets]
    batch_size: int
    key_of: KeyOf
    key_serializer: Serializer[Any]
    parallelism: int
    max_parallelism: int
    ends: dict[int, int] | None = None
    """Per partition, the byte offset the batch ends at, fixed by the driver for a
    single-stage batch (so that every keyed subtask reads the same lines); else None."""


@dataclass(frozen=True)
class KeyedPlan:
    """What keyed subtasks do in one batch."""

    operator_id: str
    backend: str
    function: KeyedFunction
    key_serializer: Serializer[Any]
    batch_id: int
    version: LocalVersion
    storage: StorageSpec
    local_dir: str
    output_dir: str | None
    checkpoint_id: int | None
    wait_for_upload: bool
    run_id: str
    """The coordinator run that triggered ``checkpoint_id``: named in its files and acks."""


@dataclass
class KeyedInput:
    """A keyed subtask's input of one batch: its records grouped by key, and the new
    offsets and skipped lines of the source subtasks whose reading it carries."""

    groups: dict[Any, list[Any]] = field(default_factory=dict)
    records: int = 0
    source_offsets: dict[int, Offsets] = field(default_factory=dict)
    skipped: int = 0


@dataclass
class KeyedResult:
    """What a keyed subtask reports to the driver."""

    subtask: int
    records: int = 0
    outputs: int = 0
    restored_bytes: int = 0
    reused: bool = False
    rebuilt: bool = False
    sync_seconds: float = 0.0
    source_offsets: dict[int, Offsets] = field(default_factory=dict)
    skipped: int = 0
    changelog: dict[str, Any] = field(default_factory=dict)
    """The handle (JSON) of the subtask's changelog record of the batch."""
    keys: int = 0
    """Distinct keys the batch's records touched."""
    keyed_seconds: float = 0.0
    """Seconds in the user's function (and writing its output)."""
    restore_seconds: float = 0.0
    """Seconds opening the local copy (restoring or rebuilding it when not reused) and
    restoring the function's operator state."""
    changelog_seconds: float = 0.0
    """Seconds draining, encoding and writing the batch's changelog record."""
    entries: int | None = None
    """At a checkpoint: the entries the subtask's state held at the cut (an estimate)."""
    state: dict[str, Any] = field(default_factory=dict)
    """The ``BatchMetrics`` fields of what the subtask's state did in the batch
    (``state_counts``)."""

    def metrics(self, batch_id: int) -> BatchMetrics:
        """This subtask's part of batch ``batch_id``'s metrics."""
        return BatchMetrics(
            batch_id=batch_id,
            records_in=self.records,
            records_out=self.outputs,
            keys_touched=self.keys,
            keyed_seconds=self.keyed_seconds,
            sync_cut_seconds=self.sync_seconds,
            changelog_bytes=int(self.changelog.get("size", 0)),
            changelog_seconds=self.changelog_seconds,
            **self.state,
        )


def single_stage_input(plan: SourcePlan, subtask: int) -> KeyedInput:
    """The input of keyed subtask ``subtask`` in a single-stage batch (no shuffle): the
    records of its key groups, read from every partition up to ``plan.ends`` and grouped
    by key as they are read, and source subtask ``subtask``'s new offsets and skipped
    lines (what its marker carries in the two-stage path)."""
    keyed = KeyedInput()
    groups = keyed.groups
    targets = _Targets(plan)

    def wanted(key: Any) -> bool:
        return targets.of(key) == subtask

    ends = plan.ends
    if ends is None:
        raise StateBackendError(
            "a single-stage batch was planned without its byte ends per partition "
            "(SourcePlan.ends): the driver plans one only with them"
        )
    for source_subtask, share in enumerate(plan.offsets):
        new_offsets: Offsets = []
        for partition, offset in share:
            batch = plan.source.read_grouped(
                partition, offset, plan.batch_size, plan.key_of, ends[partition], wanted
            )
            if groups:
                for key, records in batch.groups.items():
                    group = groups.get(key)
                    if group is None:
                        groups[key] = records
                    else:
                        group.extend(records)
            else:
                groups = keyed.groups = batch.groups
            new_offsets.append((partition, batch.offset))
            if source_subtask == subtask:
                keyed.skipped += batch.skipped
        if source_subtask == subtask:
            keyed.source_offsets[subtask] = new_offsets
    keyed.records = sum(map(len, groups.values()))
    return keyed


class _Targets:
    """Key -> keyed subtask, computed once per key and batch."""

    def __init__(self, plan: SourcePlan) -> None:
        self._serialize = plan.key_serializer.serialize
        self._max_parallelism, self._parallelism = plan.max_parallelism, plan.parallelism
        self._known: dict[Any, int] = {}

    def routable(self, key_of: KeyOf) -> KeyOf:
        """``key_of`` that raises, as for a record without a key, when the key cannot be
        routed (unhashable, or the key serializer cannot encode it), so that the source
        reports or skips the record's line as malformed."""

        def key(record: Any) -> Any:
            found = key_of(record)
            self.of(found)
            return found

        return key

    def of(self, key: Any) -> int:
        """The keyed subtask of ``key``'s key group."""
        target = self._known.get(key)
        if target is None:
            key_group = assign_to_key_group(self._serialize(key), self._max_parallelism)
            target = self._known[key] = compute_operator_index_for_key_group(
                self._max_parallelism, self._parallelism, key_group
            )
        return target


def source_task(plan: SourcePlan, subtask: int) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """Read source subtask ``subtask``'s partitions; emit ``(keyed subtask, (RECORD, key,
    record))`` per record and end with ``(subtask, (MARKER, subtask, new offsets,
    skipped lines))``."""
    new_offsets: Offsets = []
    skipped = 0
    targets = _Targets(plan)
    for partition, offset in plan.offsets[subtask]:
        try:
            batch = plan.source.read(partition, offset, plan.batch_size, plan.key_of)
            for key in {key for key, _ in batch.records}:
                targets.of(key)
        except Exception:  # a malformed line or a key it cannot route: read again with
            # every key routed, so that a bad key's line is malformed and the first one counts
            key_of = targets.routable(plan.key_of)
            batch = plan.source.read(partition, offset, plan.batch_size, key_of)
        for key, record in batch.records:
            yield targets.of(key), (RECORD, key, record)
        new_offsets.append((partition, batch.offset))
        skipped += batch.skipped
    yield subtask, (MARKER, subtask, new_offsets, skipped)


def group_input(items: Iterable[tuple[int, tuple[Any, ...]]]) -> KeyedInput:
    """A keyed subtask's shuffled input (records and source markers) grouped by key."""
    keyed = KeyedInput()
    groups = keyed.groups
    for _, item in items:
        if item[0] == RECORD:
            groups.setdefault(item[1], []).append(item[2])
            keyed.records += 1
        else:
            keyed.source_offsets[item[1]] = item[2]
            keyed.skipped += item[3]
    return keyed


def output_directory(output_dir: str, batch_id: int) -> Path:
    """The directory of batch B's output rows, one ``part-<subtask>.jsonl`` per subtask."""
    return Path(output_dir) / f"batch-{batch_id:06d}"


def output_batches(output_dir: str) -> dict[int, Path]:
    """The batch directories (``output_directory``'s) under ``output_dir``, by batch id."""
    found = {}
    for path in Path(output_dir).glob("batch-*"):
        match = _OUTPUT_BATCH.fullmatch(path.name)
        if match:
            found[int(match.group(1))] = path
    return found


def _write_output(plan: KeyedPlan, subtask: int, rows: Iterable[Any]) -> int:
    if plan.output_dir is None:
        return sum(1 for _ in rows)
    directory = output_directory(plan.output_dir, plan.batch_id)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"part-{subtask}.jsonl"
    temporary = directory / f".part-{subtask}.jsonl.{os.getpid()}.tmp"
    count = 0
    with temporary.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, default=str))
            out.write("\n")
            count += 1
    temporary.replace(final)
    return count


def _acknowledge(storage: CheckpointStorage, checkpoint_id: int, ack: SubtaskAck) -> None:
    try:
        if not storage.write_ack(checkpoint_id, ack):
            _log.info("checkpoint %s is no longer pending: not acknowledged", checkpoint_id)
    except Exception:  # the checkpoint then times out and is aborted
        _log.exception("could not acknowledge checkpoint %s", checkpoint_id)


def _task_attempt() -> str | None:
    """The Spark task attempt running this code (unique within the application)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    return None if context is None else str(context.taskAttemptId())


def attempt_name(run_id: str | None, task_attempt: str | None) -> str:
    """The attempt named in a keyed subtask's changelog record (and output, and local
    copy's marker): driver run ``run_id`` and Spark task attempt ``task_attempt``, unique
    across runs too (a restarted application counts task attempts from 0 again). A
    materialization's ack carries both (``run``, ``attempt``): the same name."""
    return f"{run_id}-{task_attempt}"


def record_attempt(run_id: str) -> str:
    """``attempt_name`` of run ``run_id`` and the Spark task attempt running this code."""
    return attempt_name(run_id, _task_attempt())


def snapshot_subtask(
    storage: CheckpointStorage,
    backend: KeyedStateBackend,
    checkpoint_id: int,
    operator_id: str,
    subtask: int,
    parallelism: int,
    run_id: str,
    wait_for_upload: bool,
    operator_state: OperatorStateCut | None = None,
) -> float:
    """Take checkpoint N's synchronous cut of keyed subtask ``subtask`` (of
    ``parallelism``) of ``operator_id`` and start its upload, with the function's
    ``operator_state`` cut if any; return the cut's seconds.

    The upload runs on the process's transfer threads, beating the upload heartbeat, and
    writes the subtask's ack (naming run ``run_id`` and this task attempt) when done;
    with ``wait_for_upload`` it is done, and acknowledged, before this returns. A failed
    or cancelled upload acknowledges nothing: the driver aborts the checkpoint.
    """
    attempt = _task_attempt()
    started = time.perf_counter()
    target = storage.snapshot_target(checkpoint_id, operator_id, subtask, run_id, attempt)
    operator_future = (
        None
        if operator_state is None
        else target.write_operator_snapshot(checkpoint_id, operator_state)
    )
    future = backend.snapshot(checkpoint_id, target)
    sync_seconds = time.perf_counter() - started

    def ack(handle: Any) -> SubtaskAck:
        # Submitted before the keyed upload, so it has started: waiting cannot starve it.
        operator_handle = None if operator_future is None else operator_future.result()
        return SubtaskAck(
            operator_id, subtask, parallelism, handle, operator_handle, run_id, attempt
        )

    if wait_for_upload:
        try:
            subtask_ack = ack(future.result())
        except CheckpointCancelledError:  # aborted meanwhile: the driver knows
            _log.info("the upload of checkpoint %s was cancelled", checkpoint_id)
            return sync_seconds
        if not storage.write_ack(checkpoint_id, subtask_ack):
            _log.info("checkpoint %s is no longer pending: not acknowledged", checkpoint_id)
        return sync_seconds
    path = heartbeat_path(storage, checkpoint_id, operator_id, subtask)
    heartbeat = UploadHeartbeat(storage, checkpoint_id, path)

    def uploaded(done: Any) -> None:
        try:
            subtask_ack = ack(done.result())
        except CheckpointCancelledError:  # aborted meanwhile: the driver knows
            _log.info("the upload of checkpoint %s was cancelled", checkpoint_id)
            heartbeat.stop()
            return
        except Exception:
            _log.exception("the upload of checkpoint %s failed", checkpoint_id)
            heartbeat.stop()
            return
        with heartbeat.stopping():
            _acknowledge(storage, checkpoint_id, subtask_ack)

    future.add_done_callback(uploaded)
    heartbeat.start()
    return sync_seconds


def keyed_task(
    plan: KeyedPlan, subtask: int, items: Iterable[tuple[int, tuple[Any, ...]]]
) -> Iterator[KeyedResult]:
    """Run keyed subtask ``subtask`` of one batch over its shuffled input ``items``
    (records and source markers, see ``source_task``)."""
    return keyed_subtask(plan, subtask, group_input(items))


def keyed_subtask(plan: KeyedPlan, subtask: int, keyed: KeyedInput) -> Iterator[KeyedResult]:
    """Run keyed subtask ``subtask`` of one batch over its local state and its input
    ``keyed``; yield its result."""
    groups = keyed.groups
    result = KeyedResult(subtask, records=keyed.records, skipped=keyed.skipped)
    result.source_offsets = keyed.source_offsets
    result.keys = len(groups)
    root = Path(plan.local_dir) / plan.storage.job_id / plan.operator_id
    opening = time.perf_counter()
    with local_keyed_state(
        root,
        subtask,
        plan.version,
        plan.storage.open(),
        plan.operator_id,
        plan.key_serializer,
        plan.backend,
    ) as local:
        backend = local.backend
        assert backend is not None
        result.restored_bytes, result.reused = local.restored_bytes, local.reused
        result.rebuilt = local.rebuilt
        backend.enable_changelog()
        storage = plan.storage.open()
        run = start_function(
            plan.function,
            root,
            subtask,
            plan.version,
            local.reused,
            lambda: restore_function_state(storage, plan.version, plan.operator_id, subtask),
        )
        result.restore_seconds = time.perf_counter() - opening
        function = run.function
        ctx = KeyedContext(backend, subtask, plan.batch_id)
        function.open(ctx)

        def rows() -> Iterator[Any]:
            with backend.batch(groups):  # reads ahead by multi-get, one WriteBatch
                for key, values in groups.items():
                    backend.set_current_key(key)
                    yield from function.process(key, values, ctx)

        started = time.perf_counter()
        result.outputs = _write_output(plan, subtask, rows())
        result.keyed_seconds = time.perf_counter() - started
        operator_state = run.snapshot(plan.batch_id)
        attempt = record_attempt(plan.run_id)
        started = time.perf_counter()
        changes = backend.drain_changelog()
        handle = ChangelogStorage(storage).write_record(
            plan.batch_id, plan.operator_id, subtask, attempt, changes, operator_state
        )
        result.changelog_seconds = time.perf_counter() - started
        result.state = state_counts(changes, backend)  # its functions fire no timers
        result.changelog = handle.to_json()
        if plan.checkpoint_id is not None:
            result.sync_seconds = snapshot_subtask(
                plan.storage.open(),
                backend,
                plan.checkpoint_id,
                plan.operator_id,
                subtask,
                plan.version.parallelism,
                plan.run_id,
                plan.wait_for_upload,
                operator_state,
            )
            result.entries = backend.estimated_entries()
        # A worker that outlives the task closes the DB after it (the batch is durable).
        local.commit(plan.batch_id, attempt, in_background=not plan.wait_for_upload)
        keep_function(run, root, subtask, plan.version, plan.batch_id, attempt)
    yield result
