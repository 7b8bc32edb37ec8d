"""The driver's storage calls per committed batch are bounded, whatever the checkpoint
interval: ``ChangelogStorage`` keeps the manifest list it commits to and ``cleanup``
looks only at the batches that changed. Counted on the real storage (file:// and the
moto S3 server) over a job of 22 batches materialized every 10, with a rejected attempt
per batch; the changelog then holds exactly the records the retained manifests
reference, and the newest manifest rebuilds the state a plain-Python model gives."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.layout import batch_ids
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.snapshot.handles import normalize_path, resolve_path
from tests.conftest import Storage
from tests.s3.changelog_jobs import enabled, live_states, open_storage, rebuild
from tests.s3.test_checkpoint_matrix import (
    MAX_PARALLELISM,
    OPERATOR,
    KeyModel,
    apply_random_operations,
    make_backend,
    read_keyed,
)

BATCHES = 22
INTERVAL = 10
RETAINED = 2
LOOKUPS_PER_BATCH = 4
"""Check and write the manifest, list the records of the batch and of the one before."""
DELETES_PER_BATCH = 3
"""On average: the manifest that falls out of retention, the rejected attempt, and the
records directory of a batch no longer referenced."""


def test_a_batch_costs_a_bounded_number_of_storage_calls(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    checkpoints = open_storage(checkpoint_url)
    changelog = ChangelogStorage(checkpoints, retained=RETAINED)
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=MAX_PARALLELISM)
    backend = enabled(make_backend("heap", tmp_path / "db", 1, 0))
    calls: Counter[str] = Counter()
    fs = changelog.fs
    for name in ("exists", "list_dir", "read_file", "write_atomic", "delete"):
        real = getattr(fs, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(fs, name, counted)
    rng = random.Random(5)
    models: dict[str, KeyModel] = {}
    per_batch = []
    try:
        for batch_id in range(BATCHES):
            apply_random_operations(rng, [backend], models, 40)
            changes = backend.drain_changelog()
            accepted = changelog.write_record(batch_id, OPERATOR, 0, "accepted", changes)
            # A retried attempt's record of the same batch, which the driver rejects.
            changelog.write_record(batch_id, OPERATOR, 0, "rejected", changes)
            calls.clear()
            changelog.commit(batch_id, {OPERATOR: [accepted]}, max_parallelism=MAX_PARALLELISM)
            per_batch.append(calls.copy())
            if batch_id % INTERVAL == INTERVAL - 1:
                checkpoint_id = coordinator.trigger({OPERATOR: 1})
                target = checkpoints.snapshot_target(checkpoint_id, OPERATOR, 0)
                handle = backend.snapshot(checkpoint_id, target).result()
                ack = SubtaskAck(OPERATOR, 0, 1, handle, None, coordinator.run_id)
                coordinator.acknowledge(checkpoint_id, ack)
                changelog.materialized(checkpoint_id, batch_id)
    finally:
        backend.dispose()

    # The first commit lists the manifests and the changelog; every later one is bounded.
    lookups = [sum(c.values()) - c["delete"] for c in per_batch[1:]]
    assert max(lookups) <= LOOKUPS_PER_BATCH, lookups
    assert sum(c["delete"] for c in per_batch) <= DELETES_PER_BATCH * BATCHES
    ids = changelog.manifest_ids()
    assert ids == list(range(BATCHES - RETAINED, BATCHES))
    kept = [changelog.load_manifest(batch_id) for batch_id in ids]
    referenced = {
        normalize_path(resolve_path(changelog.layout.manifests_dir, f.path))
        for m in kept
        for f in m.files()
    }
    on_storage = {
        normalize_path(f"{changelog.layout.batch_changelog_dir(batch_id)}/{name}")
        for batch_id in batch_ids(fs.list_dir(changelog.layout.changelog_dir))
        for name in fs.list_dir(changelog.layout.batch_changelog_dir(batch_id))
    }
    assert on_storage == referenced
    (rebuilt,) = rebuild("heap", changelog, kept[-1], 1, tmp_path / "rebuilt")
    try:
        assert read_keyed(rebuilt) == live_states(models)
    finally:
        rebuilt.dispose()
    checkpoints.close()
