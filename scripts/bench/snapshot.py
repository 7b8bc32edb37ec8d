"""Snapshot benchmark: sync pause, async upload throughput, rescale restore — RocksDB backend.

For each state size (``--sizes`` in MB; values of ``--value-bytes`` random bytes, so
1000 MB is about 1M entries) it measures, each beside a limit measured in the same run:

(a) the synchronous pause: how long ``backend.snapshot()`` takes to return (flush +
    native checkpoint + opening it read-only), over ``--repeat`` snapshots with fresh
    writes in between; limit: raw rocksdict ``Checkpoint.create_checkpoint`` on the same
    database. Target: <= 50 ms, and flat in state size.
(b) the asynchronous upload of that snapshot to ``file://`` and to a local S3 endpoint
    (moto's server on 127.0.0.1, started here), as MB/s from ``snapshot()`` returning to
    the handle; limit: a raw fsspec ``pipe_file`` of the same number of bytes to the same
    directory. Target: >= 80% of raw. Measured for the full format and, as
    "async upload (incremental)", for the incremental format's first snapshot of a job
    (every file of the native checkpoint uploaded, none reused).
(c) restore of one subtask when a 4-subtask checkpoint is rescaled to 3 and to 8, from
    the full and from the incremental format: bytes read (the checkpoint file system's
    ``bytes_read``) against the subtask's fair share of the state (full format: all
    keyed file bytes x its key groups / M; target <= 1.2x), and the restore time
    against a raw fsspec download of the same bytes (the full format's byte ranges, the
    incremental handles' files; target <= 2x).

    .venv/bin/python scripts/bench/snapshot.py [--sizes 10,100,1000] [--value-bytes 1024]
        [--repeat 5] [--compression none] [--storage both] [--parts upload,restore] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from rocksdict import Checkpoint

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.layout import join
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.restore import plan_restore, restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointError
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import BytesSerializer, StrSerializer
from statebackend.snapshot.handles import resolve_path
from statebackend.snapshot.incremental import IncrementalKeyedStateHandle
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState

MAX_PARALLELISM = 128
OLD_PARALLELISM = 4
RESCALES = ((3, 1), (8, 3))
"""(new parallelism, the new subtask measured): 1 of 3 spans two old subtasks."""
MB = 1 << 20
STATE = ValueStateDescriptor("payload", BytesSerializer())
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def log(message: str) -> None:
    """Progress on stderr (the table or JSON goes to stdout)."""
    print(f"# {message}", file=sys.stderr, flush=True)


@dataclass
class Result:
    """One measured figure beside its same-run limit."""

    benchmark: str
    storage: str
    size_mb: int
    figure: float
    unit: str
    limit: float
    limit_name: str
    ratio: float
    target: str
    ok: bool | None
    detail: str = ""


@dataclass
class Location:
    """A checkpoint location: URL and storage options."""

    name: str
    url: str
    options: dict[str, Any]


def _serve_s3(ports: Any) -> None:
    """Child process: moto's ThreadedMotoServer on 127.0.0.1; reports its port."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    ports.put(server.get_host_and_port()[1])
    threading.Event().wait()


@contextmanager
def local_s3() -> Iterator[Location]:
    """moto's S3 server on a free port of 127.0.0.1 with a fresh bucket.

    The server runs in a child process so that it does not share this process's GIL
    with the code measured (both the raw upload and ours talk to it over HTTP).
    """
    import boto3

    saved = {name: os.environ.get(name) for name in (*_AWS_ENV, "AWS_PROFILE")}
    os.environ.pop("AWS_PROFILE", None)
    os.environ.update(_AWS_ENV)
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    process = context.Process(target=_serve_s3, args=(ports,), daemon=True)
    process.start()
    try:
        endpoint = f"http://127.0.0.1:{ports.get(timeout=60)}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}
        yield Location("s3", "s3://bench/snapshots", options)
    finally:
        process.terminate()
        process.join(10)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Values:
    """Distinct, incompressible values: slices of a random pool at shifting offsets."""

    def __init__(self, value_bytes: int, seed: int = 7) -> None:
        self.size = value_bytes
        self.pool = random.Random(seed).randbytes(value_bytes * 257)

    def __call__(self, n: int) -> bytes:
        start = (n * 131) % (len(self.pool) - self.size)
        return n.to_bytes(8, "big") + self.pool[start + 8 : start + self.size]


def entries_for(size_mb: int, value_bytes: int) -> int:
    """How many entries make about ``size_mb`` MB of values."""
    return max(1, size_mb * MB // value_bytes)


def new_backend(local: Path, parallelism: int, index: int) -> RocksDBKeyedStateBackend:
    """A RocksDB backend of subtask ``index`` of ``parallelism``."""
    return RocksDBKeyedStateBackend(
        local,
        max_parallelism=MAX_PARALLELISM,
        key_group_range=compute_key_group_range_for_operator_index(
            MAX_PARALLELISM, parallelism, index
        ),
    )


FILL_BATCH = 50_000
"""Keys written per round of ``fill``: each backend writes its share in one batch."""


def fill(
    backends: list[RocksDBKeyedStateBackend], count: int, values: Values, round_: int = 0
) -> None:
    """Write keys ``key-0`` .. ``key-{count-1}`` (the value of key n is
    ``values(n + round_)``), each to the backend owning its key group, in rounds of
    ``FILL_BATCH`` keys of which each backend writes its share in one ``batch`` (one
    WriteBatch)."""
    parallelism = len(backends)
    states = [cast(ValueState, backend.get_state(STATE)) for backend in backends]
    keys = StrSerializer()
    owner = [
        compute_operator_index_for_key_group(MAX_PARALLELISM, parallelism, group)
        for group in range(MAX_PARALLELISM)
    ]
    for start in range(0, count, FILL_BATCH):
        shares: list[list[int]] = [[] for _ in backends]
        for n in range(start, min(count, start + FILL_BATCH)):
            group = assign_to_key_group(keys.serialize(f"key-{n}"), MAX_PARALLELISM)
            shares[owner[group]].append(n)
        for backend, state, share in zip(backends, states, shares, strict=True):
            with backend.batch():
                for n in share:
                    backend.set_current_key(f"key-{n}")
                    state.update(values(n + round_))


def raw_pipe_seconds(storage: CheckpointStorage, directory: str, data: bytes) -> float:
    """Seconds for a raw fsspec ``pipe_file`` of ``data`` into ``directory``."""
    fs = storage.fs._fs
    path = join(directory, "raw-upload.bin")
    started = time.perf_counter()
    fs.pipe_file(path, data)
    seconds = time.perf_counter() - started
    fs.rm_file(path)
    return seconds


UPLOADS_PER_LOCATION = 2
"""Uploads measured per location and size (best counts); later rounds only measure the
pause and cancel the upload."""


def bench_sync_and_upload(
    size_mb: int,
    locations: list[Location],
    workdir: Path,
    values: Values,
    repeat: int,
    compression: str,
) -> list[Result]:
    """(a) the sync pause and (b) the upload throughput of one backend of ``size_mb``."""
    backend = new_backend(workdir / f"single-{size_mb}", 1, 0)
    count = entries_for(size_mb, values.size)
    started = time.perf_counter()
    fill([backend], count, values)
    log(f"{size_mb} MB: {count} entries written in {time.perf_counter() - started:.1f} s")
    storages = {
        loc.name: CheckpointStorage(
            loc.url, f"single-{size_mb}", storage_options=loc.options, compression=compression
        )
        for loc in locations
    }
    incremental = {
        loc.name: CheckpointStorage(
            loc.url, f"single-{size_mb}-incremental", storage_options=loc.options, incremental=True
        )
        for loc in locations
    }
    pauses: list[float] = []
    raw_pauses: list[float] = []
    uploads: dict[str, dict[str, list[tuple[float, int]]]] = {"full": {}, "incremental": {}}
    raws: dict[str, dict[str, list[float]]] = {"full": {}, "incremental": {}}
    data = b""

    def measure(
        variant: str,
        name: str,
        storage: CheckpointStorage,
        checkpoint_id: int,
        seconds: float,
        size: int,
    ) -> None:
        """Record an upload and a raw put of as many bytes; drop the checkpoint."""
        nonlocal data
        uploads[variant].setdefault(name, []).append((seconds, size))
        if len(data) != size:
            data = os.urandom(size)
        raw = raw_pipe_seconds(storage, storage.resolve(checkpoint_id), data)
        raws[variant].setdefault(name, []).append(raw)
        storage.discard(checkpoint_id)

    try:
        rounds = max(repeat, UPLOADS_PER_LOCATION * len(locations))
        for round_ in range(rounds):
            fill([backend], 2000, values, round_ + 1)
            raw_dir = tempfile.mkdtemp(dir=workdir)
            started = time.perf_counter()
            Checkpoint(backend._db).create_checkpoint(str(Path(raw_dir) / "cp"))
            raw_pauses.append(time.perf_counter() - started)
            shutil.rmtree(raw_dir)

            fill([backend], 2000, values, round_ + 2)
            location = locations[round_ % len(locations)]
            storage = storages[location.name]
            checkpoint_id = round_ + 1
            target = storage.snapshot_target(checkpoint_id, "op", 0)
            started = time.perf_counter()
            future = backend.snapshot(checkpoint_id, target)
            returned = time.perf_counter()
            pauses.append(returned - started)
            if round_ >= UPLOADS_PER_LOCATION * len(locations):
                future.cancel()
                with suppress(CheckpointError):
                    future.result()
                storage.discard(checkpoint_id)
                continue
            handle = future.result()
            seconds = time.perf_counter() - returned
            measure("full", location.name, storage, checkpoint_id, seconds, handle.size)
            # The job never completes a checkpoint, so nothing is reused: all is uploaded.
            storage = incremental[location.name]
            future = backend.snapshot(
                checkpoint_id, storage.snapshot_target(checkpoint_id, "op", 0)
            )
            returned = time.perf_counter()
            handle = future.result()
            seconds = time.perf_counter() - returned
            measure("incremental", location.name, storage, checkpoint_id, seconds, handle.size)
            storage.fs.delete(storage.layout.shared_dir, recursive=True)
    finally:
        for storage in (*storages.values(), *incremental.values()):
            storage.close()
        backend.dispose()
    pause_ms = statistics.median(pauses) * 1000
    raw_ms = statistics.median(raw_pauses) * 1000
    results = [
        Result(
            "sync pause",
            "local",
            size_mb,
            round(pause_ms, 2),
            "ms",
            round(raw_ms, 2),
            "raw rocksdict checkpoint",
            round(pause_ms / raw_ms, 2) if raw_ms else float("inf"),
            "<= 50 ms",
            pause_ms <= 50,
            f"median of {len(pauses)}; max {max(pauses) * 1000:.1f} ms "
            f"(raw max {max(raw_pauses) * 1000:.1f} ms)",
        )
    ]
    for variant, location in ((v, loc) for v in ("full", "incremental") for loc in locations):
        seconds, size = min(uploads[variant][location.name])
        raw = min(raws[variant][location.name])
        ours_mbps, raw_mbps = size / MB / seconds, size / MB / raw
        ratio = ours_mbps / raw_mbps
        results.append(
            Result(
                "async upload" if variant == "full" else "async upload (incremental)",
                location.name,
                size_mb,
                round(ours_mbps, 1),
                "MB/s",
                round(raw_mbps, 1),
                "raw fsspec pipe_file",
                round(ratio, 3),
                ">= 0.8",
                ratio >= 0.8,
                f"{size / MB:.1f} MB in {seconds:.2f} s (raw {raw:.2f} s); best of "
                f"{len(uploads[variant][location.name])}",
            )
        )
    return results


def write_old_checkpoint(
    size_mb: int,
    location: Location,
    workdir: Path,
    values: Values,
    compression: str,
    incremental: bool,
) -> tuple[CheckpointStorage, CheckpointMetadata]:
    """A completed checkpoint of ``OLD_PARALLELISM`` subtasks holding ``size_mb`` MB, in
    the full or the incremental format."""
    storage = CheckpointStorage(
        location.url,
        f"rescale-{size_mb}-{'incremental' if incremental else 'full'}",
        storage_options=location.options,
        compression=compression,
        incremental=incremental,
    )
    coordinator = CheckpointCoordinator(storage, max_parallelism=MAX_PARALLELISM)
    backends = [
        new_backend(
            workdir / f"old-{location.name}-{size_mb}-{incremental}-{i}", OLD_PARALLELISM, i
        )
        for i in range(OLD_PARALLELISM)
    ]
    try:
        fill(backends, entries_for(size_mb, values.size), values)
        checkpoint_id = coordinator.trigger({"op": OLD_PARALLELISM})
        futures = [
            backend.snapshot(checkpoint_id, storage.snapshot_target(checkpoint_id, "op", i))
            for i, backend in enumerate(backends)
        ]
        for i, future in enumerate(futures):
            ack = SubtaskAck("op", i, OLD_PARALLELISM, future.result(), None, coordinator.run_id)
            storage.write_ack(checkpoint_id, ack)
        assert coordinator.poll(checkpoint_id) is not None
    finally:
        for backend in backends:
            backend.dispose()
    return storage, storage.load(checkpoint_id)


def raw_download_seconds(
    storage: CheckpointStorage, directory: str, metadata: CheckpointMetadata, new: int, sub: int
) -> tuple[float, int]:
    """Seconds and bytes of a raw fsspec download of what the subtask reads: the byte
    ranges of its key groups (full format) or every file of the handles that hold some
    of them (incremental format), one file after the other."""
    wanted = compute_key_group_range_for_operator_index(MAX_PARALLELISM, new, sub)
    ranges: list[tuple[str, int | None, int | None]] = []
    for handle in metadata.operators["op"].keyed_handles():
        if isinstance(handle, IncrementalKeyedStateHandle):
            if handle.key_group_range.intersection(wanted):
                ranges += [(resolve_path(directory, f.path), None, None) for f in handle.files()]
            continue
        groups = [(o, n) for g, o, n in handle.key_groups if g in wanted]
        if groups:
            start = groups[0][0]
            ranges.append((join(directory, handle.path), start, groups[-1][0] + groups[-1][1]))
    fs = storage.fs._fs
    started = time.perf_counter()
    total = sum(len(fs.cat_file(path, start=start, end=end)) for path, start, end in ranges)
    return time.perf_counter() - started, total


def bench_restore(
    size_mb: int, locations: list[Location], workdir: Path, values: Values, compression: str
) -> list[Result]:
    """(c) bytes read and time of one new subtask's restore at 3 and 8 subtasks, from a
    full and from an incremental checkpoint."""
    results: list[Result] = []
    for location, incremental in ((loc, i) for loc in locations for i in (False, True)):
        storage, metadata = write_old_checkpoint(
            size_mb, location, workdir, values, compression, incremental
        )
        directory = storage.resolve(metadata.checkpoint_id)
        total = sum(
            file.size
            for handle in metadata.operators["op"].keyed_handles()
            for file in handle.files()
        )
        variant = "incremental" if incremental else "full"
        for new, sub in RESCALES:
            plan = plan_restore(metadata, "op", new)[sub]
            share = total * len(plan.key_group_range) / MAX_PARALLELISM
            backend = new_backend(
                workdir / f"new-{location.name}-{size_mb}-{variant}-{new}", new, sub
            )
            before = storage.fs.bytes_read
            started = time.perf_counter()
            entries = restore_keyed_state(backend, storage.fs, directory, metadata, "op")
            seconds = time.perf_counter() - started
            read = storage.fs.bytes_read - before
            backend.dispose()
            raw_seconds, raw_bytes = raw_download_seconds(storage, directory, metadata, new, sub)
            label = f"restore {variant} 4->{new} ({sub})"
            if not incremental:
                results.append(
                    Result(
                        f"{label} bytes",
                        location.name,
                        size_mb,
                        round(read / MB, 2),
                        "MB",
                        round(share / MB, 2),
                        "fair share of state",
                        round(read / share, 3),
                        "<= 1.2",
                        read / share <= 1.2,
                        f"{entries} entries copied, key groups {plan.key_group_range.start}.."
                        f"{plan.key_group_range.end}",
                    )
                )
            ratio = seconds / raw_seconds
            results.append(
                Result(
                    f"{label} time",
                    location.name,
                    size_mb,
                    round(seconds, 3),
                    "s",
                    round(raw_seconds, 3),
                    "raw fsspec download",
                    round(ratio, 2),
                    "<= 2x",
                    ratio <= 2,
                    f"raw read {raw_bytes / MB:.1f} MB; restore {raw_bytes / MB / seconds:.0f} "
                    f"MB/s; {entries} entries copied",
                )
            )
        storage.fs.delete(storage.layout.job_dir, recursive=True)
        storage.close()
    return results


def print_table(results: list[Result]) -> None:
    """A readable table of all results."""
    header = (
        f"{'benchmark':<36} {'storage':<7} {'size':>7} {'figure':>10} {'unit':<5} "
        f"{'limit':>10} {'limit is':<25} {'ratio':>7} {'target':<9} {'ok':<4} detail"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        ok = "-" if r.ok is None else ("yes" if r.ok else "NO")
        print(
            f"{r.benchmark:<36} {r.storage:<7} {str(r.size_mb) + ' MB':>7} {r.figure:>10} "
            f"{r.unit:<5} {r.limit:>10} {r.limit_name:<25} {r.ratio:>7} {r.target:<9} "
            f"{ok:<4} {r.detail}"
        )


def storage_kinds(text: str) -> list[str]:
    """The storage kinds named by ``--storage``: ``both`` is file and s3; anything else
    than file, s3 and both is an argparse error naming it."""
    kinds: list[str] = []
    for name in (part.strip() for part in text.split(",") if part.strip()):
        if name not in ("file", "s3", "both"):
            raise argparse.ArgumentTypeError(f"unknown storage {name!r}: use file, s3 or both")
        kinds += ["file", "s3"] if name == "both" else [name]
    if not kinds:
        raise argparse.ArgumentTypeError("no storage given: use file, s3 or both")
    return kinds


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table, or with ``--json`` one JSON object per result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,100,1000", help="state sizes in MB")
    parser.add_argument("--value-bytes", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5, help="snapshots per size for (a)")
    parser.add_argument("--compression", default="none", choices=["none", "lz4", "zstd"])
    parser.add_argument(
        "--storage",
        default="both",
        type=storage_kinds,
        help="where to write: file, s3, both, or a comma-separated list (default both)",
    )
    parser.add_argument(
        "--parts",
        default="upload,restore",
        help="what to measure: upload ((a) and (b)), restore ((c)), or both (default)",
    )
    parser.add_argument("--workdir", default=None, help="local scratch directory")
    parser.add_argument("--json", action="store_true", help="one JSON object per result")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    kinds = args.storage
    parts = {part.strip() for part in args.parts.split(",")}
    if not parts or parts - {"upload", "restore"}:
        parser.error(f"--parts {args.parts!r}: use upload, restore or upload,restore")
    values = Values(args.value_bytes)
    workdir = Path(tempfile.mkdtemp(prefix="bench-snapshot-", dir=args.workdir))
    results: list[Result] = []
    try:
        with local_s3() as s3:
            locations = []
            if "file" in kinds:
                locations.append(Location("file", (workdir / "checkpoints").as_uri(), {}))
            if "s3" in kinds:
                locations.append(s3)
            for size in sizes:
                new = []
                if "upload" in parts:
                    new += bench_sync_and_upload(
                        size,
                        locations,
                        workdir,
                        values,
                        max(args.repeat, len(locations)),
                        args.compression,
                    )
                if "restore" in parts:
                    new += bench_restore(size, locations, workdir, values, args.compression)
                for result in new:
                    if args.json:
                        print(json.dumps(asdict(result)), flush=True)
                results += new
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.json:
        print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
