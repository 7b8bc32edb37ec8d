"""Operator state in a transform_with_state processor (issue 9 part 3).

A ``StatefulProcessor`` that is also a ``CheckpointedFunction`` sums each user's events
(keyed state) and keeps per keyed subtask a "late events" buffer (split list state: the
ids of events older than the watermark they carry) and a broadcast "rules" map (set at
initialize, updated from rule rows sent under keys that reach every subtask at P = 1, 2
and 3; each subtask answers a rule row with the map it holds). The query runs at P = 2,
then on more input from the same checkpointLocation at P = 3 (where one subtask fails
a batch once after the others finished it, so the restarted query runs that batch again),
then at P = 1. After each run, compared with a plain-Python computation: the union of
the late buffers in the newest manifest is exactly the late events so far (nothing lost,
nothing twice), and in the newest materialization as of its batch; every subtask
reported the same rules map; the keyed output rows are exact; ``inspect`` shows both
operator states.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.streaming import StreamingQueryException
from pyspark.sql.streaming.stateful_processor import StatefulProcessor
from pyspark.sql.types import StructType, _parse_datatype_string

from statebackend.checkpoint.changelog_restore import rebuild_operator_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.restore import restore_operator_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from statebackend.keygroups import (
    assign_to_key_group,
    compute_default_max_parallelism,
    compute_key_group_range_for_operator_index,
)
from statebackend.serializers import IntSerializer, RowTupleSerializer, StrSerializer
from statebackend.spark.arrow_path import OPERATOR_ID
from statebackend.spark.streaming import transform_with_state
from statebackend.state.functions import FunctionInitializationContext, FunctionSnapshotContext
from tests.spark.jobs import streaming_session
from tests.spark.test_streaming_exactly_once import MATERIALIZE_EVERY

JOB = "late-stream"
INPUT_SCHEMA = "user string, id string, amount int, ts int, wm int, rule string, value int"
OUTPUT_SCHEMA = "user string, count int, total int, rules string"
RUNS = ((2, range(0, 2)), (3, range(2, 4)), (1, range(4, 5)))
"""(parallelism, batches) of the three runs."""
RULE_BATCHES = (1, 2, 4)
"""Rule updates: the first batches after each restart check the restored rules."""
FAILING_BATCH = 3
FAILING_ID = "fail-once"
MAX_PARALLELISM = compute_default_max_parallelism(2)
DEFAULT_RULES = {"default": 1}

Batch = list[dict[str, Any]]


def rule_keys() -> list[str]:
    """Keys such that every subtask at P = 1, 2 and 3 owns one, as the stream routes."""
    key_schema = StructType([_parse_datatype_string(INPUT_SCHEMA)["user"]])
    serializer = RowTupleSerializer(str(key_schema.json()))

    def key_group(key: str) -> int:
        return assign_to_key_group(serializer.serialize((key,)), MAX_PARALLELISM)

    keys: list[str] = []
    for parallelism in {p for p, _ in RUNS}:
        for subtask in range(parallelism):
            owned = compute_key_group_range_for_operator_index(
                MAX_PARALLELISM, parallelism, subtask
            )
            if not any(key_group(key) in owned for key in keys):
                keys.append(
                    next(
                        key
                        for key in (f"rules-{n}" for n in range(10_000))
                        if key_group(key) in owned
                    )
                )
    return keys


def make_batches() -> list[Batch]:
    """Five batches of events over six users; rule updates in ``RULE_BATCHES``; the
    event ``FAILING_ID`` in ``FAILING_BATCH``."""
    rng = random.Random(9)
    keys = rule_keys()
    batches: list[Batch] = []
    for batch_id in range(RUNS[-1][1].stop):
        rows: Batch = []
        for n in range(12):
            tick = batch_id * 100 + n
            rows.append(
                {
                    "user": f"u{rng.randrange(6)}",
                    "id": FAILING_ID if (batch_id, n) == (FAILING_BATCH, 5) else f"e{tick}",
                    "amount": rng.randint(1, 50),
                    "ts": tick - rng.choice([0, 0, 2, 9, 30]),
                    "wm": tick - 5,
                }
            )
        if batch_id in RULE_BATCHES:
            rule = {"rule": f"rule{batch_id}", "value": rng.randint(1, 9)}
            rows += [{"user": key, **rule} for key in keys]
        batches.append(rows)
    return batches


def write_batch_files(directory: Path, batches: list[Batch], numbers: range) -> None:
    """One JSON-lines file per batch, in order of modification time."""
    directory.mkdir(parents=True, exist_ok=True)
    for number in numbers:
        path = directory / f"batch-{number:04d}.json"
        path.write_text("".join(json.dumps(row) + "\n" for row in batches[number]))
        stamp = 1_700_000_000 + number
        os.utime(path, (stamp, stamp))


def late_events_processor(fail_marker: Path) -> StatefulProcessor:
    """The test's processor (nested so that Spark ships it by value); the event
    ``FAILING_ID`` fails once, after a pause that lets the other subtasks finish."""

    class LateEvents(StatefulProcessor):
        def initialize_state(self, ctx: FunctionInitializationContext) -> None:
            store = ctx.operator_state_store
            self.late = store.get_list_state("late", StrSerializer())
            self.rules = store.get_broadcast_state("rules", StrSerializer(), IntSerializer())
            if not ctx.is_restored:
                self.rules.put_all(DEFAULT_RULES)

        def snapshot_state(self, ctx: FunctionSnapshotContext) -> None:
            pass  # the states are kept up to date as rows arrive

        def init(self, handle: Any) -> None:
            self.totals = handle.getValueState("totals", "count int, total int")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Row]:  # noqa: N802
            (user,) = key
            rows = list(rows)
            if user.startswith("rules-"):
                for row in rows:
                    self.rules.put(row.rule, row.value)
                yield Row(
                    user=user, count=None, total=None, rules=json.dumps(dict(self.rules.items()))
                )
                return
            if any(row.id == FAILING_ID for row in rows) and not fail_marker.exists():
                fail_marker.touch()
                time.sleep(1.0)
                raise RuntimeError("injected failure after the other subtasks' batch")
            count, total = self.totals.get() if self.totals.exists() else (0, 0)
            count, total = count + len(rows), total + sum(row.amount for row in rows)
            self.totals.update((count, total))
            self.late.add_all([row.id for row in rows if row.ts < row.wm])
            yield Row(user=user, count=count, total=total, rules=None)

    return LateEvents()


def expected_outputs(batches: list[Batch]) -> dict[int, Counter[tuple[Any, ...]]]:
    """Each batch's output rows, computed in plain Python."""
    totals: dict[str, tuple[int, int]] = {}
    rules = dict(DEFAULT_RULES)
    out: dict[int, Counter[tuple[Any, ...]]] = {}
    for batch_id, rows in enumerate(batches):
        rows_out: Counter[tuple[Any, ...]] = Counter()
        events = [row for row in rows if "id" in row]
        rules |= {row["rule"]: row["value"] for row in rows if "rule" in row}
        for user in {row["user"] for row in events}:
            mine = [row for row in events if row["user"] == user]
            count, total = totals.get(user, (0, 0))
            totals[user] = (count + len(mine), total + sum(row["amount"] for row in mine))
            rows_out[(user, *totals[user], None)] += 1
        for key in {row["user"] for row in rows if "rule" in row}:
            rows_out[(key, None, None, json.dumps(rules, sort_keys=True))] += 1
        out[batch_id] = rows_out
    return out


def late_ids(batches: list[Batch]) -> Counter[str]:
    """The ids of the late events of ``batches``."""
    return Counter(
        row["id"] for rows in batches for row in rows if "id" in row and row["ts"] < row["wm"]
    )


def operator_states(storage: CheckpointStorage, parallelism: int) -> tuple[int, list[Any]]:
    """The newest manifest's batch and the operator state of each subtask in it."""
    changelog = ChangelogStorage(storage)
    manifest = changelog.latest_manifest()
    assert manifest is not None
    return manifest.batch_id, [
        rebuild_operator_state(changelog, manifest, OPERATOR_ID, i, parallelism)
        for i in range(parallelism)
    ]


def materialized_late(storage: CheckpointStorage, parallelism: int) -> tuple[int, Counter[str]]:
    """The newest completed materialization's batch and the union of its late buffers
    (-1 and none if no materialization completed yet)."""
    newest = storage.latest_completed()
    if newest is None:
        return -1, Counter()
    metadata = storage.load(newest)
    late: Counter[str] = Counter()
    for subtask in range(parallelism):
        state = restore_operator_state(
            storage.fs, newest, metadata, OPERATOR_ID, subtask, parallelism
        )
        late.update(state.get_list_state("late", StrSerializer()).get())
    return int(metadata.properties["batch_id"]), late


@pytest.fixture
def spark(spark_local: SparkSession, tmp_path: Path) -> Iterator[SparkSession]:
    with streaming_session(spark_local, tmp_path, (MATERIALIZE_EVERY, "2")) as session:
        yield session


def test_split_and_broadcast_state_of_a_processor_across_restarts_and_rescales(
    spark: SparkSession, tmp_path: Path
) -> None:
    batches = make_batches()
    expected = expected_outputs(batches)
    input_dir, checkpoint, fail_marker = tmp_path / "in", tmp_path / "ckpt", tmp_path / "failed"
    outputs: dict[int, Counter[tuple[Any, ...]]] = {}

    def collect(df: DataFrame, batch_id: int) -> None:
        outputs[batch_id] = Counter(
            (
                r.user,
                r["count"],
                r.total,
                r.rules and json.dumps(json.loads(r.rules), sort_keys=True),
            )
            for r in df.collect()
        )

    def run_query(parallelism: int) -> None:
        source = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1)
        stream = transform_with_state(
            source.json(str(input_dir)),
            key_by="user",
            processor=late_events_processor(fail_marker),
            output_schema=OUTPUT_SCHEMA,
            job_id=JOB,
            parallelism=parallelism,
        )
        query = (
            stream.writeStream.foreachBatch(collect)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    storage = CheckpointStorage((tmp_path / "ours").as_uri(), JOB)
    materialized_batches: set[int] = set()
    try:
        for parallelism, numbers in RUNS:
            write_batch_files(input_dir, batches, numbers)
            if FAILING_BATCH in numbers:
                with pytest.raises(StreamingQueryException, match="injected failure"):
                    run_query(parallelism)
                assert max(outputs) == FAILING_BATCH - 1
            run_query(parallelism)
            assert outputs == {b: expected[b] for b in range(numbers.stop)}

            newest, states = operator_states(storage, parallelism)
            assert newest == numbers.stop - 1
            late = Counter(
                x for state in states for x in state.get_list_state("late", StrSerializer()).get()
            )
            assert late == late_ids(batches[: numbers.stop])
            rules = DEFAULT_RULES | {
                r["rule"]: r["value"] for b in batches for r in b if "rule" in r
            }
            for state in states:
                broadcast = state.get_broadcast_state("rules", StrSerializer(), IntSerializer())
                assert dict(broadcast.items()) == {
                    name: value
                    for name, value in rules.items()
                    if name == "default" or int(name[4:]) < numbers.stop
                }
            materialized_batch, materialized = materialized_late(storage, parallelism)
            assert materialized == late_ids(batches[: materialized_batch + 1])
            materialized_batches.add(materialized_batch)
    finally:
        storage.close()
    assert fail_marker.exists()
    assert max(materialized_batches) >= 0  # at least one materialization was checked

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", str(tmp_path / "ours" / JOB / "latest"), "--json"]) == 0
    shown = json.loads(out.getvalue())["operators"][OPERATOR_ID]["operator_states"]
    assert {n: (s["mode"], s["elements"]) for n, s in shown.items()} == {
        "late": ("split", sum(late_ids(batches).values())),
        "rules": ("broadcast", len(DEFAULT_RULES) + len(RULE_BATCHES)),
    }
