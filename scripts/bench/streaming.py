"""Structured Streaming: our ``transform_with_state`` beside Spark's own stateful APIs.

One run, one workload (``spark_baseline``: N events ``(user, amount)`` over K users, per
user the count and the sum of ``amount``), written once as one parquet file per
micro-batch of B events into a temp dir (seed 0) and read by a file stream with
``maxFilesPerTrigger=1`` and ``trigger(availableNow=True)`` in local[2], each engine with
its own checkpoint location, all writing their output (Update mode: one row per user with
input in the batch) to the same ``foreachBatch`` sink, which keeps it as Arrow:

- ``ours-row`` / ``ours-pandas``: ``transform_with_state`` (Row / pandas mode) of a
  StatefulProcessor, state in our RocksDB backend (parallelism 2);
- ``spark-tws`` / ``spark-twsp`` / ``spark-aipws``: Spark's ``transformWithState``,
  ``transformWithStateInPandas`` and ``applyInPandasWithState``;
- ``spark-jvm-agg``: Spark's JVM-only ``groupBy("user").agg(count, sum)``;

every Spark engine with the RocksDB state store provider, 2 shuffle partitions. Each
engine first runs untimed on two batches of B/2 events (``spark_baseline.warmup_sizes``: the JVM's
parquet, shuffle, Arrow and state store paths are compiled at the timed batch size, so no
engine pays the JIT for another that runs after it; Python workers are started); every
run's final per-user values (the last output row of each user) are checked against a
plain-Python computation.

Figures: events/s (events over wall seconds from ``start()`` to the end of the query);
per-batch latency p50/p99 from ``StreamingQueryProgress.durationMs.triggerExecution``
(the whole micro-batch as Spark times it: for ours, the foreachBatch call that shuffles,
runs the keyed subtasks, commits and publishes); bytes written per batch: the bytes of
files created or grown in the engine's durable directories (Spark's checkpointLocation,
and for ours also its ``spark.statebackend.checkpoint.dir``), sampled by the sink after
each batch and once after the query ended, divided by the batches. Executor-local working
directories (both sides keep a local RocksDB) are not counted; a file created and deleted
between two samples is missed.

    python scripts/bench/streaming.py [--events N --keys K --batch B]
        [--engines ours-row,spark-jvm-agg,...] [--rounds R] [--quick] [--json]

Prints a table with the ratios to the JVM aggregation and to the fastest Spark Python API
(targets: ours >= 10x the fastest Spark Python API, >= 1.0x the JVM aggregation at K=200k,
per-batch latency at K=2k no worse than ``transformWithStateInPandas``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark import cloudpickle
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.stateful_processor import (
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spark_baseline  # noqa: E402

from statebackend.spark.streaming import transform_with_state  # noqa: E402

# Python workers cannot import this file: its classes travel to them by value.
if __name__ != "__main__":
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

QUICK = {"events": 2_000, "keys": 200, "batch": 1_000}
PARALLELISM = 2
JVM = "spark-jvm-agg"
SPARK_PYTHON = ("spark-tws", "spark-twsp", "spark-aipws")
PROVIDER_KEY = "spark.sql.streaming.stateStore.providerClass"
CHECKPOINT_DIR_KEY = "spark.statebackend.checkpoint.dir"
LOCAL_DIR_KEY = "spark.statebackend.local.dir"
SESSION_KEYS = (PROVIDER_KEY, CHECKPOINT_DIR_KEY, LOCAL_DIR_KEY)


class RowCountSumProcessor(StatefulProcessor):
    """transformWithState (Row mode) processor keeping (count, total) in one ValueState."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        """Register the per-user value state."""
        self.totals = handle.getValueState("totals", spark_baseline.STATE_SCHEMA)

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        """Add this batch's events of one user to its state and emit the new totals."""
        count, total = self.totals.get() if self.totals.exists() else (0, 0)
        for row in rows:
            count += 1
            total += row.amount
        self.totals.update((count, total))
        yield Row(user=key[0], count=count, total=total)

    def close(self) -> None:
        """Nothing to release."""


def _ours(use_pandas: bool) -> Callable[[DataFrame, str], DataFrame | Any]:
    def build(events: DataFrame, job_id: str) -> Any:
        processor = spark_baseline.CountSumProcessor() if use_pandas else RowCountSumProcessor()
        return transform_with_state(
            events,
            key_by="user",
            processor=processor,
            output_schema=spark_baseline.OUTPUT_SCHEMA,
            job_id=job_id,
            use_pandas=use_pandas,
            parallelism=PARALLELISM,
        )

    return build


def _spark_tws(events: DataFrame, job_id: str) -> DataFrame:
    return events.groupBy("user").transformWithState(
        RowCountSumProcessor(), spark_baseline.OUTPUT_SCHEMA, "Update", "None"
    )


def _jvm_agg(events: DataFrame, job_id: str) -> DataFrame:
    return events.groupBy("user").agg(
        F.count(F.lit(1)).alias("count"), F.sum("amount").alias("total")
    )


ENGINES: dict[str, Callable[[DataFrame, str], Any]] = {
    "ours-row": _ours(use_pandas=False),
    "ours-pandas": _ours(use_pandas=True),
    "spark-tws": _spark_tws,
    "spark-twsp": lambda events, _: spark_baseline.STRATEGIES["transformWithStateInPandas"](events),
    "spark-aipws": lambda events, _: spark_baseline.STRATEGIES["applyInPandasWithState"](events),
    JVM: _jvm_agg,
}


@dataclass
class EngineResult:
    """One engine's timed run."""

    engine: str
    events: int
    batches: int
    seconds: float
    events_per_second: float
    latency_p50_ms: float
    latency_p99_ms: float
    bytes_per_batch: float
    rounds_events_per_second: list[float] = field(default_factory=list)
    """events/s of every round's run (``--rounds``); this result is the median run's."""


class _WrittenBytes:
    """Bytes of files created or grown under some directories since the last sample."""

    def __init__(self, roots: list[Path]) -> None:
        self._roots = roots
        self._sizes: dict[str, int] = {}
        self.total = 0

    def sample(self) -> None:
        """Add what was written since the previous sample to ``total``."""
        for root in self._roots:
            for directory, _, files in os.walk(root):
                for name in files:
                    path = os.path.join(directory, name)
                    try:
                        size = os.stat(path).st_size
                    except FileNotFoundError:
                        continue
                    self.total += max(0, size - self._sizes.get(path, 0))
                    self._sizes[path] = size


def _percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def _check_totals(engine: str, tables: list[pa.Table], expected: spark_baseline.Totals) -> None:
    latest: spark_baseline.Totals = {}
    for table in tables:
        for user, count, total in zip(
            table["user"].to_pylist(),
            table["count"].to_pylist(),
            table["total"].to_pylist(),
            strict=True,
        ):
            latest[user] = (count, total)
    if latest != expected:
        wrong = [u for u in expected.keys() | latest.keys() if latest.get(u) != expected.get(u)]
        raise SystemExit(
            f"{engine}: {len(wrong)} users differ from the plain-Python totals, e.g. "
            + ", ".join(f"{u}: {latest.get(u)} != {expected.get(u)}" for u in wrong[:3])
        )


def run_engine(
    spark: SparkSession,
    engine: str,
    input_dir: Path,
    work_dir: Path,
    expected: spark_baseline.Totals,
    batch_size: int,
) -> EngineResult:
    """Run one engine over the files in ``input_dir`` to the end, verify and measure it."""
    checkpoint = work_dir / "spark-checkpoint"
    ours_dir = work_dir / "statebackend"
    spark.conf.set(CHECKPOINT_DIR_KEY, ours_dir.as_uri())
    spark.conf.set(LOCAL_DIR_KEY, str(work_dir / "local"))
    checkpoint.mkdir(parents=True)
    ours_dir.mkdir()
    written = _WrittenBytes([checkpoint, ours_dir])
    tables: list[pa.Table] = []

    def sink(batch: DataFrame, batch_id: int) -> None:
        tables.append(batch.toArrow())
        written.sample()

    events = (
        spark.readStream.schema(spark_baseline.EVENT_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(input_dir))
    )
    started = time.perf_counter()
    stateful = ENGINES[engine](events, engine)
    writer = stateful.writeStream
    if isinstance(stateful, DataFrame):  # ours takes the output mode in transform_with_state
        writer = writer.outputMode("update")
    query: StreamingQuery = (
        writer.option("checkpointLocation", str(checkpoint))
        .foreachBatch(sink)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    seconds = time.perf_counter() - started
    written.sample()

    progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
    sizes = [p["numInputRows"] for p in progress]
    total_events = sum(sizes)
    if any(size != batch_size for size in sizes[:-1]) or total_events != sum(
        count for count, _ in expected.values()
    ):
        raise SystemExit(f"{engine}: micro-batch sizes {sizes} do not split the input by B")
    _check_totals(engine, tables, expected)
    latencies = [float(p["durationMs"]["triggerExecution"]) for p in progress]
    return EngineResult(
        engine=engine,
        events=total_events,
        batches=len(progress),
        seconds=seconds,
        events_per_second=total_events / seconds,
        latency_p50_ms=statistics.median(latencies),
        latency_p99_ms=_percentile(latencies, 0.99),
        bytes_per_batch=written.total / len(progress),
    )


def _run_with_retry(
    spark: SparkSession, engine: str, input_dir: Path, work_dir: Path, *args: Any
) -> EngineResult:
    """``run_engine``, up to twice more (in a fresh directory) if Spark's Python worker
    did not connect back in time (Spark's limit, which a heavily loaded machine misses)."""
    for attempt in range(2):
        try:
            return run_engine(spark, engine, input_dir, work_dir / f"attempt-{attempt}", *args)
        except StreamingQueryException as exc:
            if "failed to connect back" not in str(exc):
                raise
            print(f"# {engine}: Python worker did not connect back; retrying", file=sys.stderr)
    return run_engine(spark, engine, input_dir, work_dir / "attempt-2", *args)


def run_all(
    spark: SparkSession,
    engines: list[str],
    events: int,
    keys: int,
    batch: int,
    seed: int = 0,
    warmup: bool = True,
    rounds: int = 1,
) -> list[EngineResult]:
    """Warm every engine up (unless ``warmup`` is False), then run each ``rounds`` times on
    the same generated files, in the given order in even rounds and in reverse order in odd
    ones (the JVM keeps getting faster for minutes, which favours whatever runs later);
    each engine's result is its median run by events/s, with every round's events/s. The
    session's ``SESSION_KEYS`` are set for the run (RocksDB state store provider, our
    directories) and restored after it."""
    work_dir = Path(tempfile.mkdtemp(prefix="statebackend-streaming-bench-"))
    saved = {key: spark.conf.get(key, None) for key in SESSION_KEYS}
    spark.conf.set(PROVIDER_KEY, spark_baseline.ROCKSDB_PROVIDER)
    try:
        if warmup:
            sizes = spark_baseline.warmup_sizes(keys, batch)
            small = spark_baseline.make_workload(sizes["events"], sizes["keys"], seed + 1)
            spark_baseline.write_event_files(small, sizes["batch"], work_dir / "warmup-input")
            for engine in engines:
                _run_with_retry(
                    spark,
                    engine,
                    work_dir / "warmup-input",
                    work_dir / f"warmup-{engine}",
                    small.expected,
                    sizes["batch"],
                )
        workload = spark_baseline.make_workload(events, keys, seed)
        spark_baseline.write_event_files(workload, batch, work_dir / "input")
        runs: dict[str, list[EngineResult]] = {engine: [] for engine in engines}
        for round_index in range(rounds):
            for engine in engines if round_index % 2 == 0 else engines[::-1]:
                result = _run_with_retry(
                    spark,
                    engine,
                    work_dir / "input",
                    work_dir / f"{engine}-{round_index}",
                    workload.expected,
                    batch,
                )
                runs[engine].append(result)
                print(
                    f"# round {round_index}: {json.dumps(asdict(result))}",
                    file=sys.stderr,
                    flush=True,
                )
        return [_median_run(runs[engine]) for engine in engines]
    finally:
        for key, value in saved.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
        shutil.rmtree(work_dir, ignore_errors=True)


def _median_run(runs: list[EngineResult]) -> EngineResult:
    """The run with the median events/s (the lower middle of an even count), carrying the
    events/s of all of them in round order."""
    ranked = sorted(runs, key=lambda run: run.events_per_second)
    median = ranked[(len(ranked) - 1) // 2]
    return replace(median, rounds_events_per_second=[run.events_per_second for run in runs])


def _ratio(value: float, limit: float | None) -> str:
    return f"{value / limit:.2f}x" if limit else "-"


def format_table(results: list[EngineResult]) -> str:
    """The results with their ratios to the JVM aggregation and the fastest Python API."""
    rates = {r.engine: r.events_per_second for r in results}
    jvm = rates.get(JVM)
    python_rates = [rates[name] for name in SPARK_PYTHON if name in rates]
    fastest = max(python_rates) if python_rates else None
    lines = [
        f"{'engine':<14}{'events/s':>11}{'seconds':>9}{'batches':>8}{'p50 ms':>9}"
        f"{'p99 ms':>9}{'MB/batch':>10}{'/ JVM agg':>11}{'/ fastest Py':>13}"
    ]
    for r in results:
        lines.append(
            f"{r.engine:<14}{r.events_per_second:>11.0f}{r.seconds:>9.1f}{r.batches:>8}"
            f"{r.latency_p50_ms:>9.0f}{r.latency_p99_ms:>9.0f}"
            f"{r.bytes_per_batch / 1e6:>10.2f}{_ratio(r.events_per_second, jvm):>11}"
            f"{_ratio(r.events_per_second, fastest):>13}"
        )
    for r in results:
        if len(r.rounds_events_per_second) > 1:
            rates_text = ", ".join(f"{rate:.0f}" for rate in r.rounds_events_per_second)
            lines.append(f"{r.engine} events/s by round (median shown above): {rates_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, spark: SparkSession | None = None) -> list[EngineResult]:
    """Command line: run the engines, print the table (or JSON lines); the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="N events")
    parser.add_argument("--keys", type=int, default=200_000, help="K distinct users")
    parser.add_argument("--batch", type=int, default=200_000, help="B events per batch")
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated subset of {','.join(ENGINES)} (default: all)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"a smoke run: sizes {QUICK}, no warm-up"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every engine, alternating their order; each engine's median run is shown",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per engine")
    args = parser.parse_args(argv)
    engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    unknown = [name for name in engines if name not in ENGINES]
    if unknown or not engines:
        parser.error(f"unknown engine(s) {unknown}: choose from {list(ENGINES)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    sizes = QUICK if args.quick else {"events": args.events, "keys": args.keys, "batch": args.batch}

    session = spark if spark is not None else spark_baseline.create_session(PARALLELISM)
    try:
        results = run_all(
            session,
            engines,
            sizes["events"],
            sizes["keys"],
            sizes["batch"],
            args.seed,
            warmup=not args.quick,
            rounds=args.rounds,
        )
    finally:
        if spark is None:
            session.stop()
    if args.json:
        for result in results:
            print(json.dumps({"benchmark": "streaming", **sizes, **asdict(result)}))
    else:
        print(
            f"Structured Streaming: N={sizes['events']} K={sizes['keys']} B={sizes['batch']}, "
            f"local[2], load average {os.getloadavg()[0]:.1f}"
        )
        print(format_table(results))
    return results


if __name__ == "__main__":
    main()
