"""The durable part of a batch (changelog record + manifest) beside the batch's total time.

With the per-batch changelog, every batch of a ``StatefulJob`` ends with each keyed
subtask writing its changelog record (drain, encode, one PUT) and the driver committing
the batch manifest; full or incremental snapshots are materialized in the background
every ``--checkpoint-every`` batches. This runs the ``spark_state.py`` workload (N events
over K keys, per-key count and sum, B events per batch, parallelism 2, ``local[2]``) and
reads the job's metrics history: per batch the changelog bytes, the durable part
(``BatchMetrics.changelog_seconds``, the slowest subtask's record write, plus
``manifest_seconds``, the driver's commit) and the batch's total time (from the end of
the previous batch to the end of this one, as the driver's history records them; batch 0
has no start mark and is left out), with their ratio (target: <= 10% at K=200k,
B=200k); and beside them the run's last checkpoint of the same state, once in the full
and once in the incremental format (a run each): bytes uploaded and upload time.
``file://`` and a local S3 (moto's server on 127.0.0.1, in a child process). Every run's
final state is checked against a plain-Python computation.

    .venv/bin/python scripts/bench/batch_durability.py [--events 1000000]
        [--keys 2000,200000] [--batch-size 200000] [--checkpoint-every 2]
        [--storage file,s3] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import snapshot as snapshot_bench  # noqa: E402
import spark_baseline  # noqa: E402
import spark_state  # noqa: E402
from pyspark import cloudpickle  # noqa: E402

from statebackend.checkpoint.filesystem import open_filesystem  # noqa: E402
from statebackend.checkpoint.layout import JobLayout  # noqa: E402
from statebackend.checkpoint.metrics import (  # noqa: E402
    BatchMetrics,
    CheckpointMetrics,
    read_history,
    records_of,
)

# The keyed function lives in a script, not in a package the executors can import.
cloudpickle.register_pickle_by_value(spark_state)

MB = 1 << 20
FORMATS = ("full", "incremental")


@dataclass
class BatchRow:
    """One batch of one run: what it made durable and how long that took."""

    storage: str
    keys: int
    snapshot_format: str
    batch_id: int
    records: int
    changelog_bytes: int
    changelog_seconds: float
    manifest_seconds: float
    durable_seconds: float
    batch_seconds: float
    durable_share: float


@dataclass
class SnapshotRow:
    """The last checkpoint of one run (the background materialization)."""

    storage: str
    keys: int
    snapshot_format: str
    checkpoint_id: int
    uploaded_bytes: int
    sync_seconds: float
    upload_seconds: float


def measure_run(
    spark: object,
    workload: spark_baseline.Workload,
    batch_size: int,
    location: snapshot_bench.Location,
    keys: int,
    snapshot_format: str,
    checkpoint_every: int,
) -> tuple[list[BatchRow], SnapshotRow]:
    """Run the workload once; read its batches and its last checkpoint from its history."""
    job_id = f"durable-{keys}-{snapshot_format}"
    spark_state.run_ours(
        spark,
        workload,
        batch_size,
        checkpoint_dir=location.url,
        storage_options=location.options,
        incremental=snapshot_format == "incremental",
        checkpoint_every=checkpoint_every,
        job_id=job_id,
    )
    fs = open_filesystem(location.url, location.options)
    history = read_history(fs, JobLayout(location.url, job_id).job_dir)
    batches = records_of(history, BatchMetrics)
    rows = []
    for previous, batch in itertools.pairwise(batches):
        durable = batch.changelog_seconds + batch.manifest_seconds
        total = batch.at - previous.at
        rows.append(
            BatchRow(
                location.name,
                keys,
                snapshot_format,
                batch.batch_id,
                batch.records_in,
                batch.changelog_bytes,
                round(batch.changelog_seconds, 4),
                round(batch.manifest_seconds, 4),
                round(durable, 4),
                round(total, 3),
                round(durable / total, 4),
            )
        )
    last = records_of(history, CheckpointMetrics)[-1]
    snapshot = SnapshotRow(
        location.name,
        keys,
        snapshot_format,
        last.checkpoint_id,
        last.full_bytes if snapshot_format == "full" else last.incremental_bytes,
        round(last.sync_seconds, 4),
        round(last.upload_seconds, 3),
    )
    return rows, snapshot


def print_tables(batches: list[BatchRow], snapshots: list[SnapshotRow]) -> None:
    """The per-batch table, then the checkpoints beside each run's mean durable part."""
    print(
        f"{'storage':<8}{'K':>8}{'format':>13}{'batch':>6}{'records':>9}{'chlog MB':>10}"
        f"{'chlog s':>9}{'manif s':>9}{'durable s':>10}{'batch s':>9}{'share':>8}"
    )
    for row in batches:
        print(
            f"{row.storage:<8}{row.keys:>8}{row.snapshot_format:>13}{row.batch_id:>6}"
            f"{row.records:>9}{row.changelog_bytes / MB:>10.2f}{row.changelog_seconds:>9.3f}"
            f"{row.manifest_seconds:>9.3f}{row.durable_seconds:>10.3f}"
            f"{row.batch_seconds:>9.2f}{row.durable_share:>8.1%}"
        )
    print()
    print(
        f"{'storage':<8}{'K':>8}{'format':>13}{'chk':>5}{'snapshot MB':>12}{'sync s':>8}"
        f"{'upload s':>9}{'chlog MB/batch':>15}{'durable s/batch':>16}"
    )
    for snap in snapshots:
        runs = [
            r
            for r in batches
            if (r.storage, r.keys, r.snapshot_format)
            == (snap.storage, snap.keys, snap.snapshot_format)
        ]
        count = max(len(runs), 1)
        print(
            f"{snap.storage:<8}{snap.keys:>8}{snap.snapshot_format:>13}{snap.checkpoint_id:>5}"
            f"{snap.uploaded_bytes / MB:>12.2f}{snap.sync_seconds:>8.3f}"
            f"{snap.upload_seconds:>9.2f}"
            f"{sum(r.changelog_bytes for r in runs) / count / MB:>15.2f}"
            f"{sum(r.durable_seconds for r in runs) / count:>16.3f}"
        )


def main(argv: list[str] | None = None) -> None:
    """Run every (storage, K, format); print the tables (or JSON lines with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", default="2000,200000", help="comma-separated K values")
    parser.add_argument("--batch-size", type=int, default=200_000)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--storage", default="file,s3", help="file, s3 or file,s3")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    storages = snapshot_bench.storage_kinds(args.storage)
    batches: list[BatchRow] = []
    snapshots: list[SnapshotRow] = []
    with ExitStack() as stack:
        locations = []
        for kind in storages:
            if kind == "file":
                directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                locations.append(snapshot_bench.Location("file", directory.as_uri(), {}))
            else:
                s3 = stack.enter_context(snapshot_bench.local_s3())
                locations.append(snapshot_bench.Location("s3", "s3://bench/durable", s3.options))
        spark = spark_baseline.create_session()
        stack.callback(spark.stop)
        spark_state.run_ours(spark, spark_baseline.make_workload(2_000, 100, 1), 1_000)
        for keys in (int(k) for k in args.keys.split(",")):
            workload = spark_baseline.make_workload(args.events, keys)
            for location in locations:
                for snapshot_format in FORMATS:
                    snapshot_bench.log(f"{location.name}, K={keys}, {snapshot_format}")
                    rows, snapshot = measure_run(
                        spark,
                        workload,
                        args.batch_size,
                        location,
                        keys,
                        snapshot_format,
                        args.checkpoint_every,
                    )
                    batches += rows
                    snapshots.append(snapshot)
    if args.json:
        for row in [*batches, *snapshots]:
            print(json.dumps({"kind": type(row).__name__, **asdict(row)}))
        return
    print(f"N={args.events} B={args.batch_size} (local[2], parallelism 2)")
    print_tables(batches, snapshots)


if __name__ == "__main__":
    main()
