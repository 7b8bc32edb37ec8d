"""Growth curve: sync pause, upload, restore, rescale 4->8, RSS and checkpoint bytes
against state size — RocksDB backend.

For each state size (``--sizes``, in keys: 10k, 100k, 1m, 10m; values of
``--value-bytes`` random bytes, so 10m keys of 100 B are about 1-2 GB) a fresh child
process (so that each size's RSS is its own) bounds RocksDB's memory as the runtime does
(``spark.statebackend.rocksdb.memory``, ``--rocksdb-memory``), opens 4 keyed subtasks
(RocksDB backends of one operator), writes the keys in batches and flushes them (as the
earlier checkpoints of a running job would have), and then for each format (``--format
full,incremental``), after fresh writes of 2000 keys to the memtables:

- the synchronous cut of a checkpoint of the 4 subtasks (ms, the slowest of the 4: the
  median over the measured checkpoint and ``--pause-repeat`` more whose uploads are
  cancelled, and the worst of all);
- the upload (s, the sum over the subtasks, each from its cut returning to its handle;
  the subtasks are checkpointed one after the other) to ``--storage``
  (``file://``, or S3 on a moto server on 127.0.0.1), and the checkpoint's bytes;
- restore at the same parallelism (s: total of the 4 subtasks one after the other, and
  the slowest), and the rescale 4->8 (the same for the 8 new subtasks); each restored
  backend's keys are counted afterwards (not timed), so a row shows that all K came back;
- the process's peak RSS during the size (fill and every format), and above its RSS
  before the first database opened (also up to the end of the fill alone).

It prints a table with the time per GB of checkpoint of the upload and of the restores,
and the targets' verdicts: sync pause <= 50 ms at every size; upload and restore time
per GB within 1.5x across sizes (max / min per format; also given over the
checkpoints of >= 100 MB, where fixed costs no longer dominate). ``--plot FILE.png`` draws each
measure against state size (needs matplotlib: ``pip install 'statebackend[bench]'``).

    .venv/bin/python scripts/bench/scale.py [--sizes 10k,100k,1m,10m] [--quick]
        [--value-bytes 100] [--pause-repeat 4] [--format full,incremental] [--storage file]
        [--rocksdb-memory 512m] [--plot docs/img/scale.png] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import snapshot as snapshot_bench  # noqa: E402
from memory import PeakRss  # noqa: E402

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend, set_memory_limit  # noqa: E402
from statebackend.checkpoint.coordinator import CheckpointCoordinator  # noqa: E402
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck  # noqa: E402
from statebackend.checkpoint.restore import restore_keyed_state  # noqa: E402
from statebackend.checkpoint.storage import CheckpointStorage  # noqa: E402
from statebackend.errors import CheckpointError  # noqa: E402
from statebackend.spark.conf import DEFAULT_ROCKSDB_MEMORY, parse_memory_size  # noqa: E402

OLD_PARALLELISM = 4
NEW_PARALLELISM = 8
FORMATS = ("full", "incremental")
TOUCHED_KEYS = 2000
"""Keys rewritten before each cut, so that it has a memtable to flush."""
PAUSE_ROUND_BASE = 1000
"""Checkpoint ids (and value rounds) of the cuts measured for the pause only."""
SYNC_PAUSE_TARGET_MS = 50.0
PER_GB_SPREAD_TARGET = 1.5
LARGE_CHECKPOINT_BYTES = 100 << 20
"""The verdicts also give the time-per-GB spread over checkpoints of at least this size,
where fixed per-checkpoint costs no longer dominate."""
GB = 1 << 30
MB = 1 << 20
_UNITS = {"": 1, "k": 1000, "m": 1000_000}


@dataclass
class Row:
    """The measures of one state size in one checkpoint format."""

    keys: int
    format: str
    storage: str
    value_bytes: int
    fill_s: float
    sync_pause_ms: float
    """The median over the checkpoints measured of the slowest of the 4 subtasks' cuts."""
    sync_pause_worst_ms: float
    """The slowest cut of all."""
    upload_s: float
    checkpoint_bytes: int
    restore_s: float
    """The 4 subtasks' restores at the same parallelism, one after the other."""
    restore_max_s: float
    restored_keys: int
    rescale_s: float
    """The 8 subtasks' restores of the rescale 4->8, one after the other."""
    rescale_max_s: float
    rescaled_keys: int
    rss_peak_mb: float
    rss_growth_mb: float
    """Peak RSS above the RSS before the first database opened."""
    rss_fill_growth_mb: float
    """The same, up to the end of the fill (before any checkpoint or restore)."""

    def per_gb(self, seconds: float) -> float:
        """``seconds`` per GB of this checkpoint."""
        return seconds / (self.checkpoint_bytes / GB)


def parse_sizes(text: str) -> list[int]:
    """Key counts such as ``10k,100k,1m,10m`` (or plain numbers); argparse error otherwise."""
    sizes = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        unit = part[-1:] if part[-1:].isalpha() else ""
        try:
            count = int(part[: len(part) - len(unit)]) * _UNITS[unit]
        except (ValueError, KeyError):
            count = 0
        if count <= 0:
            raise argparse.ArgumentTypeError(
                f"size {part!r} is invalid: give key counts such as 10k,100k,1m,10m"
            )
        sizes.append(count)
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given: give key counts such as 10k,1m")
    return sizes


def parse_formats(text: str) -> list[str]:
    """Formats named by ``--format``: full, incremental or both comma-separated."""
    formats = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in formats if name not in FORMATS]
    if unknown or not formats:
        raise argparse.ArgumentTypeError(
            f"format {','.join(unknown) or text!r} is invalid: use full, incremental or both"
        )
    return formats


def count_keys(backend: RocksDBKeyedStateBackend) -> int:
    """How many keys have state in ``backend``."""
    return sum(1 for _ in backend.keys(snapshot_bench.STATE.name))


def checkpoint(
    backends: list[RocksDBKeyedStateBackend], storage: CheckpointStorage
) -> tuple[CheckpointMetadata, float, float, int]:
    """A completed checkpoint of ``backends``, one subtask after the other (so that no
    upload runs beside a cut it would slow down): its metadata, the slowest sync cut (s),
    the upload (s, the sum over subtasks of cut returned to handle) and its files' bytes."""
    coordinator = CheckpointCoordinator(storage, max_parallelism=snapshot_bench.MAX_PARALLELISM)
    checkpoint_id = coordinator.trigger({"op": len(backends)})
    pauses, uploads, size = [], [], 0
    for i, backend in enumerate(backends):
        target = storage.snapshot_target(checkpoint_id, "op", i)
        started = time.perf_counter()
        future = backend.snapshot(checkpoint_id, target)
        returned = time.perf_counter()
        handle = future.result()
        uploads.append(time.perf_counter() - returned)
        pauses.append(returned - started)
        size += sum(file.size for file in handle.files())
        ack = SubtaskAck("op", i, len(backends), handle, None, coordinator.run_id)
        storage.write_ack(checkpoint_id, ack)
    assert coordinator.poll(checkpoint_id) is not None
    return storage.load(checkpoint_id), max(pauses), sum(uploads), size


def pause_rounds(
    backends: list[RocksDBKeyedStateBackend],
    storage: CheckpointStorage,
    rounds: int,
    values: snapshot_bench.Values,
    touched: int,
) -> list[float]:
    """The slowest sync cut (s) of each of ``rounds`` more checkpoints, each after fresh
    writes to ``touched`` existing keys; their uploads are cancelled, their files deleted."""
    pauses = []
    for round_ in range(rounds):
        snapshot_bench.fill(backends, touched, values, PAUSE_ROUND_BASE + round_)
        checkpoint_id = PAUSE_ROUND_BASE + round_
        slowest = 0.0
        for i, backend in enumerate(backends):
            target = storage.snapshot_target(checkpoint_id, "op", i)
            started = time.perf_counter()
            future = backend.snapshot(checkpoint_id, target)
            slowest = max(slowest, time.perf_counter() - started)
            future.cancel()
            with suppress(CheckpointError):
                future.result()
        storage.discard(checkpoint_id)
        pauses.append(slowest)
    return pauses


def restore_all(
    storage: CheckpointStorage, metadata: CheckpointMetadata, parallelism: int, workdir: Path
) -> tuple[float, float, int]:
    """Restore every subtask of ``parallelism`` from the checkpoint, one after the other:
    the total and the slowest restore (s), and the keys restored (counted untimed)."""
    directory = storage.resolve(metadata.checkpoint_id)
    times, keys = [], 0
    for i in range(parallelism):
        backend = snapshot_bench.new_backend(workdir / f"restore-{parallelism}-{i}", parallelism, i)
        try:
            started = time.perf_counter()
            restore_keyed_state(backend, storage.fs, directory, metadata, "op")
            times.append(time.perf_counter() - started)
            keys += count_keys(backend)
        finally:
            backend.dispose()
    return sum(times), max(times), keys


def measure_size(
    keys: int,
    formats: list[str],
    location: snapshot_bench.Location,
    value_bytes: int,
    pause_repeat: int,
    rocksdb_memory: int | None,
    workdir: str,
    out: Any,
) -> None:
    """Child process: every measure of one state size; puts its rows (dicts) on ``out``."""
    set_memory_limit(rocksdb_memory)
    values = snapshot_bench.Values(value_bytes)
    root = Path(workdir)
    partial: list[dict[str, Any]] = []
    with PeakRss() as rss:
        backends = [
            snapshot_bench.new_backend(root / f"old-{i}", OLD_PARALLELISM, i)
            for i in range(OLD_PARALLELISM)
        ]
        try:
            started = time.perf_counter()
            snapshot_bench.fill(backends, keys, values)
            for backend in backends:  # as earlier checkpoints of a running job would have
                backend._db.flush()
            fill_s = time.perf_counter() - started
            fill_growth = rss.peak - rss.base
            touched = min(keys, TOUCHED_KEYS)
            for round_, name in enumerate(formats, start=1):
                snapshot_bench.fill(backends, touched, values, round_)
                storage = CheckpointStorage(
                    location.url,
                    f"scale-{keys}-{name}",
                    storage_options=location.options,
                    incremental=name == "incremental",
                )
                try:
                    metadata, pause, upload, size = checkpoint(backends, storage)
                    more = pause_rounds(backends, storage, pause_repeat, values, touched)
                    pauses = [pause, *more]
                    restore = restore_all(storage, metadata, OLD_PARALLELISM, root)
                    rescale = restore_all(storage, metadata, NEW_PARALLELISM, root)
                    storage.fs.delete(storage.layout.job_dir, recursive=True)
                finally:
                    storage.close()
                partial.append(
                    {
                        "keys": keys,
                        "format": name,
                        "storage": location.name,
                        "value_bytes": value_bytes,
                        "fill_s": round(fill_s, 2),
                        "sync_pause_ms": round(statistics.median(pauses) * 1000, 2),
                        "sync_pause_worst_ms": round(max(pauses) * 1000, 2),
                        "upload_s": round(upload, 3),
                        "checkpoint_bytes": size,
                        "restore_s": round(restore[0], 3),
                        "restore_max_s": round(restore[1], 3),
                        "restored_keys": restore[2],
                        "rescale_s": round(rescale[0], 3),
                        "rescale_max_s": round(rescale[1], 3),
                        "rescaled_keys": rescale[2],
                    }
                )
        finally:
            for backend in backends:
                backend.dispose()
    for row in partial:
        row["rss_peak_mb"] = round(rss.peak / MB, 1)
        row["rss_growth_mb"] = round((rss.peak - rss.base) / MB, 1)
        row["rss_fill_growth_mb"] = round(fill_growth / MB, 1)
    out.put(partial)


def run_size(
    keys: int,
    formats: list[str],
    location: snapshot_bench.Location,
    value_bytes: int,
    pause_repeat: int,
    rocksdb_memory: int | None,
    workdir: str | None,
) -> list[Row]:
    """The rows of one state size, measured in a fresh child process."""
    scratch = tempfile.mkdtemp(prefix=f"bench-scale-{keys}-", dir=workdir)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    args = (keys, formats, location, value_bytes, pause_repeat, rocksdb_memory, scratch, out)
    child = context.Process(target=measure_size, args=args)
    try:
        child.start()
        while True:
            try:
                rows = out.get(timeout=5)
                break
            except queue.Empty:  # keep waiting while the child lives
                if not child.is_alive():
                    raise RuntimeError(
                        f"the measuring process of {keys} keys died (exit code "
                        f"{child.exitcode}): see its traceback above"
                    ) from None
        child.join()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return [Row(**row) for row in rows]


def spread(rows: list[Row], seconds: str) -> float:
    """Max over min of the time per GB of measure ``seconds`` across ``rows``."""
    per_gb = [row.per_gb(getattr(row, seconds)) for row in rows]
    return max(per_gb) / min(per_gb)


def verdicts(rows: list[Row]) -> list[str]:
    """One line per target and format: the measured figure and ok / NO."""
    lines = []
    for name in dict.fromkeys(row.format for row in rows):
        mine = [row for row in rows if row.format == name]
        worst = max(row.sync_pause_ms for row in mine)
        ok = worst <= SYNC_PAUSE_TARGET_MS
        lines.append(
            f"{name}: sync pause <= {SYNC_PAUSE_TARGET_MS:.0f} ms at every size: "
            f"max {worst:.1f} ms -> {'ok' if ok else 'NO'}"
        )
        for label, measure in (
            ("upload", "upload_s"),
            ("restore", "restore_s"),
            ("rescale 4->8", "rescale_s"),
        ):
            if len(mine) < 2:
                continue  # one size: nothing to compare
            ratio = spread(mine, measure)
            ok = ratio <= PER_GB_SPREAD_TARGET
            large = [row for row in mine if row.checkpoint_bytes >= LARGE_CHECKPOINT_BYTES]
            beyond = (
                f" (checkpoints >= 100 MB: {spread(large, measure):.2f}x)" if len(large) > 1 else ""
            )
            lines.append(
                f"{name}: {label} time per GB within {PER_GB_SPREAD_TARGET}x across sizes: "
                f"max/min {ratio:.2f}x{beyond} -> {'ok' if ok else 'NO'}"
            )
    return lines


def print_table(rows: list[Row]) -> None:
    """The table of all rows, then the verdicts."""
    header = (
        f"{'keys':>10} {'format':<11} {'storage':<7} {'ckpt MB':>9} {'sync ms':>8} "
        f"{'worst':>7} {'upload s':>9} {'s/GB':>6} {'restore s':>10} {'max':>7} {'s/GB':>6} "
        f"{'4->8 s':>8} {'max':>7} {'s/GB':>6} {'restored':>10} {'rescaled':>10} "
        f"{'RSS MB':>7} {'growth':>7} {'at fill':>7} {'fill s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.keys:>10} {r.format:<11} {r.storage:<7} {r.checkpoint_bytes / MB:>9.1f} "
            f"{r.sync_pause_ms:>8.2f} {r.sync_pause_worst_ms:>7.1f} {r.upload_s:>9.3f} "
            f"{r.per_gb(r.upload_s):>6.1f} "
            f"{r.restore_s:>10.3f} {r.restore_max_s:>7.3f} {r.per_gb(r.restore_s):>6.1f} "
            f"{r.rescale_s:>8.3f} {r.rescale_max_s:>7.3f} {r.per_gb(r.rescale_s):>6.1f} "
            f"{r.restored_keys:>10} {r.rescaled_keys:>10} {r.rss_peak_mb:>7.0f} "
            f"{r.rss_growth_mb:>7.0f} {r.rss_fill_growth_mb:>7.0f} {r.fill_s:>7.1f}"
        )
    print()
    for line in verdicts(rows):
        print(line)


def plot(rows: list[Row], path: str) -> None:
    """A PNG at ``path``: one panel per measure against state size (log x), a line per
    format. Raises SystemExit naming what to install when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'statebackend[bench]' (or pip install matplotlib)"
        ) from None
    panels = (
        ("sync pause (ms, median of slowest of 4)", lambda r: r.sync_pause_ms),
        ("upload (s)", lambda r: r.upload_s),
        ("restore at 4 (s, total)", lambda r: r.restore_s),
        ("rescale 4->8 (s, total)", lambda r: r.rescale_s),
        ("peak RSS (MB)", lambda r: r.rss_peak_mb),
        ("checkpoint (MB)", lambda r: r.checkpoint_bytes / MB),
        ("upload time per GB (s)", lambda r: r.per_gb(r.upload_s)),
        ("restore at 4 time per GB (s)", lambda r: r.per_gb(r.restore_s)),
    )
    figure, axes = plt.subplots(2, 4, figsize=(17, 7.5))
    for axis, (title, measure) in zip(axes.flat, panels, strict=True):
        for name in dict.fromkeys(row.format for row in rows):
            mine = sorted((row for row in rows if row.format == name), key=lambda r: r.keys)
            axis.plot([r.keys for r in mine], [measure(r) for r in mine], marker="o", label=name)
        axis.set_xscale("log")
        if "sync" in title:
            axis.axhline(SYNC_PAUSE_TARGET_MS, color="red", linestyle="--", label="target")
            axis.set_ylim(bottom=0)
        else:
            axis.set_yscale("log")
        axis.set_title(title)
        axis.set_xlabel("keys")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    sample = rows[0]
    figure.suptitle(
        f"statebackend growth curve: 4 RocksDB subtasks, {sample.value_bytes} B values, "
        f"{sample.storage} storage"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table and verdicts, or with ``--json`` one JSON
    object per row; with ``--plot`` also write the PNG."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10k,100k,1m,10m", type=parse_sizes)
    parser.add_argument("--quick", action="store_true", help="a smoke run: sizes 10k,100k")
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument(
        "--pause-repeat", type=int, default=4, help="more cuts per format for the pause only"
    )
    parser.add_argument(
        "--format", default="full,incremental", type=parse_formats, help="full, incremental"
    )
    parser.add_argument(
        "--storage", default="file", choices=["file", "s3"], help="file://, or S3 on moto"
    )
    parser.add_argument(
        "--rocksdb-memory",
        default=f"{DEFAULT_ROCKSDB_MEMORY >> 20}m",
        help="the bound of spark.statebackend.rocksdb.memory (or unbounded)",
    )
    parser.add_argument("--plot", default=None, help="write a PNG of the curves here")
    parser.add_argument("--workdir", default=None, help="local scratch directory")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args(argv)
    sizes = parse_sizes("10k,100k") if args.quick else args.sizes
    memory = parse_memory_size("--rocksdb-memory", args.rocksdb_memory)
    rows: list[Row] = []
    with snapshot_bench.local_s3() if args.storage == "s3" else nullcontext() as s3:
        checkpoints = Path(tempfile.mkdtemp(prefix="bench-scale-checkpoints-", dir=args.workdir))
        location = s3 or snapshot_bench.Location("file", checkpoints.as_uri(), {})
        try:
            for keys in sizes:
                new = run_size(
                    keys,
                    args.format,
                    location,
                    args.value_bytes,
                    args.pause_repeat,
                    memory,
                    args.workdir,
                )
                for row in new:
                    if args.json:
                        print(json.dumps(asdict(row)), flush=True)
                    else:
                        snapshot_bench.log(f"{keys} keys {row.format}: {asdict(row)}")
                rows += new
        finally:
            shutil.rmtree(checkpoints, ignore_errors=True)
    if not args.json:
        print_table(rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
