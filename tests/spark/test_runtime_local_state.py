"""Executor-local state without Spark: RocksDB reopen, the version marker protocol, and
the rebuild of a stale copy from a batch manifest."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import IncompatibleStateError
from statebackend.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
)
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.snapshot.changelog_format import ChangelogHandle
from statebackend.spark.local_state import LocalKeyedState, LocalVersion, local_keyed_state
from statebackend.state.descriptors import MapStateDescriptor, ValueStateDescriptor
from statebackend.state.interfaces import MapState, ValueState

COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)
ALL = KeyGroupRange(0, 127)


def test_rocksdb_close_and_open_existing(tmp_path: Path) -> None:
    backend = RocksDBKeyedStateBackend(tmp_path / "db", max_parallelism=128, key_group_range=ALL)
    count = backend.get_state(COUNT)
    tags = backend.get_state(MapStateDescriptor("tags", StrSerializer(), IntSerializer()))
    assert isinstance(count, ValueState) and isinstance(tags, MapState)
    for key in ("a", "b"):
        backend.set_current_key(key)
        count.update(len(key) + 1)
        tags.put("x", 1)
    backend.close()
    reopened = RocksDBKeyedStateBackend(
        tmp_path / "db", open_existing=True, max_parallelism=128, key_group_range=ALL
    )
    count = reopened.get_state(COUNT)
    assert isinstance(count, ValueState)
    reopened.set_current_key("b")
    assert count.value() == 2
    assert sorted(reopened.keys("tags")) == ["a", "b"]  # carried although not registered
    reopened.close()
    with pytest.raises(IncompatibleStateError, match="key_group_range"):
        RocksDBKeyedStateBackend(
            tmp_path / "db",
            open_existing=True,
            max_parallelism=128,
            key_group_range=KeyGroupRange(0, 63),
        )


def test_marker_reuse_and_stale(tmp_path: Path) -> None:
    """A copy at the expected batch is reused; any other (another generation, a task
    that failed midway) is wiped and rebuilt from the restore point, here none: empty."""
    storage = CheckpointStorage(tmp_path.as_uri(), "job")

    def local(previous: int | None, generation: str = "g1") -> LocalKeyedState:
        version = LocalVersion(generation, previous, None, 1, 128, accepted=("a",))
        return local_keyed_state(tmp_path / "local", 0, version, storage, "op", StrSerializer())

    def count_of_k(state: LocalKeyedState) -> int:
        assert state.backend is not None
        count = state.backend.get_state(COUNT)
        assert isinstance(count, ValueState)
        state.backend.set_current_key("k")
        return int(count.value())

    with local(None) as state:
        assert state.backend is not None and not state.reused
        state.backend.set_current_key("k")
        count = state.backend.get_state(COUNT)
        assert isinstance(count, ValueState)
        count.update(5)
        state.commit(0, "a")
    with local(0) as state:
        assert state.reused and state.restored_bytes == 0 and count_of_k(state) == 5
        state.commit(1, "a")
    with local(1, "g2") as state:  # another generation: not reused
        assert not state.reused and not state.rebuilt and count_of_k(state) == 0
    with local(1) as state:  # g2 left without commit: the copy is gone
        assert not state.reused
        state.commit(1, "a")
    with pytest.raises(RuntimeError), local(1) as state:  # a task failing midway ...
        assert state.reused
        raise RuntimeError("boom")
    with local(1) as state:  # ... leaves no current copy behind
        assert not state.reused


def test_copies_of_subtasks_beyond_a_lower_parallelism_are_removed(tmp_path: Path) -> None:
    """A run at parallelism 3 leaves copies of subtasks 0-2; the next at parallelism 2
    removes subtask 2's (nothing would reuse it) when a subtask opens, unless a task
    still holds it."""
    storage = CheckpointStorage(tmp_path.as_uri(), "job")
    root = tmp_path / "local"

    def run(subtask: int, parallelism: int) -> LocalKeyedState:
        version = LocalVersion("g1", None, None, parallelism, 128)
        return local_keyed_state(root, subtask, version, storage, "op", StrSerializer())

    for subtask in range(3):
        with run(subtask, 3) as state:
            state.commit(0, "a")
    assert (root / "subtask-2").is_dir() and (root / "subtask-2.version").exists()
    with run(2, 3) as held:  # a task of the old run holds subtask 2 ...
        with run(0, 2) as state:
            state.commit(1, "b")
        assert (root / "subtask-2").is_dir()  # ... so it stays
        held.commit(1, "a")
    with run(1, 2) as state:
        state.commit(1, "b")
    assert sorted(p.name for p in root.iterdir()) == [
        f"subtask-{i}{suffix}" for i in range(2) for suffix in ("", ".lock", ".version")
    ]


@pytest.mark.parametrize("kind", ["rocksdb", "heap"])
def test_a_commit_in_background_is_waited_for_by_the_next_opener(tmp_path: Path, kind: str) -> None:
    """``commit(in_background=True)``, as a task whose Python worker outlives it commits:
    RocksDB is closed and marked by this process's closer thread after the context is left
    (a heap copy is kept at once); the next batch's opener, right after, waits for it and
    reuses the copy, and the counts add up as in plain Python."""
    storage = CheckpointStorage(tmp_path.as_uri(), "job")

    def local(previous: int | None) -> LocalKeyedState:
        version = LocalVersion("g1", previous, None, 1, 128, accepted=("a",))
        return local_keyed_state(
            tmp_path / "local", 0, version, storage, "op", StrSerializer(), kind
        )

    expected: dict[str, int] = {}
    for batch in range(6):
        with local(batch - 1 if batch else None) as state:
            assert state.reused == (batch > 0) and state.backend is not None
            count = state.backend.get_state(COUNT)
            assert isinstance(count, ValueState)
            for n in range(20):
                key = f"user-{(n * 3 + batch) % 7}"
                state.backend.set_current_key(key)
                count.update(count.value() + n)
                expected[key] = expected.get(key, 0) + n
            state.commit(batch, "a", in_background=True)
        if kind == "rocksdb":
            names = [thread.name for thread in threading.enumerate()]
            assert any(name.startswith("statebackend-close") for name in names), names
    with local(5) as state:
        assert state.reused and state.backend is not None
        count = state.backend.get_state(COUNT)
        assert isinstance(count, ValueState)
        actual = {}
        for key in expected:
            state.backend.set_current_key(key)
            actual[key] = count.value()
    assert actual == expected


@pytest.mark.parametrize("kind", ["rocksdb", "heap"])
def test_a_stale_copy_is_rebuilt_from_the_batch_manifest(tmp_path: Path, kind: str) -> None:
    """Subtask 1 of 2 without a current copy rebuilds exactly its key groups from the
    manifest of the previous batch (records of two batches written at parallelism 1)."""
    storage = CheckpointStorage(tmp_path.as_uri(), "job")
    changelog = ChangelogStorage(storage)
    writer = RocksDBKeyedStateBackend(tmp_path / "writer", max_parallelism=128, key_group_range=ALL)
    writer.enable_changelog()
    count = writer.get_state(COUNT)
    assert isinstance(count, ValueState)
    expected: dict[str, int] = {}
    for batch_id in range(2):
        for i in range(40):
            key = f"user-{(i * 7 + batch_id) % 30}"
            writer.set_current_key(key)
            count.update(count.value() + 1)
            expected[key] = expected.get(key, 0) + 1
        handle = changelog.write_record(batch_id, "op", 0, "a", writer.drain_changelog())
        changelog.commit(batch_id, {"op": [handle]}, max_parallelism=128)
    writer.dispose()

    version = LocalVersion("g1", 1, None, 2, 128, restore_manifest=1)
    subtask = 1
    owned = compute_key_group_range_for_operator_index(128, 2, subtask)
    with local_keyed_state(
        tmp_path / "local", subtask, version, storage, "op", StrSerializer(), kind
    ) as state:
        assert state.rebuilt and not state.reused and state.restored_bytes > 0
        assert state.backend is not None
        restored = state.backend.get_state(COUNT)
        assert isinstance(restored, ValueState)
        actual = {}
        for key in state.backend.keys(COUNT.name):
            state.backend.set_current_key(key)
            actual[key] = restored.value()
    serialize = StrSerializer().serialize
    mine = {k: v for k, v in expected.items() if assign_to_key_group(serialize(k), 128) in owned}
    assert actual == mine and 0 < len(mine) < len(expected)


@pytest.mark.parametrize("kind", ["rocksdb", "heap"])
@pytest.mark.parametrize("accepted", ["attempt-a", "attempt-b"])
def test_a_copy_is_reused_only_if_the_manifest_accepted_the_attempt_that_left_it(
    tmp_path: Path, kind: str, accepted: str
) -> None:
    """Batch 1 of subtask 0 runs twice: attempt A on host 1 (count 2) marks its copy at
    batch 1, but the batch fails elsewhere before manifest 1 is written; it runs again on
    host 2, attempt B (count 3). At batch 2 on host 1 the copy says batch 1 either way: it
    is reused if manifest 1 accepted A, and rebuilt from manifest 1 (B's count) if it
    accepted B, instead of going on from state no manifest holds."""
    storage = CheckpointStorage(tmp_path.as_uri(), "job")
    changelog = ChangelogStorage(storage)

    def run_batch(
        host: str, batch: int, previous_accepted: str | None, attempt: str, count: int
    ) -> tuple[LocalKeyedState, int, ChangelogHandle]:
        """Run subtask 0's batch on ``host``: set k's count, write the record, commit
        the local copy; the state, k's count before and the record's handle."""
        previous = batch - 1 if batch else None
        attempts = None if previous_accepted is None else (previous_accepted,)
        version = LocalVersion("g1", previous, None, 1, 128, previous, attempts)
        root = tmp_path / host
        with local_keyed_state(root, 0, version, storage, "op", StrSerializer(), kind) as state:
            assert state.backend is not None
            state.backend.enable_changelog()
            state.backend.set_current_key("k")
            value = state.backend.get_state(COUNT)
            assert isinstance(value, ValueState)
            before = int(value.value())
            value.update(count)
            handle = changelog.write_record(
                batch, "op", 0, attempt, state.backend.drain_changelog()
            )
            state.commit(batch, attempt)
        return state, before, handle

    _, _, zero = run_batch("host1", 0, None, "attempt-0", 1)
    changelog.commit(0, {"op": [zero]}, max_parallelism=128)
    first, before, a = run_batch("host1", 1, "attempt-0", "attempt-a", 2)
    assert first.reused and before == 1
    second, before, b = run_batch("host2", 1, "attempt-0", "attempt-b", 3)
    assert second.rebuilt and before == 1
    changelog.commit(1, {"op": [a if accepted == "attempt-a" else b]}, max_parallelism=128)

    state, before, _ = run_batch("host1", 2, accepted, "attempt-c", 4)
    if accepted == "attempt-a":
        assert state.reused and not state.rebuilt and before == 2
    else:
        assert not state.reused and state.rebuilt and state.restored_bytes > 0
        assert before == 3
