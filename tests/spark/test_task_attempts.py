"""Two Spark task attempts of one keyed subtask checkpoint the same batch: their files and
acks never mix, and the batch manifest accepts exactly one attempt's changelog record per
subtask (the other attempts' records are deleted).

Spark launches a speculative copy only on another host than the running attempt (and
local masters do not run the speculation scheduler at all), so on one machine the second
attempt of a subtask comes from a retry: attempt 0 snapshots and acknowledges, is slow,
then fails; attempt 1 runs the batch again. The session runs with ``spark.speculation``
on and task retries allowed (``local[2,3]``). Real ``keyed_task``, RocksDB, incremental
uploads and coordinator; the state is compared with a plain-Python computation.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from pyspark import TaskContext, cloudpickle
from pyspark.sql import SparkSession

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import StrSerializer
from statebackend.snapshot.changelog_format import ChangelogHandle
from statebackend.spark.example import COUNT, TOTAL, UserTotals
from statebackend.spark.local_state import LocalVersion
from statebackend.spark.tasks import RECORD, KeyedPlan, KeyedResult, StorageSpec, keyed_task
from statebackend.state.interfaces import ReducingState, ValueState
from statebackend.tools.gc import find_garbage

pytestmark = pytest.mark.spark
# The tasks run this module's functions; its workers need not be able to import it.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

M = 128
P = 2
OPERATOR = "totals"
SLOW_SUBTASK = 0


@pytest.fixture
def spark_speculative(_spark_sessions: Any, tmp_path: Path) -> Iterator[SparkSession]:
    """A SparkSession with speculation on and up to 3 attempts per task (the shared
    session is stopped first and restarted by the next test that asks for it)."""
    _spark_sessions.stop()
    session = (
        SparkSession.builder.master("local[2,3]")
        .appName("statebackend-tests-speculation")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.python.worker.reuse", "true")
        .config("spark.local.dir", str(tmp_path / "spark-local"))
        .config("spark.speculation", "true")
        .config("spark.speculation.interval", "100ms")
        .config("spark.speculation.quantile", "0.5")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


def slow_first_attempt(
    plan: KeyedPlan, subtask: int, items: list[tuple[int, tuple[Any, ...]]]
) -> Iterator[KeyedResult]:
    """Run the keyed subtask; attempt 0 of ``SLOW_SUBTASK`` is slow, then fails after it
    has checkpointed and acknowledged."""
    results = list(keyed_task(plan, subtask, iter(items)))
    context = TaskContext.get()
    if subtask == SLOW_SUBTASK and context is not None and context.attemptNumber() == 0:
        time.sleep(1.0)
        raise RuntimeError("the slow first attempt fails after its checkpoint")
    yield from results


def test_two_attempts_of_a_subtask_never_mix_their_files(
    spark_speculative: SparkSession, tmp_path: Path
) -> None:
    rng = random.Random(11)
    events = [(f"user-{rng.randrange(40)}", rng.randrange(1, 100)) for _ in range(2000)]
    expected: dict[str, tuple[int, int]] = {}
    routed: list[list[tuple[int, tuple[Any, ...]]]] = [[] for _ in range(P)]
    serializer = StrSerializer()
    for user, amount in events:
        count, total = expected.get(user, (0, 0))
        expected[user] = (count + 1, total + amount)
        group = assign_to_key_group(serializer.serialize(user), M)
        subtask = compute_operator_index_for_key_group(M, P, group)
        record = {"user": user, "amount": amount, "category": "c"}
        routed[subtask].append((subtask, (RECORD, user, record)))

    url = (tmp_path / "checkpoints").as_uri()
    storage = CheckpointStorage(url, "job", incremental=True)
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    checkpoint_id = coordinator.trigger({OPERATOR: P})
    plan = KeyedPlan(
        operator_id=OPERATOR,
        backend="rocksdb",
        function=UserTotals(),
        key_serializer=serializer,
        batch_id=0,
        version=LocalVersion("generation-1", None, None, P, M),
        storage=StorageSpec(url, "job", {}, 2, "none", incremental=True),
        local_dir=str(tmp_path / "local"),
        output_dir=None,
        checkpoint_id=checkpoint_id,
        wait_for_upload=True,
        run_id=coordinator.run_id,
    )
    sc = spark_speculative.sparkContext
    results = (
        sc.parallelize(range(P), P)
        .mapPartitionsWithIndex(lambda index, _: slow_first_attempt(plan, index, routed[index]))
        .collect()
    )
    assert sorted(r.subtask for r in results) == list(range(P))

    acks = storage.read_acks(checkpoint_id)
    slow = [ack for ack in acks if ack.subtask == SLOW_SUBTASK]
    assert len(slow) == 2 and len({ack.attempt for ack in slow}) == 2
    for ack in acks:  # every file an ack names was written by that attempt
        assert ack.run == coordinator.run_id and ack.attempt is not None
        for file in ack.files():
            name = file.path.rsplit("/", 1)[-1]
            assert name.startswith(f"{OPERATOR}-{ack.subtask}-{ack.run}-{ack.attempt}-")

    directory = coordinator.poll(checkpoint_id)
    assert directory is not None
    metadata = storage.load(checkpoint_id)
    taken = metadata.operators[OPERATOR].subtasks[SLOW_SUBTASK]
    assert taken in slow
    assert find_garbage(storage.fs, storage.layout.job_dir) == []

    checkpointed = _totals(
        lambda backend: restore_keyed_state(backend, storage.fs, directory, metadata, OPERATOR)
    )
    assert checkpointed == expected

    # Both attempts of the slow subtask wrote a changelog record; the manifest accepts
    # the one of the attempt whose result Spark collected, and cleanup deletes the other.
    changelog = ChangelogStorage(storage)
    records = storage.layout.batch_changelog_dir(0)
    names = storage.fs.list_dir(records)
    assert len([n for n in names if n.startswith(f"{OPERATOR}-{SLOW_SUBTASK}-")]) == 2
    ordered = sorted(results, key=lambda result: result.subtask)
    handles = [ChangelogHandle.from_json(result.changelog) for result in ordered]
    manifest = changelog.commit(0, {OPERATOR: handles}, max_parallelism=M)
    kept = sorted(storage.fs.list_dir(records))
    assert kept == sorted(str(handle.path).rsplit("/", 1)[-1] for handle in handles)
    rebuilt = _totals(lambda backend: rebuild_keyed_state(backend, changelog, manifest, OPERATOR))
    assert rebuilt == expected
    storage.close()


def _totals(load: Any) -> dict[str, tuple[int, int]]:
    """(count, total) per user of a heap backend over all key groups, after ``load``."""
    backend = HeapKeyedStateBackend(
        max_parallelism=M, key_group_range=compute_key_group_range_for_operator_index(M, 1, 0)
    )
    load(backend)
    restored: dict[str, tuple[int, int]] = {}
    for user in backend.keys(COUNT.name):
        backend.set_current_key(user)
        count = cast(ValueState, backend.get_state(COUNT)).value()
        total = cast(ReducingState, backend.get_state(TOTAL)).get()
        restored[user] = (count, total)
    return restored
