"""Changelog benchmark: per-batch changelog write beside a full snapshot of the same state.

A RocksDB backend holds ``--state-keys`` keys of ``--value-bytes`` random bytes. For each
batch size K (``--changes``, default 2k and 200k changed keys) a batch updates K distinct
keys, then the subtask's end of batch is timed: drain the backend's changes, encode the
record and write it durably (``ChangelogStorage.write_record``: one PUT). The limit, in
the same run and on the same storage, is a full snapshot of the same state (sync cut +
upload of the full keyed format), which is what a batch would have to make durable
without the changelog. Printed: record bytes and write time (wall clock, and the CPU
time of this process, which a loaded machine inflates less), the snapshot's, and their
ratios (target: bytes in proportion to K, well below the snapshot's while K is small
against the state). On ``file://`` and on a local S3 (moto's server on 127.0.0.1, in a
child process).

Rebuild (``--bench rebuild``): a job whose one subtask wrote R records (one a batch, of
``--rebuild-keys`` changed keys each, no base checkpoint), for each R of
``--rebuild-records``; timed: ``rebuild_keyed_state`` of manifest R into a fresh RocksDB
backend, without and with a signing key. The limit, in the same run and on the same
storage: fetching the same byte ranges with fsspec alone, ``--threads`` at a time (the
storage's transfer threads, ``spark.statebackend.transfer.threads``). Best of
``--repeats`` runs each.

    .venv/bin/python scripts/bench/changelog.py [--state-keys 1000000] [--value-bytes 100]
        [--changes 2000,200000] [--storage file,s3] [--bench write,rebuild]
        [--rebuild-records 10,40,160] [--rebuild-keys 20] [--threads 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import snapshot as snapshot_bench  # noqa: E402

from statebackend.backends.heap import HeapKeyedStateBackend  # noqa: E402
from statebackend.backends.keyed import StateMetaInfo  # noqa: E402
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend  # noqa: E402
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state  # noqa: E402
from statebackend.checkpoint.changelog_storage import ChangelogStorage  # noqa: E402
from statebackend.checkpoint.signing import SigningKey  # noqa: E402
from statebackend.checkpoint.storage import (  # noqa: E402
    DEFAULT_TRANSFER_THREADS,
    CheckpointStorage,
)
from statebackend.keygroups import KeyGroupRange, assign_to_key_group  # noqa: E402
from statebackend.serializers import BytesSerializer, StrSerializer  # noqa: E402
from statebackend.snapshot.changelog_format import ChangelogHandle  # noqa: E402
from statebackend.state.descriptors import StateKind, ValueStateDescriptor  # noqa: E402
from statebackend.state.interfaces import ValueState  # noqa: E402

MAX_PARALLELISM = 128
ALL_KEY_GROUPS = KeyGroupRange(0, MAX_PARALLELISM - 1)
STATE = ValueStateDescriptor("payload", BytesSerializer())
OPERATOR = "bench"
SIGNING_KEY = SigningKey(b"changelog-bench-signing-key")


@dataclass
class Result:
    """One batch's changelog write beside the full snapshot of the same state."""

    storage: str
    state_keys: int
    changes: int
    record_bytes: int
    record_ms: float
    record_cpu_ms: float
    snapshot_bytes: int
    snapshot_ms: float
    snapshot_cpu_ms: float
    bytes_ratio: float
    time_ratio: float


def key_of(n: int) -> str:
    return f"key-{n:09d}"


def filled_backend(directory: Path, keys: int, value_bytes: int) -> RocksDBKeyedStateBackend:
    """A backend over all key groups holding ``keys`` values, loaded in bulk."""
    backend = RocksDBKeyedStateBackend(
        directory,
        max_parallelism=MAX_PARALLELISM,
        key_group_range=KeyGroupRange(0, MAX_PARALLELISM - 1),
    )
    pool = random.Random(3).randbytes(value_bytes * 64)
    meta = StateMetaInfo("payload", StateKind.VALUE, {"value": BytesSerializer().config()})
    encode = StrSerializer().serialize
    entries = []
    for n in range(keys):
        key = encode(key_of(n))
        offset = n % (len(pool) - value_bytes)
        group = assign_to_key_group(key, MAX_PARALLELISM)
        entries.append(("payload", group, (key, b"", pool[offset : offset + value_bytes])))
    entries.sort(key=lambda item: item[1])
    backend.restore(StrSerializer().config(), [meta], entries)
    backend.enable_changelog()
    return backend


def bench_location(
    location: snapshot_bench.Location,
    workdir: Path,
    state_keys: int,
    value_bytes: int,
    changes: list[int],
) -> list[Result]:
    storage = CheckpointStorage(location.url, "changelog-bench", storage_options=location.options)
    changelog = ChangelogStorage(storage)
    backend = filled_backend(workdir / f"db-{location.name}", state_keys, value_bytes)
    state = backend.get_state(STATE)
    assert isinstance(state, ValueState)
    rng = random.Random(11)
    try:
        started, cpu = time.perf_counter(), time.process_time()
        target = storage.snapshot_target(1, OPERATOR, 0)
        snapshot = backend.snapshot(1, target).result()
        snapshot_ms = (time.perf_counter() - started) * 1000
        snapshot_cpu_ms = (time.process_time() - cpu) * 1000
        snapshot_bench.log(
            f"{location.name}: full snapshot {snapshot.size / 1e6:.1f} MB in {snapshot_ms:.0f} ms"
        )
        results = []
        for batch_id, count in enumerate(changes, start=1):
            value = rng.randbytes(value_bytes)
            for n in rng.sample(range(state_keys), count):
                backend.set_current_key(key_of(n))
                state.update(value)
            started, cpu = time.perf_counter(), time.process_time()
            handle = changelog.write_record(
                batch_id, OPERATOR, 0, "bench", backend.drain_changelog()
            )
            record_ms = (time.perf_counter() - started) * 1000
            record_cpu_ms = (time.process_time() - cpu) * 1000
            results.append(
                Result(
                    location.name,
                    state_keys,
                    count,
                    handle.size,
                    round(record_ms, 1),
                    round(record_cpu_ms, 1),
                    snapshot.size,
                    round(snapshot_ms, 1),
                    round(snapshot_cpu_ms, 1),
                    round(handle.size / snapshot.size, 4),
                    round(record_ms / snapshot_ms, 4),
                )
            )
        return results
    finally:
        backend.dispose()
        storage.fs.delete(storage.layout.job_dir, recursive=True)
        storage.close()


@dataclass
class RebuildFigure:
    """A rebuild from R records beside fetching the same byte ranges concurrently."""

    storage: str
    signed: bool
    records: int
    changes: int
    range_bytes: int
    rebuild_ms: float
    rebuild_cpu_ms: float
    fetch_ms: float
    threads: int
    ratio: float


def write_records(
    changelog: ChangelogStorage, records: int, keys: int, value_bytes: int
) -> list[ChangelogHandle]:
    """Batches 1..``records`` of one subtask owning every key group, each updating
    ``keys`` random keys of a pool of 10 x ``keys``, each committed (manifest B holds
    records 1..B: no base); the records' handles."""
    backend = HeapKeyedStateBackend(max_parallelism=MAX_PARALLELISM, key_group_range=ALL_KEY_GROUPS)
    backend.enable_changelog()
    state = backend.get_state(STATE)
    assert isinstance(state, ValueState)
    rng = random.Random(5)
    handles = []
    try:
        for batch_id in range(1, records + 1):
            for n in rng.sample(range(keys * 10), keys):
                backend.set_current_key(key_of(n))
                state.update(rng.randbytes(value_bytes))
            handle = changelog.write_record(
                batch_id, OPERATOR, 0, "bench", backend.drain_changelog()
            )
            changelog.commit(
                batch_id, {OPERATOR: [handle]}, max_parallelism=MAX_PARALLELISM, cleanup=False
            )
            handles.append(handle)
    finally:
        backend.dispose()
    return handles


def record_ranges(
    changelog: ChangelogStorage, handles: list[ChangelogHandle]
) -> list[tuple[str, int, int]]:
    """(path, start, end) of the bytes a rebuild of every key group reads of each record."""
    ranges = []
    for handle in handles:
        path = changelog.record_path(handle)
        if path is not None and handle.key_groups:
            first, last = handle.key_groups[0], handle.key_groups[-1]
            ranges.append((path, first[1], last[1] + last[2]))
    return ranges


def fetch_concurrently(
    changelog: ChangelogStorage, ranges: list[tuple[str, int, int]], threads: int
) -> float:
    """Milliseconds fsspec alone takes to fetch ``ranges``, ``threads`` at a time."""
    fs = changelog.fs.fsspec
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        fetched = list(pool.map(lambda r: fs.cat_file(r[0], start=r[1], end=r[2]), ranges))
    elapsed = (time.perf_counter() - started) * 1000
    assert [len(data) for data in fetched] == [end - start for _, start, end in ranges]
    return elapsed


def bench_rebuild(
    location: snapshot_bench.Location,
    workdir: Path,
    record_counts: list[int],
    keys: int,
    value_bytes: int,
    threads: int,
    repeats: int,
) -> list[RebuildFigure]:
    results = []
    for signed in (False, True):
        storage = CheckpointStorage(
            location.url,
            f"rebuild-bench-{'signed' if signed else 'plain'}",
            storage_options=location.options,
            transfer_threads=threads,
            signing_key=SIGNING_KEY if signed else None,
        )
        changelog = ChangelogStorage(storage)
        try:
            handles = write_records(changelog, max(record_counts), keys, value_bytes)
            for count in record_counts:
                manifest = changelog.load_manifest(count)
                ranges = record_ranges(changelog, handles[:count])
                best = best_cpu = best_fetch = float("inf")
                changes = 0
                for run in range(repeats):
                    backend = RocksDBKeyedStateBackend(
                        workdir / f"rebuild-{location.name}-{signed}-{count}-{run}",
                        max_parallelism=MAX_PARALLELISM,
                        key_group_range=ALL_KEY_GROUPS,
                    )
                    try:
                        started, cpu = time.perf_counter(), time.process_time()
                        rebuilt = rebuild_keyed_state(backend, changelog, manifest, OPERATOR)
                        elapsed = (time.perf_counter() - started) * 1000
                        best_cpu = min(best_cpu, (time.process_time() - cpu) * 1000)
                        best = min(best, elapsed)
                        changes = rebuilt.changes
                    finally:
                        backend.dispose()
                    best_fetch = min(best_fetch, fetch_concurrently(changelog, ranges, threads))
                results.append(
                    RebuildFigure(
                        location.name,
                        signed,
                        count,
                        changes,
                        sum(end - start for _, start, end in ranges),
                        round(best, 1),
                        round(best_cpu, 1),
                        round(best_fetch, 1),
                        threads,
                        round(best / best_fetch, 2),
                    )
                )
                snapshot_bench.log(f"{location.name}: rebuild of {count} records {best:.0f} ms")
        finally:
            storage.fs.delete(storage.layout.job_dir, recursive=True)
            storage.close()
    return results


def print_rebuild_table(results: list[RebuildFigure]) -> None:
    """A readable table of the rebuild figures."""
    header = (
        f"{'storage':<7} {'signed':>6} {'records':>8} {'changes':>8} {'range kB':>9} "
        f"{'rebuild ms':>11} {'(cpu)':>7} {'fetch ms':>9} {'threads':>8} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.storage:<7} {'yes' if r.signed else 'no':>6} {r.records:>8} {r.changes:>8} "
            f"{r.range_bytes / 1e3:>9.1f} {r.rebuild_ms:>11.1f} {r.rebuild_cpu_ms:>7.0f} "
            f"{r.fetch_ms:>9.1f} {r.threads:>8} {r.ratio:>6.2f}"
        )


def print_table(results: list[Result]) -> None:
    """A readable table of all results."""
    header = (
        f"{'storage':<7} {'state keys':>10} {'changes':>8} {'record MB':>10} {'record ms':>10} "
        f"{'(cpu)':>8} {'snapshot MB':>12} {'snapshot ms':>12} {'(cpu)':>8} "
        f"{'bytes ratio':>12} {'time ratio':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.storage:<7} {r.state_keys:>10} {r.changes:>8} {r.record_bytes / 1e6:>10.3f} "
            f"{r.record_ms:>10.1f} {r.record_cpu_ms:>8.0f} {r.snapshot_bytes / 1e6:>12.1f} "
            f"{r.snapshot_ms:>12.1f} {r.snapshot_cpu_ms:>8.0f} {r.bytes_ratio:>12.4f} "
            f"{r.time_ratio:>11.4f}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table, or with ``--json`` one JSON object per result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-keys", type=int, default=1_000_000)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--changes", default="2000,200000", help="changed keys per batch")
    parser.add_argument("--storage", default="file,s3", help="file, s3 or both")
    parser.add_argument("--bench", default="write,rebuild", help="write, rebuild or both")
    parser.add_argument("--rebuild-records", default="10,40,160", help="records per rebuild")
    parser.add_argument("--rebuild-keys", type=int, default=20, help="changed keys per record")
    parser.add_argument("--threads", type=int, default=DEFAULT_TRANSFER_THREADS)
    parser.add_argument("--repeats", type=int, default=3, help="rebuild runs (best counts)")
    parser.add_argument("--workdir", default=None, help="local scratch directory")
    parser.add_argument("--json", action="store_true", help="one JSON object per result")
    args = parser.parse_args(argv)
    changes = [int(c) for c in args.changes.split(",") if c]
    if max(changes) > args.state_keys:
        parser.error("--changes cannot exceed --state-keys")
    kinds = [k for k in args.storage.split(",") if k]
    benches = [b for b in args.bench.split(",") if b]
    record_counts = [int(r) for r in args.rebuild_records.split(",") if r]
    workdir = Path(tempfile.mkdtemp(prefix="bench-changelog-", dir=args.workdir))
    results: list[Result] = []
    rebuilds: list[RebuildFigure] = []
    try:
        with snapshot_bench.local_s3() as s3:
            locations = []
            if "file" in kinds:
                locations.append(
                    snapshot_bench.Location("file", (workdir / "checkpoints").as_uri(), {})
                )
            if "s3" in kinds:
                locations.append(s3)
            for location in locations:
                if "write" in benches:
                    for result in bench_location(
                        location, workdir, args.state_keys, args.value_bytes, changes
                    ):
                        if args.json:
                            print(json.dumps(asdict(result)), flush=True)
                        results.append(result)
                if "rebuild" in benches:
                    for figure in bench_rebuild(
                        location,
                        workdir,
                        record_counts,
                        args.rebuild_keys,
                        args.value_bytes,
                        args.threads,
                        args.repeats,
                    ):
                        if args.json:
                            print(json.dumps(asdict(figure)), flush=True)
                        rebuilds.append(figure)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.json:
        if results:
            print_table(results)
        if rebuilds:
            print_rebuild_table(rebuilds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
