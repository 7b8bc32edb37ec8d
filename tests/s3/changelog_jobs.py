"""Helpers for tests on a job's per-batch changelog: subtasks that run random batches
of ``test_checkpoint_matrix``'s operator, write their changelog records and commit batch
manifests, rebuilds from a manifest, and the plain-Python model's live state; and
``changelog_job``, a small job whose layout has every kind of manifest (see its
docstring), with the model's state after each batch."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.signing import SigningKey
from statebackend.checkpoint.storage import CheckpointStorage
from tests.conftest import Storage
from tests.s3.test_checkpoint_matrix import (
    MAX_PARALLELISM,
    OPERATOR,
    KeyModel,
    apply_random_operations,
    make_backend,
)

JOB = "job"


def open_storage(
    storage: Storage, compression: str = "none", signing_key: SigningKey | None = None
) -> CheckpointStorage:
    return CheckpointStorage(
        storage.url,
        JOB,
        storage_options=storage.storage_options,
        compression=compression,
        signing_key=signing_key,
    )


def enabled(backend: KeyedStateBackend) -> KeyedStateBackend:
    backend.enable_changelog()
    return backend


def run_batch(
    changelog: ChangelogStorage,
    backends: list[KeyedStateBackend],
    batch_id: int,
    rng: random.Random,
    models: dict[str, KeyModel],
) -> BatchManifest:
    """Process one batch on every subtask, write each subtask's record, commit."""
    apply_random_operations(rng, backends, models, 150)
    handles = [
        changelog.write_record(batch_id, OPERATOR, i, f"attempt-{batch_id}", b.drain_changelog())
        for i, b in enumerate(backends)
    ]
    return changelog.commit(
        batch_id, {OPERATOR: handles}, max_parallelism=MAX_PARALLELISM, properties={"n": batch_id}
    )


def rebuild(
    kind: str,
    changelog: ChangelogStorage,
    manifest: BatchManifest,
    parallelism: int,
    local_root: Path,
) -> list[KeyedStateBackend]:
    """Every subtask of ``parallelism`` rebuilt from ``manifest``."""
    backends = []
    for i in range(parallelism):
        backend = make_backend(kind, local_root / f"{kind}-{parallelism}-{i}", parallelism, i)
        rebuild_keyed_state(backend, changelog, manifest, OPERATOR)
        backends.append(backend)
    return backends


def live_states(models: dict[str, KeyModel]) -> dict[str, dict[str, Any]]:
    """The model's keys that have any state, with their states."""
    snapshots = {key: model.snapshot() for key, model in models.items()}
    return {k: s for k, s in snapshots.items() if any(v is not None for v in s.values())}


def checkpoint(
    changelog: ChangelogStorage,
    coordinator: CheckpointCoordinator,
    backends: list[KeyedStateBackend],
    batch_id: int,
) -> int:
    """Checkpoint the subtasks' state as of the end of batch B and complete it; its id."""
    parallelism = len(backends)
    properties = {"batch_id": batch_id}
    checkpoint_id = coordinator.trigger({OPERATOR: parallelism}, properties=properties)
    storage = changelog.storage
    for i, backend in enumerate(backends):
        handle = backend.snapshot(
            checkpoint_id, storage.snapshot_target(checkpoint_id, OPERATOR, i)
        ).result()
        ack = SubtaskAck(OPERATOR, i, parallelism, handle, None, coordinator.run_id)
        coordinator.acknowledge(checkpoint_id, ack)
    return checkpoint_id


@dataclass
class ChangelogJob:
    """A job's storage and the model's live state after each batch."""

    storage: Storage
    checkpoints: CheckpointStorage
    changelog: ChangelogStorage
    coordinator: CheckpointCoordinator
    states: dict[int, dict[str, dict[str, Any]]]
    averages: dict[int, dict[str, list[int]]]
    backends: list[KeyedStateBackend]

    @property
    def job_dir(self) -> str:
        return self.checkpoints.layout.job_dir

    def manifest(self, batch_id: int) -> str:
        return self.changelog.layout.manifest_path(batch_id)


def _averages(models: dict[str, KeyModel]) -> dict[str, list[int]]:
    """The aggregating state's stored accumulator per key: what ``read`` shows."""
    return {k: [m.average_sum, m.average_n] for k, m in models.items() if m.average_n}


@contextmanager
def changelog_job(
    storage: Storage, tmp_path: Path, signing_key: SigningKey | None = None
) -> Iterator[ChangelogJob]:
    """A job on ``storage``: batches 1-3 at P=2 with no base, a materialization of batch
    2 (chk-1) completed during batch 3, batch 4 at P=2 and batch 5 rescaled to P=3.
    Manifest 3 builds on nothing (records 1-3), manifests 4 and 5 on chk-1 (records 3-4,
    3-5); everything signed with ``signing_key`` if given."""
    checkpoints = open_storage(storage, "lz4", signing_key)
    changelog = ChangelogStorage(checkpoints)
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=MAX_PARALLELISM)
    rng = random.Random(11)
    models: dict[str, KeyModel] = {}
    states: dict[int, dict[str, dict[str, Any]]] = {}
    averages: dict[int, dict[str, list[int]]] = {}
    backends = [enabled(make_backend("heap", tmp_path, 2, i)) for i in range(2)]

    def batch(batch_id: int) -> None:
        run_batch(changelog, backends, batch_id, rng, models)
        states[batch_id] = copy.deepcopy(live_states(models))
        averages[batch_id] = _averages(models)

    for batch_id in (1, 2):
        batch(batch_id)
    # The materialization of batch 2 completes after batch 3 is committed.
    snapshot_models = copy.deepcopy(models)
    checkpoint_id = coordinator.trigger({OPERATOR: 2}, properties={"batch_id": 2})
    futures = [
        b.snapshot(checkpoint_id, checkpoints.snapshot_target(checkpoint_id, OPERATOR, i))
        for i, b in enumerate(backends)
    ]
    batch(3)
    for i, future in enumerate(futures):
        ack = SubtaskAck(OPERATOR, i, 2, future.result(), None, coordinator.run_id)
        coordinator.acknowledge(checkpoint_id, ack)
    changelog.materialized(checkpoint_id, 2)
    assert live_states(snapshot_models) == states[2]
    batch(4)
    latest = changelog.latest_manifest()
    assert latest is not None
    for backend in backends:
        backend.dispose()
    backends[:] = [enabled(b) for b in rebuild("heap", changelog, latest, 3, tmp_path)]
    batch(5)
    made = ChangelogJob(storage, checkpoints, changelog, coordinator, states, averages, backends)
    try:
        yield made
    finally:
        for backend in made.backends:
            backend.dispose()
        checkpoints.close()


def expected_values(job: ChangelogJob, batch_id: int, state: str) -> dict[str, Any]:
    """What ``read`` must print of ``state`` at the end of batch B, by key."""
    if state == "average":
        return job.averages[batch_id]
    return {k: s[state] for k, s in job.states[batch_id].items() if s[state] is not None}
