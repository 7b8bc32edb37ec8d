"""Operator state in a keyed function on the executors (issue 9 part 3).

The test job counts and sums each user's events (keyed state) and, as a
``CheckpointedFunction``, keeps per subtask a "late events" buffer (split list state:
the ids of events whose timestamp is older than the watermark they carry) and a broadcast
"category rules" map (set at initialize, updated from special rule records, each sent
under keys that reach every subtask at P = 1, 2 and 3). Three runs at P = 2 -> 3 -> 1
with input appended before each; in the second run one batch fails once on one subtask
after the others finished it, so that the batch is retried. After each run the state in
the final checkpoint and in the newest batch manifest is compared with a plain-Python
computation: the late buffers' union is exactly the late events so far (nothing lost,
nothing twice), every subtask holds the same rules, and the keyed outputs are exact.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

from pyspark.sql import SparkSession

from statebackend.backends.operator import OperatorStateBackend
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
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.spark.api import KeyedContext, KeyedFunction
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.runner import StatefulJob
from statebackend.spark.source import LogSource, partition_path
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.functions import FunctionInitializationContext, FunctionSnapshotContext
from statebackend.state.interfaces import ValueState

JOB, OPERATOR = "late-events", "late-users"
RUNS = ((2, 0), (3, 1), (1, 2))
"""(parallelism, seed) of the three runs."""
FAILING_BATCH = 1
"""The batch of the second run (counted from 0) that fails once on its last subtask."""
MAX_PARALLELISM = compute_default_max_parallelism(RUNS[0][0])
DEFAULT_RULES = {"default": 1}


def rule_keys() -> list[str]:
    """Keys of rule records such that every subtask at P = 1, 2 and 3 owns one."""
    serialize = StrSerializer().serialize
    keys: list[str] = []
    for parallelism in {p for p, _ in RUNS}:
        for subtask in range(parallelism):
            owned = compute_key_group_range_for_operator_index(
                MAX_PARALLELISM, parallelism, subtask
            )
            if any(assign_to_key_group(serialize(k), MAX_PARALLELISM) in owned for k in keys):
                continue
            keys.append(
                next(
                    key
                    for key in (f"rules-{n}" for n in range(10_000))
                    if assign_to_key_group(serialize(key), MAX_PARALLELISM) in owned
                )
            )
    return keys


def late_events_function(fail_marker: Path, fail_batch: int, fail_subtask: int) -> KeyedFunction:
    """The test job's function (nested so that Spark ships it by value); subtask
    ``fail_subtask`` fails batch ``fail_batch`` once, after a pause that lets the other
    subtasks finish it."""

    class LateEvents(KeyedFunction):
        def initialize_state(self, ctx: FunctionInitializationContext) -> None:
            store = ctx.operator_state_store
            self.late = store.get_list_state("late", StrSerializer())
            self.rules = store.get_broadcast_state("rules", StrSerializer(), IntSerializer())
            if not ctx.is_restored:
                self.rules.put_all(DEFAULT_RULES)

        def snapshot_state(self, ctx: FunctionSnapshotContext) -> None:
            pass  # the states are kept up to date as records arrive

        def open(self, ctx: KeyedContext) -> None:
            self.count = cast(
                ValueState, ctx.get_state(ValueStateDescriptor("count", IntSerializer(), default=0))
            )
            self.total = cast(
                ValueState, ctx.get_state(ValueStateDescriptor("total", IntSerializer(), default=0))
            )
            failing = ctx.batch_id == fail_batch and ctx.subtask == fail_subtask
            if failing and not fail_marker.exists():
                fail_marker.touch()
                time.sleep(1.0)
                raise RuntimeError("injected failure after the other subtasks' batch")

        def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Any:
            if key.startswith("rules-"):
                for record in values:
                    self.rules.put(record["rule"], record["value"])
                return
            self.count.update(self.count.value() + len(values))
            self.total.update(self.total.value() + sum(r["amount"] for r in values))
            self.late.add_all([r["id"] for r in values if r["ts"] < r["wm"]])
            yield {"user": key, "count": self.count.value(), "total": self.total.value()}

    return LateEvents()


class FailingCommit(StatefulJob):
    """The job, whose driver fails once to commit batch ``fail_at`` after its subtasks
    ran it: the rerun must not continue from their live state of that batch."""

    fail_at: int | None = None

    def _commit(self, results: list[Any], batch_id: int, offsets: list[Any]) -> None:
        if batch_id == self.fail_at:
            self.fail_at = None
            raise RuntimeError("injected failure before the batch's commit")
        super()._commit(results, batch_id, offsets)


def append_input(directory: Path, run: int, seed: int) -> list[dict[str, Any]]:
    """Append a run's events (users on two partitions) and rule records; return them."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    lines: dict[int, list[str]] = {0: [], 1: []}
    for n in range(160):
        user = rng.randrange(12)
        watermark = n - 10
        event = {
            "user": f"u{user}",
            "id": f"r{run}-e{n}",
            "amount": rng.randint(1, 50),
            "ts": n - rng.choice([0, 0, 0, 3, 15, 30]),
            "wm": watermark,
        }
        records.append(event)
        lines[user % 2].append(json.dumps(event) + "\n")
        if n % 80 == 40:  # a rule update, sent to every subtask
            rule = {"rule": f"run{run}-rule{n}", "value": rng.randint(1, 9)}
            records.append(rule)
            lines[0] += [json.dumps({"user": key, **rule}) + "\n" for key in rule_keys()]
    directory.mkdir(parents=True, exist_ok=True)
    for partition, items in lines.items():
        with partition_path(directory, partition).open("a", encoding="utf-8") as f:
            f.writelines(items)
    return records


def subtask_states(tmp_path: Path, checkpoint: str, parallelism: int) -> list[OperatorStateBackend]:
    """The operator states of the job's subtasks in ``checkpoint`` and in the newest
    manifest (which must agree), at the run's parallelism."""
    storage = CheckpointStorage((tmp_path / "checkpoints").as_uri(), JOB)
    try:
        metadata = storage.load(checkpoint)
        from_checkpoint = [
            restore_operator_state(storage.fs, checkpoint, metadata, OPERATOR, i, parallelism)
            for i in range(parallelism)
        ]
        changelog = ChangelogStorage(storage)
        manifest = changelog.latest_manifest()
        assert manifest is not None
        from_manifest = [
            rebuild_operator_state(changelog, manifest, OPERATOR, i, parallelism)
            for i in range(parallelism)
        ]
    finally:
        storage.close()
    assert [s.sync_cut() for s in from_manifest] == [s.sync_cut() for s in from_checkpoint]
    return from_checkpoint


def final_outputs(output: Path) -> dict[str, dict[str, int]]:
    """Each user's last output row (batches in order)."""
    rows: dict[str, dict[str, int]] = {}
    for batch in sorted(output.glob("batch-*")):
        for part in sorted(batch.glob("part-*.jsonl")):
            for line in part.read_text().splitlines():
                row = json.loads(line)
                rows[row["user"]] = {"count": row["count"], "total": row["total"]}
    return rows


def test_split_and_broadcast_state_of_a_keyed_function_across_rescales(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    records: list[dict[str, Any]] = []
    fail_marker = tmp_path / "failed-once"
    batches = 0  # batch ids go on across runs
    for run, (parallelism, seed) in enumerate(RUNS):
        records += append_input(tmp_path / "input", run, seed)
        job = FailingCommit(
            spark_local,
            job_id=JOB,
            source=LogSource(str(tmp_path / "input")),
            operator_id=OPERATOR,
            key_by="user",
            function=late_events_function(
                fail_marker, batches + FAILING_BATCH if run == 1 else -1, parallelism - 1
            ),
            parallelism=parallelism,
            batch_size=50,
            checkpoint_every=2,
            output_dir=str(tmp_path / "output"),
            conf=StateBackendConf(
                checkpoint_dir=(tmp_path / "checkpoints").as_uri(),
                local_dir=str(tmp_path / "local"),
            ),
        )
        job.fail_at = batches if run == 2 else None
        summary = job.run()
        assert summary.failures == (run > 0) and summary.rollbacks == 0
        batches += summary.batches
        events = [r for r in records if "id" in r]
        expected_late = Counter(e["id"] for e in events if e["ts"] < e["wm"])
        expected_rules = DEFAULT_RULES | {r["rule"]: r["value"] for r in records if "rule" in r}
        expected_users: dict[str, dict[str, int]] = {}
        for event in events:
            user = expected_users.setdefault(event["user"], {"count": 0, "total": 0})
            user["count"] += 1
            user["total"] += event["amount"]

        assert summary.last_checkpoint is not None
        states = subtask_states(tmp_path, summary.last_checkpoint, parallelism)
        late = [s.get_list_state("late", StrSerializer()).get() for s in states]
        assert Counter(x for share in late for x in share) == expected_late
        for state in states:
            rules = state.get_broadcast_state("rules", StrSerializer(), IntSerializer())
            assert dict(rules.items()) == expected_rules
        assert final_outputs(tmp_path / "output") == expected_users

    assert fail_marker.exists()
    # inspect shows them, of the checkpoint and of the newest manifest (P = 1 now).
    manifests = tmp_path / "checkpoints" / JOB / "manifests"
    newest = max(manifests.iterdir(), key=lambda path: int(path.name))
    for location in (summary.last_checkpoint, str(newest)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["inspect", location, "--json"]) == 0
        shown = json.loads(out.getvalue())["operators"][OPERATOR]["operator_states"]
        assert {n: (s["mode"], s["elements"]) for n, s in shown.items()} == {
            "late": ("split", sum(expected_late.values())),
            "rules": ("broadcast", len(expected_rules)),
        }
