"""Spark's own keyed state on the benchmark workload: the limit statebackend is compared with.

Workload: N events `(user, amount)` over K users; per user, keep the count and the sum of
`amount`; process in micro-batches of exactly B events. Events are written as one parquet
file per micro-batch and read by a file stream with `maxFilesPerTrigger=1`, run with
`trigger(availableNow=True)` in local[2] with the RocksDB state store provider (which
`transformWithStateInPandas` requires; `applyInPandasWithState` uses it too, so both
strategies use the same store). Each run's final per-user values are checked against a
plain-Python computation.

Run standalone: `python scripts/bench/spark_baseline.py [--events N --keys K --batch-size B]
[--json]`. Both strategies pay a per-user-per-batch cost of several milliseconds (a pandas
DataFrame in and out of Python for each group), so the time grows with the number of
distinct users per batch; the defaults (N=20k, K=2k, B=5k) take about 2 minutes in all on
2 cores, while N=200k, K=20k, B=50k takes several minutes per strategy. Import
`run_baselines` (or `run_strategy`) from `scripts/bench/spark_state.py` to get the same
numbers within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.streaming.stateful_processor import (
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)

# Python workers cannot import this file (it is not in an installed package), so its
# functions and classes must travel to them by value, also when another script imports it.
if __name__ != "__main__":
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
EVENT_SCHEMA = "user LONG, amount LONG"
OUTPUT_SCHEMA = "user LONG, count LONG, total LONG"
STATE_SCHEMA = "count LONG, total LONG"

Totals = dict[int, tuple[int, int]]


class BaselineResult(NamedTuple):
    """One timed run: events processed, wall seconds from query start to end, and the rate."""

    events: int
    seconds: float
    events_per_second: float


class Workload(NamedTuple):
    """The generated events (as arrays) and the expected per-user (count, sum)."""

    users: np.ndarray
    amounts: np.ndarray
    expected: Totals


def make_workload(events: int, keys: int, seed: int = 0) -> Workload:
    """Generate `events` events over `keys` users and compute the expected totals in Python."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, keys, size=events, dtype=np.int64)
    amounts = rng.integers(1, 1000, size=events, dtype=np.int64)
    return Workload(users, amounts, expected_totals(users.tolist(), amounts.tolist()))


def expected_totals(users: list[int], amounts: list[int]) -> Totals:
    """Per-user (count, sum of amount), computed with a plain Python loop."""
    totals: dict[int, list[int]] = {}
    for user, amount in zip(users, amounts, strict=True):
        entry = totals.setdefault(user, [0, 0])
        entry[0] += 1
        entry[1] += amount
    return {user: (count, total) for user, (count, total) in totals.items()}


def write_event_files(workload: Workload, batch_size: int, directory: Path) -> int:
    """Write the events as parquet files of `batch_size` events each; return the file count."""
    directory.mkdir(parents=True, exist_ok=True)
    files = math.ceil(len(workload.users) / batch_size)
    for i in range(files):
        chunk = slice(i * batch_size, (i + 1) * batch_size)
        table = pa.table({"user": workload.users[chunk], "amount": workload.amounts[chunk]})
        pq.write_table(table, directory / f"batch-{i:06d}.parquet")
    return files


def create_session(shuffle_partitions: int = 2) -> SparkSession:
    """A local[2] session set up for the baselines (RocksDB state store, quiet logs)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("statebackend-spark-baseline")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
        .config("spark.sql.streaming.numRecentProgressUpdates", "100000")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark


def _count_sum_with_state(
    key: tuple[Any, ...], frames: Iterator[pd.DataFrame], state: GroupState
) -> Iterator[pd.DataFrame]:
    count, total = state.get if state.exists else (0, 0)
    for frame in frames:
        count += len(frame)
        total += int(frame["amount"].sum())
    state.update((count, total))
    yield pd.DataFrame({"user": [key[0]], "count": [count], "total": [total]})


class CountSumProcessor(StatefulProcessor):
    """transformWithStateInPandas processor keeping (count, total) in one ValueState."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        """Register the per-user value state."""
        self.totals = handle.getValueState("totals", STATE_SCHEMA)

    def handleInputRows(
        self, key: Any, rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        """Add this batch's events of one user to its state and emit the new totals."""
        count, total = self.totals.get() if self.totals.exists() else (0, 0)
        for frame in rows:
            count += len(frame)
            total += int(frame["amount"].sum())
        self.totals.update((count, total))
        yield pd.DataFrame({"user": [key[0]], "count": [count], "total": [total]})

    def close(self) -> None:
        """Nothing to release."""


def _apply_in_pandas_with_state(events: DataFrame) -> DataFrame:
    return events.groupBy("user").applyInPandasWithState(
        _count_sum_with_state,
        outputStructType=OUTPUT_SCHEMA,
        stateStructType=STATE_SCHEMA,
        outputMode="update",
        timeoutConf=GroupStateTimeout.NoTimeout,
    )


def _transform_with_state_in_pandas(events: DataFrame) -> DataFrame:
    return events.groupBy("user").transformWithStateInPandas(
        statefulProcessor=CountSumProcessor(),
        outputStructType=OUTPUT_SCHEMA,
        outputMode="Update",
        timeMode="None",
    )


STRATEGIES: dict[str, Callable[[DataFrame], DataFrame]] = {
    "applyInPandasWithState": _apply_in_pandas_with_state,
    "transformWithStateInPandas": _transform_with_state_in_pandas,
}


def run_strategy(
    spark: SparkSession,
    strategy: str,
    input_dir: Path,
    checkpoint_dir: Path,
    expected: Totals,
    batch_size: int,
) -> BaselineResult:
    """Run one strategy over the files in `input_dir` to the end, verify, and time it.

    Raises:
        RuntimeError: the micro-batches were not of `batch_size` events (the last may be
            smaller), or the final per-user totals differ from `expected`.
    """
    latest: Totals = {}

    def collect_updates(batch: DataFrame, batch_id: int) -> None:
        table = batch.toArrow()
        for user, count, total in zip(
            table["user"].to_pylist(),
            table["count"].to_pylist(),
            table["total"].to_pylist(),
            strict=True,
        ):
            latest[user] = (count, total)

    events = (
        spark.readStream.schema(EVENT_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(input_dir))
    )
    started = time.perf_counter()
    query = (
        STRATEGIES[strategy](events)
        .writeStream.outputMode("update")
        .option("checkpointLocation", str(checkpoint_dir))
        .foreachBatch(collect_updates)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    seconds = time.perf_counter() - started

    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"] > 0]
    total_events = sum(sizes)
    if any(size != batch_size for size in sizes[:-1]) or total_events != sum(
        count for count, _ in expected.values()
    ):
        raise RuntimeError(f"{strategy}: micro-batch sizes {sizes} do not split the input by B")
    if latest != expected:
        wrong = [u for u in expected.keys() | latest.keys() if latest.get(u) != expected.get(u)]
        raise RuntimeError(
            f"{strategy}: {len(wrong)} users differ from the Python computation, e.g. "
            + ", ".join(f"{u}: {latest.get(u)} != {expected.get(u)}" for u in wrong[:3])
        )
    return BaselineResult(total_events, seconds, total_events / seconds)


def warmup_sizes(keys: int, batch: int) -> dict[str, int]:
    """The untimed warm-up of every engine: two batches of half the timed batch size over as
    many keys as the timed run has (at most one per warm-up event). A tiny warm-up leaves
    the JVM's per-row paths interpreted, and the first engine to run at full size then pays
    their compilation, which makes the order of the engines decide their ratio."""
    half = max(batch // 2, 1)
    return {"events": 2 * half, "keys": min(keys, 2 * half), "batch": half}


def run_baselines(
    events: int,
    keys: int,
    batch_size: int,
    seed: int = 0,
    strategies: tuple[str, ...] = tuple(STRATEGIES),
    spark: SparkSession | None = None,
    warmup: bool = True,
) -> dict[str, BaselineResult]:
    """Run each strategy on the same generated workload; return its result by name.

    With `warmup`, each strategy first runs untimed on the input of `warmup_sizes`, so the
    first timed strategy does not also pay for JVM warm-up and starting the Python
    workers. A session is created (and stopped) if none is given.
    """
    own_session = spark is None
    session = create_session() if spark is None else spark
    workdir = Path(tempfile.mkdtemp(prefix="spark-baseline-"))
    try:
        if warmup:
            sizes = warmup_sizes(keys, batch_size)
            small = make_workload(sizes["events"], sizes["keys"], seed + 1)
            write_event_files(small, sizes["batch"], workdir / "warmup-input")
            for name in strategies:
                run_strategy(
                    session,
                    name,
                    workdir / "warmup-input",
                    workdir / f"warmup-{name}",
                    small.expected,
                    sizes["batch"],
                )
        workload = make_workload(events, keys, seed)
        write_event_files(workload, batch_size, workdir / "input")
        return {
            name: run_strategy(
                session,
                name,
                workdir / "input",
                workdir / f"checkpoint-{name}",
                workload.expected,
                batch_size,
            )
            for name in strategies
        }
    finally:
        if own_session:
            session.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """Command line: run the baselines and print a table (or JSON lines with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="N events")
    parser.add_argument("--keys", type=int, default=2_000, help="K distinct users")
    parser.add_argument("--batch-size", type=int, default=5_000, help="B events per batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--strategy", choices=list(STRATEGIES), action="append", help="default: all"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per result")
    args = parser.parse_args(argv)

    results = run_baselines(
        args.events,
        args.keys,
        args.batch_size,
        args.seed,
        tuple(args.strategy or STRATEGIES),
    )
    workload = {"events": args.events, "keys": args.keys, "batch_size": args.batch_size}
    if args.json:
        for name, result in results.items():
            print(
                json.dumps(
                    {
                        "benchmark": "spark_baseline",
                        "strategy": name,
                        **workload,
                        **result._asdict(),
                    }
                )
            )
        return
    print(f"Spark state baseline: N={args.events} K={args.keys} B={args.batch_size}, local[2]")
    print(f"{'strategy':<28} {'events':>10} {'seconds':>9} {'events/s':>11}")
    for name, result in results.items():
        print(
            f"{name:<28} {result.events:>10} {result.seconds:>9.2f} "
            f"{result.events_per_second:>11.0f}"
        )


if __name__ == "__main__":
    main()
