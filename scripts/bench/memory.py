"""RocksDB memory benchmark: process RSS with many keys over 4 subtasks, bounded or not.

Runs the workload in a fresh child process per setting (so that each RSS is its own):
4 RocksDB backends (4 subtasks of one operator, as an executor Python worker holds
them), ``--keys`` keys of ``--value-bytes`` random bytes written round-robin, then every
key read back once in random order (which fills the block cache). It reports the peak
RSS of the process above its RSS before the first database opened, beside the bound
(``spark.statebackend.rocksdb.memory``, ``set_memory_limit``). Target: the growth stays
under the bound +20%. ``unbounded`` (RocksDB's defaults per database) is measured too,
as the reference.

    .venv/bin/python scripts/bench/memory.py [--keys 2000000] [--value-bytes 100]
        [--limits 64m,256m] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, cast

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend, set_memory_limit
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import BytesSerializer, StrSerializer
from statebackend.spark.conf import parse_memory_size
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState

MAX_PARALLELISM = 128
SUBTASKS = 4
MB = 1 << 20
STATE = ValueStateDescriptor("payload", BytesSerializer())


def rss_bytes() -> int:
    """This process's resident set size (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status: this benchmark needs Linux")


class PeakRss:
    """This process's RSS before the block (``base``) and its peak during it (``peak``),
    sampled every 50 ms by a thread and once more when the block ends."""

    def __init__(self) -> None:
        self.base = rss_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakRss:
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sampler.join()
        self.peak = max(self.peak, rss_bytes())


def workload(limit: int | None, keys: int, value_bytes: int, workdir: str, out: Any) -> None:
    """Child process: the workload under ``limit``; puts its figures on ``out``."""
    set_memory_limit(limit)
    with PeakRss() as rss:
        figures = _fill_and_read(keys, value_bytes, workdir)
    out.put({"base": rss.base, "peak": rss.peak, **figures})


def _fill_and_read(keys: int, value_bytes: int, workdir: str) -> dict[str, float]:
    """The workload: write ``keys`` keys over 4 backends, read each back once; returns
    the seconds the writes took and the databases' bytes on disk."""
    backends = [
        RocksDBKeyedStateBackend(
            Path(workdir) / f"subtask-{i}",
            max_parallelism=MAX_PARALLELISM,
            key_group_range=compute_key_group_range_for_operator_index(
                MAX_PARALLELISM, SUBTASKS, i
            ),
        )
        for i in range(SUBTASKS)
    ]
    states = [cast(ValueState, backend.get_state(STATE)) for backend in backends]
    serializer = StrSerializer()
    pool = random.Random(3).randbytes(value_bytes * 64)
    owner = [
        compute_operator_index_for_key_group(MAX_PARALLELISM, SUBTASKS, group)
        for group in range(MAX_PARALLELISM)
    ]

    def subtask(key: str) -> int:
        return owner[assign_to_key_group(serializer.serialize(key), MAX_PARALLELISM)]

    started = time.perf_counter()
    for n in range(keys):
        key = f"key-{n}"
        i = subtask(key)
        backends[i].set_current_key(key)
        offset = n % 63 * value_bytes
        states[i].update(pool[offset : offset + value_bytes])
    written = time.perf_counter() - started
    step = 1_000_003  # a permutation of the keys without a list of them in memory
    while math.gcd(step, keys) != 1:
        step += 2
    for m in range(keys):
        key = f"key-{m * step % keys}"
        i = subtask(key)
        backends[i].set_current_key(key)
        states[i].value()
    disk = sum(f.stat().st_size for f in Path(workdir).rglob("*") if f.is_file())
    for backend in backends:
        backend.dispose()
    return {"written_s": written, "disk": disk}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table, or with ``--json`` one JSON object per result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=2_000_000)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--limits", default="64m,256m", help="bounds to measure (and unbounded)")
    parser.add_argument("--workdir", default=None, help="local scratch directory")
    parser.add_argument("--json", action="store_true", help="one JSON object per result")
    args = parser.parse_args(argv)
    limits = [parse_memory_size("--limits", text) for text in args.limits.split(",") if text]
    context = multiprocessing.get_context("spawn")
    rows = []
    for limit in [*limits, None]:
        workdir = tempfile.mkdtemp(prefix="bench-memory-", dir=args.workdir)
        try:
            out = context.Queue()
            child = context.Process(
                target=workload, args=(limit, args.keys, args.value_bytes, workdir, out)
            )
            child.start()
            figures = out.get()
            child.join()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        growth = figures["peak"] - figures["base"]
        row = {
            "limit_mb": None if limit is None else limit / MB,
            "keys": args.keys,
            "value_bytes": args.value_bytes,
            "rss_growth_mb": round(growth / MB, 1),
            "ratio_to_limit": None if limit is None else round(growth / limit, 3),
            "target": "<= 1.2",
            "ok": None if limit is None else growth <= 1.2 * limit,
            "disk_mb": round(figures["disk"] / MB, 1),
            "write_s": round(figures["written_s"], 1),
        }
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print(
            f"{'bound':>10} {'keys':>10} {'RSS growth':>11} {'/ bound':>8} {'ok':<4} "
            f"{'DB on disk':>11} {'write s':>8}"
        )
        for row in rows:
            bound = "unbounded" if row["limit_mb"] is None else f"{row['limit_mb']:.0f} MB"
            ok = "-" if row["ok"] is None else ("yes" if row["ok"] else "NO")
            print(
                f"{bound:>10} {row['keys']:>10} {row['rss_growth_mb']:>8} MB "
                f"{row['ratio_to_limit'] or '-':>8} {ok:<4} {row['disk_mb']:>8} MB "
                f"{row['write_s']:>8}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
