"""Progress of the ``statebackend`` commands' long work on a checkpoint of several hundred
files, on file:// and s3://: the tools report each unit of work, and the command shows a
bar on stderr when it is a terminal (a pseudo-terminal here), its answer on stdout the same."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.tools.location import CheckpointRef, open_checkpoint
from statebackend.tools.plan import plan_checkpoint
from statebackend.tools.reader import read_state, select_state
from tests.conftest import Storage

OPERATOR = "op"
OLD_P = 200
M = 512
UNION_SUBTASKS = 5
VALUE = ValueStateDescriptor("value", IntSerializer())
ELEMENT_BYTES = 30_000
"""Operator-state elements too large to be inlined in ``_metadata``: each subtask's
operator state is a file of its own."""


def _element(subtask: int) -> str:
    return str(subtask % 10) * ELEMENT_BYTES


@dataclass(frozen=True)
class BigCheckpoint:
    storage: Storage
    path: str
    files: int


@pytest.fixture(scope="module", params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def big(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BigCheckpoint]:
    """A checkpoint of operator ``op`` at P=200: per subtask a keyed state file and an
    operator state file (split ``offsets``, one element each; union ``config`` in the
    first five subtasks)."""
    if request.param == "s3":
        storage = request.getfixturevalue("s3_endpoint").new_storage()
    else:
        storage = Storage(tmp_path_factory.mktemp("big").as_uri())
    checkpoints = CheckpointStorage(storage.url, "big", storage_options=storage.storage_options)
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=M)
    backends = [
        HeapKeyedStateBackend(
            max_parallelism=M,
            key_group_range=compute_key_group_range_for_operator_index(M, OLD_P, i),
        )
        for i in range(OLD_P)
    ]
    for n in range(4 * OLD_P):
        key = f"k{n}"
        group = assign_to_key_group(StrSerializer().serialize(key), M)
        backend = backends[compute_operator_index_for_key_group(M, OLD_P, group)]
        backend.set_current_key(key)
        backend.get_state(VALUE).update(n)  # type: ignore[attr-defined]
    checkpoint_id = coordinator.trigger({OPERATOR: OLD_P})
    for i, backend in enumerate(backends):
        operator = OperatorStateBackend()
        operator.get_list_state("offsets", StrSerializer()).update([_element(i)])
        if i < UNION_SUBTASKS:
            operator.get_union_list_state("config", StrSerializer()).update([_element(i)])
        target = checkpoints.snapshot_target(checkpoint_id, OPERATOR, i)
        keyed = backend.snapshot(checkpoint_id, target).result()
        handle = target.write_operator_snapshot(checkpoint_id, operator.sync_cut()).result()
        checkpoints.write_ack(
            checkpoint_id, SubtaskAck(OPERATOR, i, OLD_P, keyed, handle, coordinator.run_id)
        )
    path = coordinator.poll(checkpoint_id)
    assert path is not None
    files = len(checkpoints.load(path).files())
    assert files >= 2 * OLD_P
    yield BigCheckpoint(storage, path, files)
    checkpoints.close()


def on_terminal(storage: Storage, *argv: str) -> tuple[int, str, str]:
    """Run ``statebackend argv`` with stderr on a pseudo-terminal: (exit status, stdout,
    what the terminal showed)."""
    options = [f"--storage-option={k}={v}" for k, v in storage.storage_options.items()]
    terminal, stderr = pty.openpty()
    with tempfile.TemporaryFile() as stdout:  # not a pipe: read after the terminal closes
        process = subprocess.Popen(
            [sys.executable, "-m", "statebackend", *argv, *options],
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, "TERM": "xterm", "COLUMNS": "120"},
        )
        os.close(stderr)
        shown = []
        while True:
            try:
                data = os.read(terminal, 1 << 16)
            except OSError:  # the command exited: its end of the terminal is closed
                break
            if not data:
                break
            shown.append(data)
        status = process.wait()
        os.close(terminal)
        stdout.seek(0)
        return status, stdout.read().decode(), b"".join(shown).decode(errors="replace")


def without_terminal(storage: Storage, *argv: str) -> tuple[int, str, str]:
    """Run ``statebackend argv`` with stderr a pipe: (exit status, stdout, stderr)."""
    options = [f"--storage-option={k}={v}" for k, v in storage.storage_options.items()]
    done = subprocess.run(
        [sys.executable, "-m", "statebackend", *argv, *options],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def test_plan_tells_each_new_subtask_planned(big: BigCheckpoint) -> None:
    """``plan`` plans one new subtask after the other: ``planned`` hears each one, and
    the plan is the same with it; every new subtask gets the five union elements."""
    ref = open_checkpoint(big.path, big.storage.storage_options)
    planned: list[tuple[str, int]] = []
    plans = plan_checkpoint(ref, 20, planned=lambda *done: planned.append(done))
    assert planned == [(OPERATOR, i) for i in range(20)]
    assert plans == plan_checkpoint(ref, 20)
    config = [{"value": _element(i)} for i in range(UNION_SUBTASKS)]
    assert all(sub["operator_state"]["config"]["values"] == config for sub in plans[OPERATOR])
    assert sum(sub["operator_state"]["offsets"]["elements"] for sub in plans[OPERATOR]) == OLD_P


def test_plan_shows_progress_on_a_terminal(big: BigCheckpoint) -> None:
    argv = ("plan", big.path, "-p", "20")
    status, out, shown = on_terminal(big.storage, *argv)
    assert status == 0, shown
    assert "planning" in shown and "subtasks" in shown
    assert (status, out, "") == without_terminal(big.storage, *argv)


def test_read_on_a_terminal_writes_its_records_to_stdout(big: BigCheckpoint) -> None:
    """``read`` with stderr on a terminal and stdout in a file (``read ... > out.jsonl``
    in a terminal) wrote its records onto the terminal, above the progress bar, and
    nothing into the file. They go to stdout, as without a terminal."""
    argv = ("read", big.path, "--operator", OPERATOR, "--state", "value", "--format", "jsonl")
    status, out, shown = on_terminal(big.storage, *argv)
    assert status == 0, shown
    assert "reading" in shown and '"value"' not in shown
    assert sorted(json.loads(line)["value"] for line in out.splitlines()) == list(range(4 * OLD_P))
    assert (status, out, "") == without_terminal(big.storage, *argv)


def test_read_of_an_operator_state_counts_its_elements_on_a_terminal(big: BigCheckpoint) -> None:
    """``read --state`` of an operator state showed a bar of the operator's keyed bytes
    (or of 0 bytes) that never moved: its total came from the keyed state. It now counts
    the elements read: the split ``offsets`` has one per old subtask."""
    argv = ("read", big.path, "--operator", OPERATOR, "--state", "offsets", "--format", "jsonl")
    status, out, shown = on_terminal(big.storage, *argv)
    assert status == 0, shown
    assert "elements" in shown and f"{OLD_P}/{OLD_P}" in shown and "kB" not in shown
    assert sorted(json.loads(line)["value"] for line in out.splitlines()) == sorted(
        _element(i) for i in range(OLD_P)
    )
    assert (status, out, "") == without_terminal(big.storage, *argv)


def counting_reads(big: BigCheckpoint) -> tuple[CheckpointRef, list[tuple[str, int, int]]]:
    """The checkpoint opened, and the (path, start, length) of each ranged read through it
    from now on."""
    ref = open_checkpoint(big.path, big.storage.storage_options)
    reads: list[tuple[str, int, int]] = []
    read_range = ref.fs.read_range

    def counted(path: str, start: int, length: int) -> bytes:
        reads.append((path, start, length))
        return read_range(path, start, length)

    ref.fs.read_range = counted  # type: ignore[method-assign]
    return ref, reads


def test_plan_reads_only_the_shown_states_each_stored_range_once(big: BigCheckpoint) -> None:
    """``plan`` showed the small union state by restoring every operator state (the large
    split ``offsets`` too) for every new subtask: 20 new subtasks read the five union
    elements 20 times over and all 200 offsets. Now it reads each of the five union
    elements' ranges once and no offsets."""
    ref, reads = counting_reads(big)
    plans = plan_checkpoint(ref, 20)
    config = [{"value": _element(i)} for i in range(UNION_SUBTASKS)]
    assert all(sub["operator_state"]["config"]["values"] == config for sub in plans[OPERATOR])
    assert len(reads) == len(set(reads)) == UNION_SUBTASKS
    assert all(length == ELEMENT_BYTES for _, _, length in reads)


def test_read_of_an_operator_state_reads_only_that_state(big: BigCheckpoint) -> None:
    """``read --state config`` (the union state of five elements) restored every operator
    state of the operator: all 200 ``offsets`` elements were read too, one ranged read
    each. It now reads the five ``config`` ranges only."""
    ref, reads = counting_reads(big)
    records = list(read_state(ref, select_state(ref, OPERATOR, "config")))
    assert records == [{"value": _element(i)} for i in range(UNION_SUBTASKS)]
    assert len(reads) == len(set(reads)) == UNION_SUBTASKS
    assert all(length == ELEMENT_BYTES for _, _, length in reads)
