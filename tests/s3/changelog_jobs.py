"""Helpers for tests on a job's per-batch changelog: subtasks that run random batches
of ``test_checkpoint_matrix``'s operator, write their changelog records and commit batch
manifests, rebuilds from a manifest, and the plain-Python model's live state."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import SubtaskAck
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


def open_storage(storage: Storage, compression: str = "none") -> CheckpointStorage:
    return CheckpointStorage(
        storage.url, JOB, storage_options=storage.storage_options, compression=compression
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
