"""Our Spark runtime against Spark's own stateful APIs on the same workload.

Workload (``spark_baseline.py``): N events ``(user, amount)`` over K users; per user keep
the count and the sum of ``amount``; micro-batches of B events. Ours: ``StatefulJob``
over two source partitions (B/2 records each per batch, so B per batch), RocksDB keyed
state, a checkpoint every ``--checkpoint-every`` batches (default 1, as Spark's state
store commits every batch; the product's default ``spark.statebackend.checkpoint.interval``
is 10): either way every batch is durable (its changelog record and manifest) before the
next starts, and a checkpoint materializes it; in the same local[2] session. Spark:
``applyInPandasWithState`` and ``transformWithStateInPandas`` with the RocksDB state store
provider. Every run's final state is checked against a plain-Python computation.

    python scripts/bench/spark_state.py [--events N --keys K --batch-size B] [--repeat R]
        [--checkpoint-every C] [--ours-only] [--json]

Prints events/s, the ratio ours / the faster Spark API (target >= 10x), the checkpoints
ours took (one falls due every C batches and waits for a batch that finds the previous one
uploaded) and its checkpoint waits (only a run's final checkpoint waits for the previous
one). With
``--repeat R`` ours runs R times in the session (the machine is shared: single runs vary)
and its median run is reported, with every run's events/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spark_baseline  # noqa: E402

from statebackend.serializers import IntSerializer  # noqa: E402
from statebackend.spark.api import KeyedContext, KeyedFunction  # noqa: E402
from statebackend.spark.conf import StateBackendConf  # noqa: E402
from statebackend.spark.runner import RunSummary, StatefulJob  # noqa: E402
from statebackend.spark.source import LogSource, partition_path  # noqa: E402
from statebackend.spark.state_reader import read_state  # noqa: E402
from statebackend.state.descriptors import ValueStateDescriptor  # noqa: E402
from statebackend.state.interfaces import ValueState  # noqa: E402

OPERATOR_ID = "count-sum"
COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)
SUM = ValueStateDescriptor("sum", IntSerializer(), default=0)
SOURCE_PARTITIONS = 2


class CountSum(KeyedFunction):
    """Per user: the number of events and the sum of their amounts."""

    def open(self, ctx: KeyedContext) -> None:
        """Register the two states."""
        self.count = cast(ValueState, ctx.get_state(COUNT))
        self.sum = cast(ValueState, ctx.get_state(SUM))

    def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> list[Any]:
        """Add the batch's events of ``key``; output nothing (as the baselines)."""
        self.count.update(self.count.value() + len(values))
        self.sum.update(self.sum.value() + sum(v["amount"] for v in values))
        return []


def _write_input(workload: spark_baseline.Workload, directory: Path) -> None:
    directory.mkdir(parents=True)
    files = [
        partition_path(directory, p).open("w", encoding="utf-8") for p in range(SOURCE_PARTITIONS)
    ]
    for i, (user, amount) in enumerate(
        zip(workload.users.tolist(), workload.amounts.tolist(), strict=True)
    ):
        files[i % SOURCE_PARTITIONS].write(json.dumps({"user": str(user), "amount": amount}))
        files[i % SOURCE_PARTITIONS].write("\n")
    for f in files:
        f.close()


def run_ours(
    spark: Any,
    workload: spark_baseline.Workload,
    batch_size: int,
    *,
    checkpoint_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    incremental: bool = False,
    checkpoint_every: int = 1,
    job_id: str = "bench",
) -> RunSummary:
    """Run the workload through StatefulJob (checkpoints in ``checkpoint_dir``, by default
    a fresh local directory); check the final state; return the summary."""
    workdir = Path(tempfile.mkdtemp(prefix="statebackend-bench-"))
    _write_input(workload, workdir / "input")
    options = storage_options or {}
    summary = StatefulJob(
        spark,
        job_id=job_id,
        source=LogSource(str(workdir / "input")),
        operator_id=OPERATOR_ID,
        key_by="user",
        function=CountSum(),
        parallelism=2,
        batch_size=max(1, batch_size // SOURCE_PARTITIONS),
        checkpoint_every=checkpoint_every,
        restore=None,
        conf=StateBackendConf(
            checkpoint_dir=checkpoint_dir or (workdir / "checkpoints").as_uri(),
            storage_options=options,
            incremental=incremental,
            local_dir=str(workdir / "local"),
        ),
    ).run()
    assert summary.last_checkpoint is not None
    counts: dict[str, int] = dict(
        read_state(spark, summary.last_checkpoint, OPERATOR_ID, "count", options).collect()
    )
    sums: dict[str, int] = dict(
        read_state(spark, summary.last_checkpoint, OPERATOR_ID, "sum", options).collect()
    )
    got = {int(user): (counts[user], sums[user]) for user in counts}
    if got != workload.expected:
        raise SystemExit("spark_state: our final state differs from the plain-Python totals")
    return summary


def main(argv: list[str] | None = None) -> None:
    """Run ours and the baselines; print a table (or JSON lines with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=2_000)
    parser.add_argument("--batch-size", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs of ours (median reported)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=1, help="ours: a checkpoint every C batches"
    )
    parser.add_argument(
        "--ours-only", action="store_true", help="skip Spark's APIs (no ratio): for profiling"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    spark = spark_baseline.create_session()
    try:
        workload = spark_baseline.make_workload(args.events, args.keys)
        warmup = spark_baseline.warmup_sizes(args.keys, args.batch_size)
        run_ours(
            spark,
            spark_baseline.make_workload(warmup["events"], warmup["keys"], 1),
            warmup["batch"],
        )
        runs = sorted(
            (
                run_ours(spark, workload, args.batch_size, checkpoint_every=args.checkpoint_every)
                for _ in range(max(1, args.repeat))
            ),
            key=lambda summary: summary.seconds,
        )
        ours = runs[len(runs) // 2]
        baselines = (
            {}
            if args.ours_only
            else spark_baseline.run_baselines(args.events, args.keys, args.batch_size, spark=spark)
        )
    finally:
        spark.stop()
    ours_rate = args.events / ours.seconds
    best = max((result.events_per_second for result in baselines.values()), default=float("nan"))
    waits = ours.checkpoint_waits or [0.0]
    rows: list[dict[str, Any]] = [
        {
            "name": "statebackend",
            "events_per_second": ours_rate,
            "seconds": ours.seconds,
            "ratio_to_best_spark": ours_rate / best,
            "batches": ours.batches,
            "checkpoints": len(ours.checkpoints),
            "checkpoint_waits": len(ours.checkpoint_waits),
            "checkpoint_wait_mean_ms": 1000 * sum(waits) / len(waits),
            "checkpoint_wait_max_ms": 1000 * max(waits),
            "sync_cut_max_ms": 1000 * max(ours.sync_seconds or [0.0]),
            "runs_events_per_second": [round(args.events / run.seconds) for run in runs],
        }
    ]
    for name, result in baselines.items():
        rows.append(
            {
                "name": name,
                "events_per_second": result.events_per_second,
                "seconds": result.seconds,
                "ratio_to_best_spark": result.events_per_second / best,
            }
        )
    if args.json:
        for row in rows:
            print(
                json.dumps(
                    {
                        "events": args.events,
                        "keys": args.keys,
                        "checkpoint_every": args.checkpoint_every,
                        **row,
                    }
                )
            )
        return
    print(
        f"N={args.events} K={args.keys} B={args.batch_size} (local[2]); ours: a checkpoint "
        f"every {args.checkpoint_every} batches"
    )
    print(f"{'strategy':<32}{'events/s':>12}{'seconds':>10}{'x best Spark':>14}")
    for row in rows:
        print(
            f"{row['name']:<32}{row['events_per_second']:>12.0f}{row['seconds']:>10.1f}"
            f"{row['ratio_to_best_spark']:>14.1f}"
        )
    print(
        f"ours: {ours.batches} batches, {len(ours.checkpoints)} checkpoints, "
        f"{len(ours.checkpoint_waits)} checkpoint waits (mean "
        f"{rows[0]['checkpoint_wait_mean_ms']:.1f} ms, max {rows[0]['checkpoint_wait_max_ms']:.1f}"
        f" ms); longest synchronous cut {rows[0]['sync_cut_max_ms']:.1f} ms; target ours >= 10x"
    )
    if len(runs) > 1:
        print(
            f"ours, events/s of each run: {statistics.median(rows[0]['runs_events_per_second'])}"
            f" median of {rows[0]['runs_events_per_second']}"
        )


if __name__ == "__main__":
    main()
