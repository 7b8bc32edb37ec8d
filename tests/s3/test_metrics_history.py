"""The metrics history, written and read back with the real class on file:// and s3://,
and the records built from a batch's subtasks and from a completed checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import CheckpointFileSystem, open_filesystem
from statebackend.checkpoint.layout import METRICS_DIR, join
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.metrics import (
    BatchMetrics,
    CheckpointMetrics,
    FailureMetrics,
    HistoryEntry,
    MetricsHistory,
    MetricsRecord,
    RestoreMetrics,
    SubtaskState,
    checkpoint_metrics,
    combine_batches,
    list_segments,
    read_history,
    record_to_json,
    records_of,
)
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import IntSerializer
from statebackend.state.descriptors import ValueStateDescriptor
from tests.conftest import Storage


def _open(storage: Storage) -> tuple[CheckpointFileSystem, str]:
    fs = open_filesystem(storage.url, storage.storage_options)
    return fs, join(storage.url, "job")


def _batch(n: int) -> BatchMetrics:
    return BatchMetrics(n, 100 + n, 90 + n, 10 + n, 0.01, 0.02, 0.03, 0.004, 0.0, 512 * n)


def test_history_reads_back_every_kind_of_record(
    checkpoint_url: Storage, caplog: pytest.LogCaptureFixture
) -> None:
    fs, job_dir = _open(checkpoint_url)
    first = MetricsHistory(fs, job_dir, "run1", started_at=1_000.0)
    written: list[MetricsRecord] = [
        _batch(0),
        CheckpointMetrics(
            checkpoint_id=1,
            batch_id=0,
            full_bytes=4096,
            incremental_bytes=0,
            changelog_bytes=128,
            sync_seconds=0.002,
            upload_seconds=0.5,
            duration_seconds=0.6,
            subtasks=(SubtaskState("op", 0, 3000, 40), SubtaskState("op", 1, 1096, None)),
        ),
        FailureMetrics(1, "ConnectionError: executor lost", "restore from chk-1"),
    ]
    with caplog.at_level(logging.INFO, logger="statebackend.checkpoint.metrics"):
        for record in written:
            first.record(record)
    second = MetricsHistory(fs, job_dir, "run2", started_at=2_000.0)
    restore = RestoreMetrics("s3://b/job/chk-1", 4096, 0.25, 2)
    second.record(restore)

    assert read_history(fs, job_dir) == [HistoryEntry(first.run, r) for r in written] + [
        HistoryEntry(second.run, restore)
    ]
    assert first.latest == {"batch": written[0], "checkpoint": written[1], "failure": written[2]}
    assert records_of(read_history(fs, job_dir), RestoreMetrics) == [restore]
    logged = [r for r in caplog.records if r.name == "statebackend.checkpoint.metrics"]
    assert [r.levelno for r in logged] == [logging.INFO] * 3
    assert [r.__dict__["metrics"] for r in logged] == [record_to_json(r) for r in written]
    assert "batch 0: 100 records in, 90 out" in logged[0].getMessage()


def test_history_stays_within_its_bound_and_keeps_the_newest(checkpoint_url: Storage) -> None:
    fs, job_dir = _open(checkpoint_url)
    old_run = MetricsHistory(fs, job_dir, "old", started_at=1_000.0, segment_bytes=600)
    for n in range(5):
        old_run.record(_batch(n))
    segment_bytes, max_segments = 400, 3
    history = MetricsHistory(
        fs,
        job_dir,
        "new",
        started_at=2_000.0,
        segment_bytes=segment_bytes,
        max_segments=max_segments,
    )
    records = [_batch(n) for n in range(100, 116)]
    for record in records:
        history.record(record)

    segments = list_segments(fs, join(job_dir, METRICS_DIR))
    assert len(segments) <= max_segments
    longest = max(len(repr(record_to_json(r))) for r in records)
    assert sum(fs.size(path) for _, path in segments) <= max_segments * (segment_bytes + longest)
    assert fs.list_dir(join(job_dir, METRICS_DIR)) == [history.run]  # the old run is gone
    kept = [entry.record for entry in read_history(fs, job_dir)]
    assert 0 < len(kept) < len(records)
    assert kept == records[-len(kept) :]  # the newest, in order, none lost in between
    assert history.latest["batch"] == records[-1]


def test_bad_lines_and_unknown_kinds_are_skipped(checkpoint_url: Storage) -> None:
    fs, job_dir = _open(checkpoint_url)
    history = MetricsHistory(fs, job_dir, "run", started_at=1_000.0)
    batch = _batch(1)
    history.record(batch)
    path = list_segments(fs, join(job_dir, METRICS_DIR))[0][1]
    lines = fs.read_file(path) + b'{"kind": "gauge", "value": 3}\nnot json\n{"kind": "batch"}\n'
    # Neither a byte that is no UTF-8 nor nesting too deep for json.loads stops the reading
    # of the other lines (they raised a raw UnicodeDecodeError or RecursionError).
    lines += b'{"kind": "batch", "x": "\xff"}\n' + b"[" * 100_000 + b"\n"
    fs.write_atomic(path, lines)
    assert [e.record for e in read_history(fs, job_dir)] == [batch]


def test_a_history_that_cannot_be_written_does_not_fail(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    fs = open_filesystem(tmp_path.as_uri())
    history = MetricsHistory(fs, f"{blocker.as_uri()}/job", "run")
    with caplog.at_level(logging.WARNING, logger="statebackend.checkpoint.metrics"):
        history.record(batch := _batch(7))
    assert history.latest["batch"] == batch
    assert any("could not write metrics" in r.getMessage() for r in caplog.records)


def test_a_batch_combines_its_subtasks() -> None:
    parts = [_batch(1), BatchMetrics(1, 7, 3, 2, 0.5, 0.0, 0.01, 0.2, 0.0, 40, 0.07)]
    combined = combine_batches(1, parts, waiting_seconds=0.3, manifest_seconds=0.02)
    assert (combined.records_in, combined.records_out, combined.keys_touched) == (108, 94, 13)
    assert (combined.source_seconds, combined.keyed_seconds) == (0.5, 0.03)
    assert (combined.sync_cut_seconds, combined.waiting_seconds) == (0.2, 0.3)
    assert combined.changelog_bytes == 512 + 40
    assert (combined.changelog_seconds, combined.manifest_seconds) == (0.07, 0.02)


def test_checkpoint_metrics_count_what_each_checkpoint_uploaded(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """Incremental bytes are the files a checkpoint uploaded, measured as the bytes the
    file system wrote while the snapshots ran."""
    storage = CheckpointStorage(
        checkpoint_url.url,
        "job",
        storage_options=checkpoint_url.storage_options,
        incremental=True,
    )
    m, p = 16, 2
    coordinator = CheckpointCoordinator(storage, max_parallelism=m)
    backends = [
        RocksDBKeyedStateBackend(
            tmp_path / f"db-{i}",
            max_parallelism=m,
            key_group_range=compute_key_group_range_for_operator_index(m, p, i),
        )
        for i in range(p)
    ]
    count = ValueStateDescriptor("count", IntSerializer())
    previous = None
    try:
        for round_ in range(2):
            for n in range(200 * round_, 200 * round_ + 200):
                key = f"k{n}"
                group = assign_to_key_group(key.encode(), m)
                backend = backends[compute_operator_index_for_key_group(m, p, group)]
                backend.set_current_key(key)
                backend.get_state(count).update(n)  # type: ignore[attr-defined]
            checkpoint_id = coordinator.trigger({"op": p})
            written = storage.fs.bytes_written
            handles = [
                b.snapshot(checkpoint_id, storage.snapshot_target(checkpoint_id, "op", i)).result()
                for i, b in enumerate(backends)
            ]
            uploaded = storage.fs.bytes_written - written
            for i, handle in enumerate(handles):
                storage.write_ack(
                    checkpoint_id, SubtaskAck("op", i, p, handle, None, coordinator.run_id)
                )
            path = coordinator.poll(checkpoint_id)
            assert path is not None
            metadata = storage.load(path)
            metrics = checkpoint_metrics(
                metadata, batch_id=round_, sync_seconds=0.1, upload_seconds=0.2, previous=previous
            )
            assert metrics.incremental_bytes == uploaded > 0
            assert metrics.full_bytes == 0
            assert [s.state_bytes for s in metrics.subtasks] == [h.size for h in handles]
            assert metrics.duration_seconds == metadata.completed_at - metadata.triggered_at
            previous = metadata
    finally:
        for backend in backends:
            backend.dispose()
        storage.close()
