"""Ticks: micro-batches without new input, so timers and TTL advance on an idle stream.

Spark runs a micro-batch only when a source has new data, or for its own stateful
operators (no-data batches); a ``foreachBatch`` query over ``transform_with_state`` has
none, so on an idle stream processing-time timers would never fire and an advanced
watermark would never evict. With ``spark.statebackend.streaming.tick-interval`` set,
``with_ticks`` unions the input with a ``rate`` source (one partition, at least one row
per tick interval), so every trigger has new data and Spark runs a batch; the batch
function drops those rows again (``without_ticks``) before the keyed path, and the keyed
subtasks fire what is due by the batch's timestamp and watermark, as any batch does.

The rate source is replayable by offset like the file source, so a re-run batch sees the
same tick rows (none of which reach the processor): exactly-once is unaffected.
"""

from __future__ import annotations

import math

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

TICK_COLUMN = "__sb_tick"
"""True on a tick row, False on an input row."""


def with_ticks(df: DataFrame, interval_seconds: float) -> DataFrame:
    """The streaming ``df`` with a ``TICK_COLUMN`` and, unioned, tick rows (every input
    column null) from a rate source giving at least one row per ``interval_seconds``."""
    rows_per_second = max(1, math.ceil(1.0 / interval_seconds))
    ticks = (
        df.sparkSession.readStream.format("rate")
        .option("rowsPerSecond", rows_per_second)
        .option("numPartitions", 1)
        .load()
    )
    nulls = [F.lit(None).cast(field.dataType).alias(field.name) for field in df.schema.fields]
    return df.withColumn(TICK_COLUMN, F.lit(False)).unionByName(
        ticks.select(*nulls, F.lit(True).alias(TICK_COLUMN))
    )


def without_ticks(batch_df: DataFrame) -> DataFrame:
    """A micro-batch of ``with_ticks(df)`` as a batch of ``df``: tick rows dropped."""
    return batch_df.where(~F.col(TICK_COLUMN)).drop(TICK_COLUMN)
