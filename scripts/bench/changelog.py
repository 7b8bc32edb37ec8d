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

    .venv/bin/python scripts/bench/changelog.py [--state-keys 1000000] [--value-bytes 100]
        [--changes 2000,200000] [--storage file,s3] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import snapshot as snapshot_bench  # noqa: E402

from statebackend.backends.keyed import StateMetaInfo  # noqa: E402
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend  # noqa: E402
from statebackend.checkpoint.changelog_storage import ChangelogStorage  # noqa: E402
from statebackend.checkpoint.storage import CheckpointStorage  # noqa: E402
from statebackend.keygroups import KeyGroupRange, assign_to_key_group  # noqa: E402
from statebackend.serializers import BytesSerializer, StrSerializer  # noqa: E402
from statebackend.state.descriptors import StateKind, ValueStateDescriptor  # noqa: E402
from statebackend.state.interfaces import ValueState  # noqa: E402

MAX_PARALLELISM = 128
STATE = ValueStateDescriptor("payload", BytesSerializer())
OPERATOR = "bench"


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
    parser.add_argument("--workdir", default=None, help="local scratch directory")
    parser.add_argument("--json", action="store_true", help="one JSON object per result")
    args = parser.parse_args(argv)
    changes = [int(c) for c in args.changes.split(",") if c]
    if max(changes) > args.state_keys:
        parser.error("--changes cannot exceed --state-keys")
    kinds = [k for k in args.storage.split(",") if k]
    workdir = Path(tempfile.mkdtemp(prefix="bench-changelog-", dir=args.workdir))
    results: list[Result] = []
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
                for result in bench_location(
                    location, workdir, args.state_keys, args.value_bytes, changes
                ):
                    if args.json:
                        print(json.dumps(asdict(result)), flush=True)
                    results.append(result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.json:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
