"""Parity harness: one StatefulProcessor through Spark's own transformWithState and
through ours, on the same file source, compared batch by batch.

Input: one JSON-lines file per micro-batch, read with ``maxFilesPerTrigger=1`` and
``trigger(availableNow=True)``, so both queries see the same batches in the same order.
Each query's output is collected with ``foreachBatch`` as a multiset of (batch id, row);
``run_parity`` returns both so a test can compare them (and with plain Python).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.stateful_processor import StatefulProcessor
from pyspark.sql.types import StructType

from statebackend.spark.streaming import transform_with_state

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
"""transformWithState needs Spark's RocksDB state store."""

BatchRows = Counter[tuple[int, tuple[Any, ...]]]
"""A query's output: how often each (batch id, row as a tuple) occurred."""


def write_batches(directory: Path, batches: list[list[dict[str, Any]]]) -> None:
    """One JSON-lines file per batch, with increasing modification times (the file
    source takes files in that order)."""
    directory.mkdir(parents=True, exist_ok=True)
    for number, rows in enumerate(batches):
        path = directory / f"batch-{number:04d}.json"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        stamp = 1_700_000_000 + number
        os.utime(path, (stamp, stamp))


@dataclass
class ParityCase:
    """What both queries run: input schema, key, processor factory and output."""

    input_schema: StructType
    key_by: list[str]
    processor: Any  # a zero-argument callable returning a fresh StatefulProcessor
    output_schema: StructType
    use_pandas: bool = False
    time_mode: str = "None"
    output_mode: str = "Update"
    watermark: tuple[str, str] | None = None
    """(event-time column, delay) for ``withWatermark`` (EventTime mode)."""


def _source(spark: SparkSession, case: ParityCase, input_dir: Path) -> DataFrame:
    df = spark.readStream.schema(case.input_schema).option("maxFilesPerTrigger", 1)
    source = df.json(str(input_dir))
    return source.withWatermark(*case.watermark) if case.watermark else source


def _collector(rows: BatchRows) -> Any:
    def collect(df: DataFrame, batch_id: int) -> None:
        for row in df.collect():
            rows[(batch_id, tuple(row))] += 1

    return collect


def run_spark(
    spark: SparkSession, case: ParityCase, input_dir: Path, checkpoint: Path
) -> BatchRows:
    """The case through Spark's own transformWithState(InPandas) on its RocksDB store."""
    grouped = _source(spark, case, input_dir).groupBy(*case.key_by)
    processor: StatefulProcessor = case.processor()
    if case.use_pandas:
        out = grouped.transformWithStateInPandas(
            processor, case.output_schema, case.output_mode, case.time_mode
        )
    else:
        out = grouped.transformWithState(
            processor, case.output_schema, case.output_mode, case.time_mode
        )
    rows: BatchRows = Counter()
    query = (
        out.writeStream.foreachBatch(_collector(rows))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return rows


def run_ours(
    spark: SparkSession,
    case: ParityCase,
    input_dir: Path,
    checkpoint: Path,
    job_id: str,
    parallelism: int = 2,
) -> BatchRows:
    """The case through ``transform_with_state`` (state in our backend)."""
    stateful = transform_with_state(
        _source(spark, case, input_dir),
        key_by=case.key_by,
        processor=case.processor(),
        output_schema=case.output_schema,
        job_id=job_id,
        output_mode=case.output_mode,
        time_mode=case.time_mode,
        use_pandas=case.use_pandas,
        parallelism=parallelism,
    )
    rows: BatchRows = Counter()
    query = (
        stateful.writeStream.foreachBatch(_collector(rows))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return rows


def run_parity(
    spark: SparkSession,
    case: ParityCase,
    batches: list[list[dict[str, Any]]],
    work_dir: Path,
) -> tuple[BatchRows, BatchRows]:
    """(Spark's output, our output) of the same batches."""
    input_dir = work_dir / "input"
    write_batches(input_dir, batches)
    settings = {
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
        "spark.statebackend.checkpoint.dir": (work_dir / "ours").as_uri(),
        "spark.statebackend.local.dir": str(work_dir / "local"),
    }
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        theirs = run_spark(spark, case, input_dir, work_dir / "spark-checkpoint")
        ours = run_ours(spark, case, input_dir, work_dir / "our-checkpoint", job_id="parity")
    finally:
        for key in settings:
            spark.conf.unset(key)
    return theirs, ours
