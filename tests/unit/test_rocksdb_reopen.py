"""The RocksDB backend reopened batch after batch, as a keyed subtask's local copy is."""

from __future__ import annotations

from pathlib import Path

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import IntSerializer
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState

M = 128
FULL_RANGE = KeyGroupRange(0, M - 1)
COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)


def test_reopening_keeps_the_state_and_a_bounded_number_of_files(tmp_path: Path) -> None:
    """Each batch reopens the database and closes it: the counts add up as in plain
    Python, and RocksDB's info logs do not pile up (one more per open by default)."""
    directory = tmp_path / "subtask-0"
    expected: dict[str, int] = {}
    for batch in range(12):
        backend = RocksDBKeyedStateBackend(
            directory, open_existing=batch > 0, max_parallelism=M, key_group_range=FULL_RANGE
        )
        state = backend.get_state(COUNT)
        assert isinstance(state, ValueState)
        for n in range(batch, batch + 50):
            key = f"user-{n % 30}"
            backend.set_current_key(key)
            state.update(state.value() + n)
            expected[key] = expected.get(key, 0) + n
        backend.close()
    backend = RocksDBKeyedStateBackend(
        directory, open_existing=True, max_parallelism=M, key_group_range=FULL_RANGE
    )
    state = backend.get_state(COUNT)
    assert isinstance(state, ValueState)
    got = {}
    for key in expected:
        backend.set_current_key(key)
        got[key] = state.value()
    backend.close()
    assert got == expected
    logs = [path.name for path in (directory / "db").iterdir() if path.name.startswith("LOG")]
    assert len(logs) <= 2, sorted(logs)
