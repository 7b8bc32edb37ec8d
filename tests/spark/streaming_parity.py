"""Parity harness: one StatefulProcessor through Spark's own transformWithState and
through ours, on the same file source, compared batch by batch.

Input: one JSON-lines file per micro-batch, read with ``maxFilesPerTrigger=1`` and
``trigger(availableNow=True)``, so both queries see the same batches in the same order.
Each query's output is collected with ``foreachBatch`` as a multiset of (batch id, row),
nested values made hashable (``hashable``); ``run_parity`` returns both so a test can
compare them (and with plain Python).

Spark's own query runs with ``noDataMicroBatches`` off: in ProcessingTime mode it would
otherwise run a no-data batch after every batch, forever (``availableNow`` included),
and our ``foreachBatch`` query runs only batches with data unless ticks are on
(``streaming.tick-interval``). Both then fire timers and expire TTL in data batches only.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, GroupedData, SparkSession
from pyspark.sql.streaming.stateful_processor import StatefulProcessor
from pyspark.sql.types import StructType

from statebackend.spark.streaming import transform_with_state

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
"""transformWithState needs Spark's RocksDB state store."""

TICKING_TIMEOUT_SECONDS = 180.0
"""How long a ticking query may take to run its batches (a loaded CI machine)."""

BatchRows = Counter[tuple[int, tuple[Any, ...]]]
"""A query's output: how often each (batch id, row as a tuple) occurred."""


def write_batches(directory: Path, batches: list[list[dict[str, Any]]], first: int = 0) -> None:
    """One JSON-lines file per batch, numbered from ``first``, with increasing
    modification times (the file source takes files in that order)."""
    directory.mkdir(parents=True, exist_ok=True)
    for number, rows in enumerate(batches, start=first):
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
    initial_state: list[dict[str, Any]] | None = None
    """Rows of the initial state (with the key columns), or None."""
    initial_schema: StructType | None = None
    initial_key_by: list[str] | None = None
    """The columns the initial state is grouped by (``key_by`` if None)."""


def _source(spark: SparkSession, case: ParityCase, input_dir: Path) -> DataFrame:
    df = spark.readStream.schema(case.input_schema).option("maxFilesPerTrigger", 1)
    source = df.json(str(input_dir))
    return source.withWatermark(*case.watermark) if case.watermark else source


def _initial_state(spark: SparkSession, case: ParityCase) -> GroupedData | None:
    if case.initial_state is None:
        return None
    initial = spark.createDataFrame(case.initial_state, case.initial_schema)
    return initial.groupBy(*(case.initial_key_by or case.key_by))


def hashable(value: Any) -> Any:
    """A row value as plain hashable Python: Rows and lists as tuples, maps as sorted
    tuples of (key, value)."""
    if isinstance(value, dict):
        return tuple(sorted((hashable(k), hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(hashable(item) for item in value)
    return value


def _collector(rows: BatchRows) -> Any:
    def collect(df: DataFrame, batch_id: int) -> None:
        for row in df.collect():
            rows[(batch_id, hashable(row))] += 1

    return collect


def run_spark(
    spark: SparkSession, case: ParityCase, input_dir: Path, checkpoint: Path
) -> BatchRows:
    """The case through Spark's own transformWithState(InPandas) on its RocksDB store."""
    grouped = _source(spark, case, input_dir).groupBy(*case.key_by)
    processor: StatefulProcessor = case.processor()
    transform = (
        grouped.transformWithStateInPandas if case.use_pandas else grouped.transformWithState
    )
    out = transform(
        processor,
        case.output_schema,
        case.output_mode,
        case.time_mode,
        initialState=_initial_state(spark, case),
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
    until_batches: int | None = None,
) -> BatchRows:
    """The case through ``transform_with_state`` (state in our backend): with
    ``trigger(availableNow=True)``, or with ``until_batches`` on the default trigger of
    ``streaming.tick-interval``, stopped once batches 0 .. until_batches - 1 have run."""
    stateful = transform_with_state(
        _source(spark, case, input_dir),
        key_by=case.key_by,
        processor=case.processor(),
        output_schema=case.output_schema,
        job_id=job_id,
        output_mode=case.output_mode,
        time_mode=case.time_mode,
        use_pandas=case.use_pandas,
        initial_state=_initial_state(spark, case),
        parallelism=parallelism,
    )
    rows: BatchRows = Counter()
    ran: list[int] = []
    collect = _collector(rows)

    def collect_and_count(df: DataFrame, batch_id: int) -> None:
        collect(df, batch_id)
        ran.append(batch_id)

    writer = stateful.writeStream.foreachBatch(collect_and_count).option(
        "checkpointLocation", str(checkpoint)
    )
    if until_batches is None:
        writer.trigger(availableNow=True).start().awaitTermination()
        return rows
    query = writer.start()
    try:
        deadline = time.monotonic() + TICKING_TIMEOUT_SECONDS
        while len(set(ran)) < until_batches:
            assert time.monotonic() < deadline, f"only batches {sorted(set(ran))} ran"
            if query.awaitTermination(0.2):
                raise AssertionError(f"the query ended: {query.exception()}")
    finally:
        query.stop()
    return Counter({key: n for key, n in rows.items() if key[0] < until_batches})


@contextmanager
def parity_settings(
    spark: SparkSession, work_dir: Path, *, no_data_batches: bool = False, **extra: str
) -> Iterator[None]:
    """The session's settings for a parity run, unset after it: Spark's RocksDB state
    store, our directories under ``work_dir``, Spark's no-data batches on or off, and
    ``extra`` ``spark.statebackend.*`` keys (``tick-interval`` -> ``streaming.tick-interval``)."""
    settings = {
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
        "spark.statebackend.checkpoint.dir": (work_dir / "ours").as_uri(),
        "spark.statebackend.local.dir": str(work_dir / "local"),
        "spark.sql.streaming.noDataMicroBatches.enabled": str(no_data_batches).lower(),
        **{"spark.statebackend." + key: value for key, value in extra.items()},
    }
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key in settings:
            spark.conf.unset(key)


def run_parity(
    spark: SparkSession,
    case: ParityCase,
    batches: list[list[dict[str, Any]]],
    work_dir: Path,
    **extra: str,
) -> tuple[BatchRows, BatchRows]:
    """(Spark's output, our output) of the same batches; ``extra`` as in ``parity_settings``."""
    input_dir = work_dir / "input"
    write_batches(input_dir, batches)
    with parity_settings(spark, work_dir, **extra):
        theirs = run_spark(spark, case, input_dir, work_dir / "spark-checkpoint")
        ours = run_ours(spark, case, input_dir, work_dir / "our-checkpoint", job_id="parity")
    return theirs, ours
