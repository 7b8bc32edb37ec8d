"""A local copy left by an attempt of a batch that was never committed is not reused once
another attempt's record of that batch is committed (transform_with_state, RocksDB).

Three runs of one query on one checkpointLocation, the local directory standing for the
host. Run 1 (host 1, a processor that adds 100 per event) commits batch 0; in batch 1
subtask 0 finishes and marks its copy at batch 1, then subtask 1 raises, so manifest 1 is
never written. Run 2 (host 2, the processor fixed to add 1) runs batch 1 again: manifest 1
accepts its attempts. Run 3 (host 1 again) runs batch 2: subtask 0's copy says batch 1
there, but holds run 1's state: it must be rebuilt from manifest 1, and the counts are
100 per event of batch 0 plus 1 per event since.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.streaming import StreamingQueryException
from pyspark.sql.streaming.stateful_processor import StatefulProcessor
from pyspark.sql.types import StructType, _parse_datatype_string

from statebackend.keygroups import (
    assign_to_key_group,
    compute_default_max_parallelism,
    compute_key_group_range_for_operator_index,
)
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.arrow_path import OPERATOR_ID
from statebackend.spark.streaming import transform_with_state
from tests.spark.jobs import streaming_session

JOB = "stale-copy"
PARALLELISM = 2
INPUT_SCHEMA = "user string"
OUTPUT_SCHEMA = "user string, count long"


def keys_of(subtask: int, count: int) -> list[str]:
    """``count`` user keys that the stream routes to ``subtask`` (of ``PARALLELISM``)."""
    key_schema = StructType([_parse_datatype_string(INPUT_SCHEMA)["user"]])
    serializer = RowTupleSerializer(str(key_schema.json()))
    max_parallelism = compute_default_max_parallelism(PARALLELISM)
    owned = compute_key_group_range_for_operator_index(max_parallelism, PARALLELISM, subtask)
    keys = (f"u{n}" for n in range(10_000))
    return [
        key
        for key in keys
        if assign_to_key_group(serializer.serialize((key,)), max_parallelism) in owned
    ][:count]


def counting_processor(
    step: int, poison: str | None = None, wait_for: Path | None = None
) -> StatefulProcessor:
    """Adds ``step`` per event to the user's count. User ``poison`` (run 1) raises once
    the marker file ``wait_for`` (subtask 0's) says batch 1: subtask 0 has finished and
    marked its copy, and the batch fails."""

    class Counting(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "count long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:  # noqa: N802
            (user,) = key
            events = len(list(rows))
            if user == poison and wait_for is not None:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        if json.loads(wait_for.read_text())["batch"] == 1:
                            break
                    except (OSError, ValueError):
                        pass
                    time.sleep(0.05)
                raise RuntimeError("injected failure after subtask 0 marked its copy")
            (count,) = self.count.get() if self.count.exists() else (0,)
            count += step * events
            self.count.update((count,))
            yield Row(user=user, count=count)

    return Counting()


@pytest.fixture
def spark(spark_local: SparkSession, tmp_path: Path) -> Iterator[SparkSession]:
    with streaming_session(spark_local, tmp_path) as session:
        yield session


def test_a_copy_of_an_attempt_whose_batch_another_attempt_committed_is_rebuilt(
    spark: SparkSession, tmp_path: Path
) -> None:
    good, (poison, other) = keys_of(0, 3), keys_of(1, 2)
    input_dir, checkpoint = tmp_path / "in", tmp_path / "ckpt"
    input_dir.mkdir()
    batches = [[*good, other], [*good, *good, poison], [*good]]

    def write_batch(number: int) -> None:
        path = input_dir / f"batch-{number:04d}.json"
        path.write_text("".join(json.dumps({"user": user}) + "\n" for user in batches[number]))
        stamp = 1_700_000_000 + number
        os.utime(path, (stamp, stamp))

    outputs: dict[int, dict[str, int]] = {}

    def collect(df: DataFrame, batch_id: int) -> None:
        outputs[batch_id] = {row.user: row["count"] for row in df.collect()}

    def run(host: str, processor: StatefulProcessor) -> None:
        spark.conf.set("spark.statebackend.local.dir", str(tmp_path / host))
        source = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
        stream = transform_with_state(
            source.json(str(input_dir)),
            key_by="user",
            processor=processor,
            output_schema=OUTPUT_SCHEMA,
            job_id=JOB,
            parallelism=PARALLELISM,
        )
        query = (
            stream.writeStream.foreachBatch(collect)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    host1_marker = tmp_path / "host1" / JOB / OPERATOR_ID / "subtask-0.version"
    write_batch(0)
    write_batch(1)
    with pytest.raises(StreamingQueryException, match="injected failure"):
        run("host1", counting_processor(100, poison, host1_marker))
    assert sorted(outputs) == [0]
    assert json.loads(host1_marker.read_text())["batch"] == 1  # run 1's copy, at batch 1

    run("host2", counting_processor(1))
    assert sorted(outputs) == [0, 1]
    assert all(outputs[1][user] == 102 for user in good)

    write_batch(2)
    run("host1", counting_processor(1))
    assert outputs[2] == {user: 103 for user in good}  # not 100 + 200 + 1 (run 1's copy)
