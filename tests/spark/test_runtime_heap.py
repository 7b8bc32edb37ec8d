"""The heap backend in the Spark runtime: state in the Python workers' memory; a subtask
that lands in another worker rebuilds its last batch from the batch manifest."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession

from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.spark.local_state import LocalKeyedState, LocalVersion, local_keyed_state
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState
from tests.spark.jobs import assert_matches_python, rescale_runs, settings

COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)


def test_heap_rescale_matches_python(spark_local: SparkSession, tmp_path: Path) -> None:
    """P = 2 -> 3 with backend=heap, input appended between runs: the final checkpoint
    holds what a plain-Python computation gives; checkpoints only every 5 batches."""
    conf = settings(tmp_path, ("spark.statebackend.backend", "heap"))
    summaries = rescale_runs(
        spark_local,
        tmp_path,
        conf,
        (2, 3),
        800,
        job_id="heap",
        batch_size=100,
        checkpoint_every=5,
    )
    assert [s.records for s in summaries] == [800, 800]
    for summary in summaries:
        assert summary.failures == 0 and summary.rollbacks == 0
        assert len(summary.checkpoints) < summary.batches
    assert summaries[1].restored_bytes[0] > 0
    assert_matches_python(spark_local, tmp_path, summaries[-1].last_checkpoint, {})


def test_heap_local_state_reuse_and_stale(tmp_path: Path) -> None:
    """Without Spark: a current copy in this process is reused; a missing one is rebuilt
    from the restore point (here none: empty), never from the local directory."""
    storage = CheckpointStorage(tmp_path.as_uri(), "job")
    root = tmp_path / "local"

    def local(previous: int | None) -> LocalKeyedState:
        version = LocalVersion("g1", previous, None, 1, 128, accepted=("a",))
        return local_keyed_state(root, 0, version, storage, "op", StrSerializer(), "heap")

    with local(None) as state:
        assert state.backend is not None and not state.reused
        state.backend.set_current_key("k")
        count = state.backend.get_state(COUNT)
        assert isinstance(count, ValueState)
        count.update(5)
        state.commit(0, "a")
    with local(0) as state:
        assert state.reused and state.backend is not None
        count = state.backend.get_state(COUNT)
        assert isinstance(count, ValueState)
        state.backend.set_current_key("k")
        assert count.value() == 5
    # Left without commit: the copy is gone.
    with local(0) as state:
        assert not state.reused and state.backend is not None
        count = state.backend.get_state(COUNT)
        assert isinstance(count, ValueState)
        state.backend.set_current_key("k")
        assert count.value() == 0
        state.commit(1, "a")
    assert not root.exists()  # heap state never touches the local directory
