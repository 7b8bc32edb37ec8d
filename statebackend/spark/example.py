"""The example job: per-user totals over a log of purchase events.

Events are JSON objects ``{"user": str, "amount": int, "category": str}``. Operator
``user-totals`` keys them by ``user`` and keeps ``count`` (ValueState int), ``total``
(ReducingState sum of amounts), ``categories`` (MapState category -> count) and
``recent`` (ListState of the last 5 amounts). Each batch outputs one row per user seen.

Also here: a deterministic event generator (each user writes to one partition, so a
user's events have one order) and the plain-Python computation tests compare with.
"""

from __future__ import annotations

import json
import operator
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.spark.api import KeyedContext, KeyedFunction
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.runner import StatefulJob
from statebackend.spark.source import LogSource, partition_path
from statebackend.spark.state_reader import read_state
from statebackend.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from statebackend.state.interfaces import ListState, MapState, ReducingState, ValueState

OPERATOR_ID = "user-totals"
KEY_FIELD = "user"
RECENT = 5
CATEGORIES = ("books", "games", "food", "music", "garden")

COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)
TOTAL = ReducingStateDescriptor("total", operator.add, IntSerializer())
CATEGORY_COUNTS = MapStateDescriptor("categories", StrSerializer(), IntSerializer())
RECENT_AMOUNTS = ListStateDescriptor("recent", IntSerializer())


class UserTotals(KeyedFunction):
    """Counts, sums and categorises each user's events, remembering the last amounts."""

    def open(self, ctx: KeyedContext) -> None:
        """Register the four states."""
        self.count = cast(ValueState, ctx.get_state(COUNT))
        self.total = cast(ReducingState, ctx.get_state(TOTAL))
        self.categories = cast(MapState, ctx.get_state(CATEGORY_COUNTS))
        self.recent = cast(ListState, ctx.get_state(RECENT_AMOUNTS))

    def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Iterator[Any]:
        """Fold the user's events of this batch into the state; output the user's totals."""
        self.count.update(self.count.value() + len(values))
        per_category: dict[str, int] = {}
        for event in values:
            self.total.add(event["amount"])
            per_category[event["category"]] = per_category.get(event["category"], 0) + 1
        for category, n in per_category.items():
            self.categories.put(category, (self.categories.get(category) or 0) + n)
        recent = self.recent.get() + [event["amount"] for event in values]
        self.recent.update(recent[-RECENT:])
        yield {"user": key, "count": self.count.value(), "total": self.total.get()}


def user_totals_job(
    spark: Any,
    *,
    job_id: str,
    input_dir: str | Path,
    parallelism: int,
    conf: StateBackendConf,
    on_malformed: str = "fail",
    key_by: Any = KEY_FIELD,
    **options: Any,
) -> StatefulJob:
    """The example job over the event log in ``input_dir``; ``options`` are the other
    ``StatefulJob`` arguments (batch_size, checkpoint_every, restore, output_dir)."""
    return StatefulJob(
        spark,
        job_id=job_id,
        source=LogSource(str(input_dir), on_malformed=on_malformed),
        operator_id=OPERATOR_ID,
        key_by=key_by,
        function=UserTotals(),
        parallelism=parallelism,
        conf=conf,
        **options,
    )


def generate_events(
    directory: str | Path, events: int, users: int, partitions: int, seed: int
) -> None:
    """Append ``events`` events of ``users`` users to ``partitions`` partition files;
    user ``u<n>`` always writes to partition ``n % partitions``."""
    rng = random.Random(seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines: dict[int, list[str]] = {p: [] for p in range(partitions)}
    for _ in range(events):
        n = rng.randrange(users)
        event = {
            "user": f"u{n}",
            "amount": rng.randint(1, 100),
            "category": rng.choice(CATEGORIES),
        }
        lines[n % partitions].append(json.dumps(event) + "\n")
    for partition, items in lines.items():
        with partition_path(directory, partition).open("a", encoding="utf-8") as f:
            f.writelines(items)


def read_events(directory: str | Path) -> Iterable[dict[str, Any]]:
    """Every event in the source directory, partition by partition, in file order."""
    for path in sorted(Path(directory).glob("partition-*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):
                    yield json.loads(line)


def expected_totals(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The state a correct run ends with, per user: count, total, categories, recent."""
    totals: dict[str, dict[str, Any]] = {}
    for event in events:
        user = totals.setdefault(
            event["user"], {"count": 0, "total": 0, "categories": {}, "recent": []}
        )
        user["count"] += 1
        user["total"] += event["amount"]
        user["categories"][event["category"]] = user["categories"].get(event["category"], 0) + 1
        user["recent"] = (user["recent"] + [event["amount"]])[-RECENT:]
    return totals


def checkpointed_totals(
    spark: Any, checkpoint: str, storage_options: dict[str, Any] | None = None
) -> dict[str, dict[str, Any]]:
    """The example's state in a completed checkpoint, per user, shaped like
    ``expected_totals`` (read with ``read_state``)."""
    totals: dict[str, dict[str, Any]] = {}
    for descriptor in (COUNT, TOTAL, CATEGORY_COUNTS, RECENT_AMOUNTS):
        frame = read_state(spark, checkpoint, OPERATOR_ID, descriptor.name, storage_options)
        for row in frame.collect():
            value = row["value"]
            if isinstance(value, str):
                value = json.loads(value)
            totals.setdefault(row["key"], {})[descriptor.name] = value
    return totals


def compare_totals(
    expected: dict[str, dict[str, Any]], actual: dict[str, dict[str, Any]]
) -> list[str]:
    """Differences between two per-user totals (empty when they are equal)."""
    problems = []
    for user in sorted(set(expected) | set(actual)):
        want, got = expected.get(user), actual.get(user)
        if want != got:
            problems.append(f"{user}: expected {want}, got {got}")
    return problems
