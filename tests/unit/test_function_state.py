"""The executor-side lifecycle of a keyed function's operator state
(``spark/function_state.py``), without Spark: a batch that follows the committed batch in
the same process goes on with the live function; a retried batch, another process or a
rescale starts from the restored state of the last committed batch, so that nothing is
appended twice."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from statebackend.backends.operator import OperatorStateBackend, OperatorStateCut
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.spark.api import KeyedContext, KeyedFunction
from statebackend.spark.function_state import (
    LIVE_FUNCTIONS,
    FunctionRun,
    keep_function,
    start_function,
)
from statebackend.spark.local_state import LocalVersion
from statebackend.state.functions import FunctionInitializationContext, FunctionSnapshotContext
from tests.scripts import REPO


class Buffer(KeyedFunction):
    """Buffers every value it sees in split list state ``items``."""

    def __init__(self) -> None:
        self.initialized = 0
        self.snapshots: list[int] = []

    def initialize_state(self, ctx: FunctionInitializationContext) -> None:
        self.initialized += 1
        self.restored = ctx.is_restored
        self.items = ctx.operator_state_store.get_list_state("items", IntSerializer())

    def snapshot_state(self, ctx: FunctionSnapshotContext) -> None:
        self.snapshots.append(ctx.checkpoint_id)

    def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Iterator[Any]:
        self.items.add_all(values)
        yield from ()


class Counted(KeyedFunction):
    """A ListCheckpointed function: its state is the list of values seen."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def snapshot_state(self, checkpoint_id: int) -> list[Any]:
        return list(self.seen)

    def restore_state(self, state: list[Any]) -> None:
        self.seen = list(state)

    def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Iterator[Any]:
        self.seen += values
        yield from ()


def version(previous_batch: int | None) -> LocalVersion:
    return LocalVersion("run-1", previous_batch, None, 1, 128, accepted=("a",))


class Restores:
    """The ``restore`` callable: the cut committed last, counting calls."""

    def __init__(self) -> None:
        self.committed: OperatorStateCut | None = None
        self.calls = 0

    def __call__(self) -> OperatorStateBackend:
        self.calls += 1
        return OperatorStateBackend(self.committed)


def run_batch(
    root: Path, restores: Restores, batch: int, values: list[int], commit: bool = True
) -> FunctionRun:
    run = start_function(Buffer(), root, 0, version(batch - 1 if batch else None), True, restores)
    assert isinstance(run.function, Buffer)
    run.function.items.add_all(values)
    cut = run.snapshot(batch)
    if commit:
        restores.committed = cut
        keep_function(run, root, 0, version(batch - 1 if batch else None), batch, "a")
    return run


def test_the_live_function_goes_on_and_a_retry_restores_the_committed_state(
    tmp_path: Path,
) -> None:
    restores = Restores()
    first = run_batch(tmp_path, restores, 0, [1, 2])
    assert restores.calls == 1
    second = run_batch(tmp_path, restores, 1, [3])
    assert second is first and restores.calls == 1  # live: not initialized again
    assert isinstance(second.function, Buffer)
    assert second.function.initialized == 1 and second.function.snapshots == [0, 1]
    run_batch(tmp_path, restores, 2, [4], commit=False)  # an attempt that fails
    retry = run_batch(tmp_path, restores, 2, [4])
    assert restores.calls == 2 and retry is not first
    assert isinstance(retry.function, Buffer) and retry.function.restored
    assert retry.function.items.get() == [1, 2, 3, 4]


def test_a_batch_retried_after_it_committed_here_restores_the_batch_before(
    tmp_path: Path,
) -> None:
    """Batch 1 committed on this subtask but failed on another: its rerun must not
    continue from this subtask's batch-1 state."""
    restores = Restores()
    run_batch(tmp_path, restores, 0, [1])
    at_zero = restores.committed
    run_batch(tmp_path, restores, 1, [2])
    restores.committed = at_zero  # the driver never committed batch 1
    rerun = run_batch(tmp_path, restores, 1, [2])
    assert isinstance(rerun.function, Buffer)
    assert restores.calls == 2 and rerun.function.items.get() == [1, 2]


def test_a_reused_keyed_copy_without_the_live_function_restores_it(tmp_path: Path) -> None:
    restores = Restores()
    run_batch(tmp_path, restores, 0, [1])
    other_root = tmp_path / "other-process"
    run = start_function(Buffer(), other_root, 0, version(0), True, restores)
    assert isinstance(run.function, Buffer) and run.function.items.get() == [1]
    assert restores.calls == 2


def test_list_checkpointed_and_plain_functions(tmp_path: Path) -> None:
    restores = Restores()
    run = start_function(Counted(), tmp_path, 0, version(None), False, restores)
    assert isinstance(run.function, Counted)
    run.function.seen += [5, 6]
    restores.committed = run.snapshot(0)
    other = start_function(Counted(), tmp_path / "elsewhere", 0, version(0), False, restores)
    assert isinstance(other.function, Counted) and other.function.seen == [5, 6]

    class Plain(KeyedFunction):
        def process(self, key: Any, values: list[Any], ctx: KeyedContext) -> Iterator[Any]:
            yield from ()

    plain = start_function(Plain(), tmp_path, 1, version(None), False, restores)
    assert plain.checkpointed is None and plain.snapshot(0) is None
    assert restores.calls == 2


def test_the_readme_example_buffers_late_events(tmp_path: Path) -> None:
    readme = REPO / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(encoding="utf-8"), re.DOTALL)
    (block,) = (b for b in blocks if "class LateEvents(KeyedFunction)" in b)
    namespace: dict[str, Any] = {}
    exec(block, namespace)  # noqa: S102 - our own README
    restores = Restores()
    run = start_function(namespace["LateEvents"](), tmp_path, 0, version(None), False, restores)
    events = [{"id": "e1", "ts": 1, "watermark": 5}, {"id": "e2", "ts": 9, "watermark": 5}]
    assert list(run.function.process("alice", events, cast(KeyedContext, None))) == [
        {"user": "alice", "events": 2}
    ]
    restored = OperatorStateBackend(run.snapshot(0))
    assert restored.get_list_state("late", StrSerializer()).get() == ["e1"]
    rules = restored.get_broadcast_state("rules", StrSerializer(), IntSerializer())
    assert dict(rules.items()) == {"default": 1}


def test_a_process_keeps_the_live_functions_of_a_bounded_number_of_subtasks(
    tmp_path: Path,
) -> None:
    """A worker serving many jobs keeps at most LIVE_FUNCTIONS live functions: the least
    recently run is dropped and restored at its next batch; the others go on."""
    jobs = [Restores() for _ in range(LIVE_FUNCTIONS + 1)]
    first = run_batch(tmp_path / "job-0", jobs[0], 0, [1])
    second = run_batch(tmp_path / "job-1", jobs[1], 0, [2])
    for index in range(2, len(jobs)):
        run_batch(tmp_path / f"job-{index}", jobs[index], 0, [index])
    assert run_batch(tmp_path / "job-1", jobs[1], 1, [20]) is second  # job-0 went first
    assert jobs[1].calls == 1
    again = run_batch(tmp_path / "job-0", jobs[0], 1, [10])
    assert again is not first and jobs[0].calls == 2
    assert isinstance(again.function, Buffer) and again.function.items.get() == [1, 10]


def test_a_live_function_of_an_attempt_the_manifest_did_not_accept_is_not_continued(
    tmp_path: Path,
) -> None:
    """Attempt A of batch 1 ran subtask 0 (of 2) in this process and kept its function
    live, but manifest 1 accepted attempt B (run elsewhere): batch 2 here restores B's
    operator state instead of going on with A's function; with A accepted it goes on. The
    live function of another subtask left by an attempt the manifest did not accept is
    dropped too."""

    def at(previous: int, *accepted: str) -> LocalVersion:
        return LocalVersion("run-1", previous, None, 2, 128, previous, accepted)

    restores = Restores()
    a = start_function(Buffer(), tmp_path, 0, at(0, "attempt-0", "attempt-01"), True, restores)
    assert isinstance(a.function, Buffer) and restores.calls == 1
    a.function.items.add_all([2])
    a.snapshot(1)
    keep_function(a, tmp_path, 0, at(0), 1, "attempt-a")
    other = start_function(Buffer(), tmp_path, 1, at(0), True, restores)
    keep_function(other, tmp_path, 1, at(0), 1, "attempt-a1")
    # Attempt B of batch 1, elsewhere, appended 3: manifest 1 accepts it.
    b = OperatorStateBackend()
    b.get_list_state("items", IntSerializer()).add_all([3])
    restores.committed = b.sync_cut()
    calls = restores.calls
    accepted_b = at(1, "attempt-b", "attempt-a1")
    rerun = start_function(Buffer(), tmp_path, 0, accepted_b, True, restores)
    assert rerun is not a and restores.calls == calls + 1
    assert isinstance(rerun.function, Buffer) and rerun.function.items.get() == [3]
    # Subtask 1's live function, left by the accepted attempt, goes on ...
    assert start_function(Buffer(), tmp_path, 1, accepted_b, True, restores) is other
    keep_function(other, tmp_path, 1, at(0), 1, "attempt-a1")
    keep_function(a, tmp_path, 0, at(0), 1, "attempt-a")
    # ... and is dropped once subtask 0 opens with another attempt accepted for it.
    start_function(Buffer(), tmp_path, 0, at(1, "attempt-a", "attempt-c1"), True, restores)
    calls = restores.calls
    start_function(Buffer(), tmp_path, 1, at(1, "attempt-a", "attempt-a1"), True, restores)
    assert restores.calls == calls + 1
    keep_function(a, tmp_path, 0, at(0), 1, "attempt-a")
    assert start_function(Buffer(), tmp_path, 0, at(1, "attempt-a", "x"), True, restores) is a
