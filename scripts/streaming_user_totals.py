"""Example Structured Streaming job: per-user count and total over JSON files, exactly once.

    .venv/bin/python scripts/streaming_user_totals.py --input in/ --output out/ \\
        --checkpoint-location spark-ckpt/ --state-dir state/ [--parallelism 2]

Reads JSON lines ``{"user": str, "amount": int}`` from ``--input`` (one file per
micro-batch: ``maxFilesPerTrigger=1``), keeps per user a value state (count, total) and a
list state (the amounts seen) in statebackend through ``transform_with_state``, and
writes one row per user and batch, ``(user, count, total, amounts)``, to the parquet
directory ``--output`` as ``part-<batch>-<subtask>.parquet``. Kill it at any moment
(even ``kill -9``) and start it again with the same arguments, or another
``--parallelism`` to rescale: the output holds every batch's rows exactly once, as a run
without failure would.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyspark.sql import Row, SparkSession
from pyspark.sql.streaming.stateful_processor import (
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)

OUTPUT_SCHEMA = "user string, count long, total long, amounts string"
INPUT_SCHEMA = "user string, amount long"


class UserTotals(StatefulProcessor):
    """Per user: ``totals`` (count, total) in a value state, every amount in a list state;
    one output row per user and batch with the running values."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.totals = handle.getValueState("totals", "count long, total long")
        self.amounts = handle.getListState("amounts", "amount long")

    def handleInputRows(
        self, key: Any, rows: Iterator[Row], timerValues: TimerValues
    ) -> Iterator[Row]:
        current = self.totals.get()
        count, total = (current[0], current[1]) if current else (0, 0)
        amounts = [int(row.amount) for row in rows]
        count, total = count + len(amounts), total + sum(amounts)
        self.totals.update((count, total))
        self.amounts.appendList([(amount,) for amount in amounts])
        history = ",".join(str(row[0]) for row in self.amounts.get())
        yield Row(user=key[0], count=count, total=total, amounts=history)

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the query until the input is processed (``availableNow``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--checkpoint-location", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--local-dir", default=None)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--job-id", default="streaming-user-totals")
    args = parser.parse_args(argv)

    from statebackend.spark.java import require_java
    from statebackend.spark.streaming import transform_with_state

    require_java(17)
    # Spark's Python workers run this interpreter (its environment has statebackend), not
    # whatever ``python3`` comes first on the PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master("local[2]")
        .appName("streaming-user-totals")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.statebackend.checkpoint.dir", Path(args.state_dir).absolute().as_uri())
    )
    if args.local_dir is not None:
        builder = builder.config("spark.statebackend.local.dir", args.local_dir)
    spark = builder.getOrCreate()
    source = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(args.input)
    stateful = transform_with_state(
        source,
        key_by="user",
        processor=UserTotals(),
        output_schema=OUTPUT_SCHEMA,
        job_id=args.job_id,
        parallelism=args.parallelism,
    )
    query = (
        stateful.writeStream.format("parquet")
        .option("path", args.output)
        .option("checkpointLocation", args.checkpoint_location)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
