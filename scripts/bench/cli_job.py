"""The ``statebackend`` command on a big job directory on S3 (moto's server on 127.0.0.1,
in a child process): time and S3 requests of each command.

The job is built with the library's pieces, as a ``StatefulJob`` writes one: keyed
operator ``counts`` (P=4, M=128, 20 key updates a batch over 500 keys) with operator
``source``'s offsets (inline in ``_metadata``); per batch 4 changelog records, a batch
manifest (all retained) and a metrics record (8 KiB segments, at most 64 kept); every
``--every`` batches a full checkpoint (all retained) that becomes the manifests' base;
then 10 savepoints in ``savepoints/``, and garbage for gc (20 files no ``_metadata``
references, 20 young shared files, a changelog record no manifest references). Each
command runs in this process with stdout discarded; requests are counted per S3
operation around s3fs's calls; each time is printed beside the limit measured first in
the same run: a plain s3fs client listing the job once and reading every ``_metadata`` and
manifest (the reads ``list`` needs).

    .venv/bin/python scripts/bench/cli_job.py [--batches 2000] [--every 10]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fsspec  # noqa: E402
import s3fs.core  # noqa: E402
import snapshot as snapshot_bench  # noqa: E402
from fsspec.asyn import sync_wrapper  # noqa: E402

from statebackend.backends.heap import HeapKeyedStateBackend  # noqa: E402
from statebackend.backends.operator import OperatorStateBackend  # noqa: E402
from statebackend.checkpoint.changelog_storage import ChangelogStorage  # noqa: E402
from statebackend.checkpoint.coordinator import CheckpointCoordinator  # noqa: E402
from statebackend.checkpoint.layout import join  # noqa: E402
from statebackend.checkpoint.metadata import SubtaskAck  # noqa: E402
from statebackend.checkpoint.metrics import (  # noqa: E402
    BatchMetrics,
    CheckpointMetrics,
    MetricsHistory,
    subtask_states,
)
from statebackend.checkpoint.savepoints import copy_checkpoint  # noqa: E402
from statebackend.checkpoint.storage import CheckpointStorage  # noqa: E402
from statebackend.cli import main  # noqa: E402
from statebackend.keygroups import (  # noqa: E402
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import IntSerializer, StrSerializer  # noqa: E402
from statebackend.state.descriptors import ValueStateDescriptor  # noqa: E402

M, P, OPERATOR = 128, 4, "counts"
VALUE = ValueStateDescriptor("total", IntSerializer())


@dataclass
class WrittenJob:
    """A job ``write_job`` wrote."""

    job_dir: str
    checkpoints: list[str] = field(default_factory=list)
    """The completed checkpoints' directories, oldest first."""
    totals: dict[str, int] = field(default_factory=dict)
    """The model: each key's total."""


def write_job(
    storage: CheckpointStorage,
    batches: int,
    every: int,
    *,
    parallelism: int = P,
    max_parallelism: int = M,
    keys: int = 500,
    updates_per_batch: int = 20,
    segment_bytes: int = 8 << 10,
) -> WrittenJob:
    """Write ``batches`` batches of keyed operator ``counts`` (``updates_per_batch``
    updates of ``keys`` keys each) with operator ``source``'s offsets, as a
    ``StatefulJob`` writes them: per batch its changelog records, its manifest (all
    retained) and its metrics record (history segments of ``segment_bytes``); every
    ``every`` batches a checkpoint (all retained, with its metrics record) that becomes
    the manifests' base."""
    coordinator = CheckpointCoordinator(storage, max_parallelism=max_parallelism, retained=10**6)
    changelog = ChangelogStorage(storage, retained=10**6)
    history = MetricsHistory(
        storage.fs, storage.layout.job_dir, coordinator.run_id, segment_bytes=segment_bytes
    )
    backends = [
        HeapKeyedStateBackend(
            max_parallelism=max_parallelism,
            key_group_range=compute_key_group_range_for_operator_index(
                max_parallelism, parallelism, i
            ),
        )
        for i in range(parallelism)
    ]
    for backend in backends:
        backend.enable_changelog()
    sources = [OperatorStateBackend() for _ in range(parallelism)]
    rng = random.Random(1)
    job = WrittenJob(storage.layout.job_dir)
    for batch in range(batches):
        for _ in range(updates_per_batch):
            key = f"user-{rng.randrange(keys)}"
            group = assign_to_key_group(StrSerializer().serialize(key), max_parallelism)
            backend = backends[
                compute_operator_index_for_key_group(max_parallelism, parallelism, group)
            ]
            backend.set_current_key(key)
            state: Any = backend.get_state(VALUE)
            state.update((state.value() or 0) + 1)
            job.totals[key] = job.totals.get(key, 0) + 1
        for i, source in enumerate(sources):
            source.get_list_state("offsets", IntSerializer()).update([batch * 100 + i])
        handles = [
            changelog.write_record(batch, OPERATOR, i, f"a{batch}", b.drain_changelog())
            for i, b in enumerate(backends)
        ]
        # cleanup=False: with every manifest retained, cleanup's sweep grows with them
        changelog.commit(batch, {OPERATOR: handles}, max_parallelism=max_parallelism, cleanup=False)
        history.record(
            BatchMetrics(
                batch,
                records_in=updates_per_batch,
                records_out=updates_per_batch,
                keys_touched=updates_per_batch,
            )
        )
        if batch % every != every - 1:
            continue
        checkpoint_id = coordinator.trigger({OPERATOR: parallelism, "source": parallelism})
        for i, backend in enumerate(backends):
            target = storage.snapshot_target(checkpoint_id, OPERATOR, i)
            keyed = backend.snapshot(checkpoint_id, target).result()
            ack = SubtaskAck(OPERATOR, i, parallelism, keyed, None, coordinator.run_id)
            storage.write_ack(checkpoint_id, ack)
        for i, source in enumerate(sources):
            target = storage.snapshot_target(checkpoint_id, "source", i)
            handle = target.write_operator_snapshot(checkpoint_id, source.sync_cut()).result()
            ack = SubtaskAck("source", i, parallelism, None, handle, coordinator.run_id)
            storage.write_ack(checkpoint_id, ack)
        path = coordinator.poll(checkpoint_id)
        assert path is not None
        changelog.materialized(checkpoint_id, batch)
        job.checkpoints.append(path)
        metadata = storage.load(path)
        history.record(
            CheckpointMetrics(
                checkpoint_id,
                batch,
                full_bytes=metadata.state_bytes(),
                incremental_bytes=0,
                changelog_bytes=0,
                sync_seconds=0.01,
                upload_seconds=0.02,
                duration_seconds=metadata.completed_at - metadata.triggered_at,
                subtasks=subtask_states(metadata),
            )
        )
    return job


def build(url: str, options: dict[str, Any], batches: int, every: int) -> str:
    """Write the job (see the module docstring); its directory."""
    storage = CheckpointStorage(url, "job", storage_options=options)
    fs = storage.fs
    checkpoints = write_job(storage, batches, every).checkpoints
    for n, path in enumerate(checkpoints[:: max(1, len(checkpoints) // 10)][:10]):
        copy_checkpoint(fs, path, fs, join(storage.layout.savepoints_dir, f"sp-{n}"))
    for n, path in enumerate(checkpoints[:20]):
        fs.write_atomic(join(path, f"orphan-{n}"), b"x" * 100)
    for n in range(20):
        fs.write_atomic(join(storage.layout.shared_dir, f"orphan-{n}.sst"), b"y" * 100)
    fs.write_atomic(join(storage.layout.changelog_dir, "0", "counts-0-speculative"), b"z")
    storage.close()
    return storage.layout.job_dir


def count_requests() -> Counter[str]:
    """Requests to S3 from now on, per operation."""
    sent: Counter[str] = Counter()
    call = s3fs.core.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        sent[method] += 1
        return await call(self, method, *args, **kwargs)

    s3fs.core.S3FileSystem._call_s3 = counted  # type: ignore[method-assign]
    s3fs.core.S3FileSystem.call_s3 = sync_wrapper(counted)  # type: ignore[method-assign]
    return sent


def raw_read_seconds(job: str, options: dict[str, Any]) -> float:
    """Seconds a plain s3fs client takes to list the job's directory once and read every
    ``_metadata`` and batch manifest in it (several at once): the reads ``list`` needs."""
    raw = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    started = time.perf_counter()
    names = raw.find(job)
    wanted = [n for n in names if n.endswith("/_metadata") or "/manifests/" in n]
    raw.cat(wanted)
    return time.perf_counter() - started


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    with snapshot_bench.local_s3() as location, tempfile.TemporaryDirectory() as local:
        started = time.perf_counter()
        job = build(location.url, location.options, args.batches, args.every)
        print(f"built {job} in {time.perf_counter() - started:.0f} s", flush=True)
        newest = f"{job}/chk-{args.batches // args.every}"
        options = [f"--storage-option={k}={v}" for k, v in location.options.items()]
        commands = [
            ["list", job],
            ["report", job, "-o", str(Path(local, "report.html"))],
            ["report", job, "--json"],
            ["inspect", f"{job}/latest"],
            ["inspect", newest],
            ["verify", newest],
            ["verify", f"{job}/latest"],
            ["read", newest, "--operator", OPERATOR, "--state", "total"],
            ["read", newest, "--operator", "source", "--state", "offsets"],
            ["read", f"{job}/latest", "--operator", OPERATOR, "--state", "total"],
            ["plan", newest, "-p", "3"],
            ["plan", f"{job}/latest", "-p", "3"],
            ["savepoint", "create", "--from", newest, "--to", f"{location.url}/sp-a"],
            ["savepoint", "create", "--from", f"{job}/latest", "--to", f"{location.url}/sp-b"],
            ["gc", job, "--grace", "0"],
            ["gc", job, "--grace", "0", "--apply"],
        ]
        sent = count_requests()
        raw = raw_read_seconds(job, location.options)
        print(
            f"limit: raw s3fs listing of the job + GET of every _metadata and manifest "
            f"(what list must read): {raw:.2f} s, {sum(sent.values())} requests",
            flush=True,
        )
        for argv in commands:
            sent.clear()
            started = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                status = main([*argv, *options])
            seconds = time.perf_counter() - started
            shown = " ".join(a.replace(location.url, "s3://...") for a in argv)
            print(
                f"{shown}: status {status}, {seconds:.2f} s ({seconds / raw:.1f}x the limit), "
                f"{sum(sent.values())} requests"
            )
            print(f"    {dict(sent.most_common())}", flush=True)


if __name__ == "__main__":
    main_()
