"""A small job with real checkpoints and a real metrics history, for the report tests.

Operator ``counts`` (keyed, P=2, M=32) holds a list per key; keys in the lower half of the
key groups get eight times the elements, so subtask 0 is the hot one. Each key touched
registers an event-time timer ``TIMER_DELAY`` batches on (the watermark is the batch id),
which clears the key's list if it holds any. Operator ``source`` holds its offsets as
operator state. Every batch is recorded in the metrics history, with what its state did
as the runtime counts it (``state_counts`` over the drained changelog), and checkpointed
(full snapshots); then a failure is recorded and a real restore from the newest
checkpoint is measured and recorded, as the runner would in a second run.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.metrics import (
    BatchMetrics,
    CheckpointMetrics,
    FailureMetrics,
    MetricsHistory,
    RestoreMetrics,
    combine_batches,
    state_counts,
    subtask_states,
)
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.state.descriptors import ListStateDescriptor
from tests.conftest import Storage

JOB = "report-job"
OPERATOR = "counts"
M = 32
P = 2
BATCHES = 4
EVENTS = ListStateDescriptor("events", IntSerializer())
TIMER_DELAY = 2
"""A key's timer is due this many batches after the batch that touched it."""
PLOTS = (
    "checkpoint-duration",
    "checkpoint-size",
    "batch-bytes",
    "batch-state",
    f"subtask-state-{OPERATOR}",
    f"key-groups-{OPERATOR}",
    f"imbalance-{OPERATOR}",
    "restore-history",
)
"""Every plot of this job's report, by ``data-plot``."""


def figures(page: str) -> dict[str, str]:
    """Each plot's figure element by its ``data-plot``."""
    found = re.findall(r'<figure class="plot" data-plot="([^"]+)"(.*?)</figure>', page, re.S)
    return dict(found)


def marks(figure: str) -> int:
    """How many marks the figure's chart drew (0 without a chart)."""
    match = re.search(r'<svg [^>]*data-marks="(\d+)"', figure)
    return 0 if match is None else int(match.group(1))


@dataclass
class ReportJob:
    """The job's storage, its job directory, and what a plain-Python model says about it."""

    storage: Storage
    checkpoints: CheckpointStorage
    job_dir: str
    elements: dict[str, int] = field(default_factory=dict)
    """Elements of list state per key holding any (the model)."""
    timers: set[tuple[str, int]] = field(default_factory=set)
    """Pending timers, (key, timestamp) (the model)."""
    state: list[dict[str, int]] = field(default_factory=list)
    """Per batch, what the model says its state did: ``BatchMetrics`` fields."""
    records: list[Any] = field(default_factory=list)
    """Every metrics record written, in order."""

    @property
    def key_groups(self) -> set[int]:
        """Key groups that hold state (elements or timers), by the model."""
        keys = set(self.elements) | {key for key, _ in self.timers}
        return {assign_to_key_group(k.encode(), M) for k in keys}

    def advance(self, batch: int, keys: list[str]) -> None:
        """Run batch ``batch`` of the model: fire the timers due at watermark ``batch``
        (each clears its key's list if it holds any), then add the keys' elements and
        register their timers; count what the state did as the runtime does (an entry
        or timer counts once, by its last change in the batch)."""
        due = {timer for timer in self.timers if timer[1] <= batch}
        self.timers -= due
        cleared = {key for key, _ in due if self.elements.pop(key, 0)}
        touched = set(keys)
        for key in keys:
            self.elements[key] = self.elements.get(key, 0) + (8 if _hot(key) else 1)
        registered = {(key, batch + TIMER_DELAY) for key in touched} - self.timers
        self.timers |= registered
        self.state.append(
            {
                "state_rows": len(self.elements),
                "state_rows_written": len(touched),
                "state_rows_removed": len(cleared - touched),
                "timers_registered": len(registered),
                "timers_removed": len(due),
                "timers_fired": len(due),
            }
        )


def _hot(key: str) -> bool:
    return assign_to_key_group(key.encode(), M) < M // 2


def build_report_job(storage: Storage) -> ReportJob:
    """Run the job (see the module docstring) on ``storage``; close its storage after use."""
    checkpoints = CheckpointStorage(storage.url, JOB, storage_options=storage.storage_options)
    job = ReportJob(storage, checkpoints, checkpoints.layout.job_dir)
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=M, retained=2)
    backends = [
        HeapKeyedStateBackend(
            max_parallelism=M,
            key_group_range=compute_key_group_range_for_operator_index(M, P, i),
        )
        for i in range(P)
    ]
    sources = [OperatorStateBackend() for _ in range(P)]
    history = MetricsHistory(checkpoints.fs, job.job_dir, coordinator.run_id)

    def record(item: Any) -> None:
        history.record(item)
        job.records.append(item)

    for backend in backends:
        backend.enable_changelog()
    for batch in range(BATCHES):
        started = time.perf_counter()
        keys = [f"user-{(batch * 7 + n) % 40}" for n in range(30)]
        fired = [0] * P
        timer_seconds = [0.0] * P
        for i, backend in enumerate(backends):

            def clear(
                key: Any, timestamp: int, backend: Any = backend, i: int = i, fired: Any = fired
            ) -> None:
                fired[i] += 1
                events = backend.get_state(EVENTS)
                if events.get():
                    events.clear()

            timers_started = time.perf_counter()
            backend.timer_service.advance_watermark(batch, clear)
            timer_seconds[i] = time.perf_counter() - timers_started
        per_subtask: list[list[str]] = [[] for _ in range(P)]
        for key in keys:
            group = assign_to_key_group(StrSerializer().serialize(key), M)
            subtask = compute_operator_index_for_key_group(M, P, group)
            per_subtask[subtask].append(key)
            backend = backends[subtask]
            backend.set_current_key(key)
            count = 8 if _hot(key) else 1
            backend.get_state(EVENTS).add_all(list(range(count)))  # type: ignore[attr-defined]
            backend.timer_service.register_event_time_timer(batch + TIMER_DELAY)
        job.advance(batch, keys)
        states = [
            state_counts(
                backend.drain_changelog(),
                backend,
                timers_registered=len(per_subtask[i]),
                timers_fired=fired[i],
                timer_seconds=timer_seconds[i],
            )
            for i, backend in enumerate(backends)
        ]
        for i, source in enumerate(sources):
            source.get_list_state("offsets", IntSerializer()).update([(batch + 1) * 30 + i])
        keyed_seconds = time.perf_counter() - started
        checkpoint_id = coordinator.trigger({"source": P, OPERATOR: P})
        cut_started = time.perf_counter()
        futures = [
            backend.snapshot(checkpoint_id, checkpoints.snapshot_target(checkpoint_id, OPERATOR, i))
            for i, backend in enumerate(backends)
        ]
        sync_seconds = time.perf_counter() - cut_started
        handles = [future.result() for future in futures]
        upload_seconds = time.perf_counter() - cut_started - sync_seconds
        for i, keyed in enumerate(handles):
            ack = SubtaskAck(OPERATOR, i, P, keyed, None, coordinator.run_id)
            checkpoints.write_ack(checkpoint_id, ack)
        for i, source in enumerate(sources):
            target = checkpoints.snapshot_target(checkpoint_id, "source", i)
            handle = target.write_operator_snapshot(checkpoint_id, source.sync_cut()).result()
            checkpoints.write_ack(
                checkpoint_id, SubtaskAck("source", i, P, None, handle, coordinator.run_id)
            )
        path = coordinator.poll(checkpoint_id)
        assert path is not None
        metadata = checkpoints.load(path)
        parts = [
            BatchMetrics(
                batch_id=batch,
                records_in=len(subtask_keys),
                records_out=len(subtask_keys),
                keys_touched=len(set(subtask_keys)),
                keyed_seconds=keyed_seconds,
                sync_cut_seconds=sync_seconds,
                **state,
            )
            for subtask_keys, state in zip(per_subtask, states, strict=True)
        ]
        record(combine_batches(batch, parts))
        record(
            CheckpointMetrics(
                checkpoint_id=checkpoint_id,
                batch_id=batch,
                full_bytes=sum(h.size for h in metadata.operators[OPERATOR].keyed_handles()),
                incremental_bytes=0,
                changelog_bytes=0,
                sync_seconds=sync_seconds,
                upload_seconds=upload_seconds,
                duration_seconds=metadata.completed_at - metadata.triggered_at,
                subtasks=subtask_states(metadata),
            )
        )
    latest = checkpoints.latest_completed()
    assert latest is not None
    record(FailureMetrics(BATCHES, "ConnectionError: executor lost", f"restore from {latest}"))
    metadata = checkpoints.load(latest)
    started, read_before = time.perf_counter(), checkpoints.fs.bytes_read
    for i in range(P):
        restored = HeapKeyedStateBackend(
            max_parallelism=M,
            key_group_range=compute_key_group_range_for_operator_index(M, P, i),
        )
        restore_keyed_state(restored, checkpoints.fs, latest, metadata, OPERATOR)
    restore = RestoreMetrics(
        latest, checkpoints.fs.bytes_read - read_before, time.perf_counter() - started, P
    )
    MetricsHistory(checkpoints.fs, job.job_dir, "second").record(restore)
    job.records.append(restore)
    return job
