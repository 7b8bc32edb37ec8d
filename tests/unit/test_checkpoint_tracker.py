"""The driver's checkpoint tracker: ``idle`` polls a pending checkpoint and never waits for
it (a job postpones a due checkpoint while the previous one uploads), ``trigger`` waits
for it (a run's final checkpoint, a savepoint request) and measures the wait."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.requests import request_savepoint, wait_for_savepoint
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
)
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.spark.checkpoint_tracker import CheckpointTracker, TrackedCheckpoint
from statebackend.spark.tasks import attempt_name
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState

M = 16
P = 2
OPERATOR = "op"


def _setup(tmp_path: Path) -> tuple[CheckpointStorage, CheckpointTracker, list[tuple[int, int]]]:
    storage = CheckpointStorage(tmp_path.as_uri(), "job")
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    completed: list[tuple[int, int]] = []

    def on_completed(pending: TrackedCheckpoint, metadata: CheckpointMetadata) -> None:
        assert metadata.checkpoint_id == pending.checkpoint_id
        completed.append((pending.checkpoint_id, pending.batch_id))

    return storage, CheckpointTracker(storage, coordinator, OPERATOR, 60.0, on_completed), completed


def _acknowledge(
    storage: CheckpointStorage,
    tracker: CheckpointTracker,
    checkpoint_id: int,
    subtask: int,
    attempt: str | None = None,
    count_value: int | None = None,
) -> SubtaskAck:
    """Subtask ``subtask`` (task attempt ``attempt``) snapshots a heap backend holding one
    key whose count is ``count_value`` (default: subtask + 1) and acknowledges."""
    backend = HeapKeyedStateBackend(
        max_parallelism=M,
        key_group_range=compute_key_group_range_for_operator_index(M, P, subtask),
    )
    count = backend.get_state(ValueStateDescriptor("count", IntSerializer()))
    assert isinstance(count, ValueState)
    serialize = StrSerializer().serialize
    key = next(
        k
        for k in map(str, range(1000))
        if assign_to_key_group(serialize(k), M) in backend.key_group_range
    )
    backend.set_current_key(key)
    count.update(subtask + 1 if count_value is None else count_value)
    run = tracker.coordinator.run_id
    target = storage.snapshot_target(checkpoint_id, OPERATOR, subtask, run, attempt)
    handle = backend.snapshot(checkpoint_id, target).result()
    ack = SubtaskAck(OPERATOR, subtask, P, handle, None, run, attempt)
    assert storage.write_ack(checkpoint_id, ack)
    return ack


@pytest.mark.timeout(60)  # an idle() that waited would hang here, for the missing ack
def test_idle_polls_a_pending_checkpoint_and_never_waits(tmp_path: Path) -> None:
    storage, tracker, completed = _setup(tmp_path)
    assert tracker.idle()
    checkpoint_id = tracker.trigger({OPERATOR: P}, 7, None, {})
    _acknowledge(storage, tracker, checkpoint_id, 0)
    assert not tracker.idle()  # subtask 1 still uploads: not complete, and not waited for
    assert tracker.pending is not None and completed == []
    _acknowledge(storage, tracker, checkpoint_id, 1)
    assert tracker.idle()
    assert completed == [(checkpoint_id, 7)]
    assert tracker.waits == []


def test_trigger_waits_for_the_pending_checkpoint(tmp_path: Path) -> None:
    storage, tracker, completed = _setup(tmp_path)
    first = tracker.trigger({OPERATOR: P}, 3, None, {})
    _acknowledge(storage, tracker, first, 0)
    late = threading.Timer(0.2, _acknowledge, (storage, tracker, first, 1))
    started = time.perf_counter()
    late.start()
    try:
        second = tracker.trigger({OPERATOR: P}, 4, None, {})
    finally:
        late.join()
    assert time.perf_counter() - started >= 0.2
    assert completed == [(first, 3)]
    assert second > first and tracker.pending is not None
    assert tracker.pending.checkpoint_id == second
    assert len(tracker.waits) == 1 and tracker.waits[0] >= 0.2


def test_a_savepoint_taken_by_a_driver_that_died_before_answering_is_the_answer(
    tmp_path: Path,
) -> None:
    """A driver took the requested savepoint and died before writing the answer: the
    next driver answers the request with that savepoint instead of taking it again
    (which failed on the full directory). A savepoint older than the request in the
    requested directory is no answer: the request stays pending."""
    storage, tracker, _ = _setup(tmp_path)
    job_dir = storage.layout.job_dir
    request_id = request_savepoint(storage.fs, job_dir)
    request = tracker.savepoint_request()
    assert request is not None and request.request_id == request_id
    checkpoint_id = tracker.trigger({OPERATOR: P}, 0, request, {})
    for subtask in range(P):
        _acknowledge(storage, tracker, checkpoint_id, subtask)
    tracker.wait()
    taken = wait_for_savepoint(storage.fs, job_dir, request_id, timeout=0)
    storage.fs.delete(f"{job_dir}/requests/savepoint-{request_id}.done.json")  # never answered

    restarted = _setup(tmp_path)[1]
    assert restarted.savepoint_request() is None
    assert wait_for_savepoint(storage.fs, job_dir, request_id, timeout=0) == taken

    later = request_savepoint(storage.fs, job_dir, target_dir=taken)
    pending = restarted.savepoint_request()
    assert pending is not None and pending.request_id == later


def test_a_request_its_pending_savepoint_answered_is_not_served_again(tmp_path: Path) -> None:
    """A loop read the request before the poll that completed its savepoint, and passes
    it to the next trigger: that checkpoint is no savepoint, and the request keeps its
    answer (a second copy into the full directory failed and answered it with an error)."""
    storage, tracker, _ = _setup(tmp_path)
    job_dir = storage.layout.job_dir
    request_id = request_savepoint(storage.fs, job_dir)
    request = tracker.savepoint_request()
    assert request is not None
    first = tracker.trigger({OPERATOR: P}, 0, request, {})
    for subtask in range(P):
        _acknowledge(storage, tracker, first, subtask)
    stale = tracker.savepoint_request()  # read before the poll below, as a job's loop does
    assert tracker.idle()
    taken = wait_for_savepoint(storage.fs, job_dir, request_id, timeout=0)
    second = tracker.trigger({OPERATOR: P}, 1, stale, {})
    assert tracker.pending is not None and tracker.pending.savepoint_request is None
    for subtask in range(P):
        _acknowledge(storage, tracker, second, subtask)
    assert tracker.idle()
    assert wait_for_savepoint(storage.fs, job_dir, request_id, timeout=0) == taken
    assert tracker.savepoints == [taken]


def test_only_the_acks_of_the_attempts_the_batch_kept_complete_the_checkpoint(
    tmp_path: Path,
) -> None:
    """Two task attempts of subtask 0 cut the batch (a retry, a speculative copy), with
    different state; the batch kept attempt "b"'s result. The checkpoint completes with
    "b"'s ack, even though "a"'s was read and taken first, and "a"'s files are deleted.
    Before, the first ack read was kept: a checkpoint of state no manifest accepted."""
    storage, tracker, completed = _setup(tmp_path)
    run = tracker.coordinator.run_id
    checkpoint_id = tracker.trigger({OPERATOR: P}, 5, None, {})
    dropped = _acknowledge(storage, tracker, checkpoint_id, 0, "a", count_value=100)
    assert not tracker.idle()  # "a"'s ack is taken; subtask 1 is missing
    tracker.uploads_started([attempt_name(run, "b"), attempt_name(run, "c")])
    _acknowledge(storage, tracker, checkpoint_id, 1, "c")
    assert not tracker.idle()  # "a"'s ack was dropped: subtask 0 is missing again
    kept = _acknowledge(storage, tracker, checkpoint_id, 0, "b", count_value=200)
    assert tracker.idle()
    assert completed == [(checkpoint_id, 5)]
    metadata = storage.load(checkpoint_id)
    subtasks = metadata.operators[OPERATOR].subtasks
    assert [ack.attempt for ack in subtasks] == ["b", "c"]
    assert subtasks[0].files() == kept.files()
    names = {p.name for p in (tmp_path / "job" / f"chk-{checkpoint_id}").iterdir()}
    assert {f.path.rsplit("/", 1)[-1] for f in kept.files()} <= names
    assert not {f.path.rsplit("/", 1)[-1] for f in dropped.files()} & names
