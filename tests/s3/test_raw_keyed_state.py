"""Raw keyed state: bytes per key group, checkpointed at P and restored at P'.

For every pair P -> P' in {1, 2, 3, 4, 7}, on ``file://`` and ``s3://`` and with the
three codecs, each new subtask must get the streams of exactly its key groups, byte for
byte, from whichever old subtasks held them, reading only those key groups' bytes. The
checkpoint also shows its raw keyed state in ``inspect``, passes ``verify``, fails it
when the raw file is damaged, and survives a savepoint copy.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.raw_keyed import RawKeyedState
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import restore_raw_keyed_state
from statebackend.checkpoint.savepoints import copy_checkpoint
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.checksums import DOCUMENT_CHECKSUM
from statebackend.errors import CheckpointCorruptedError, SerializationError, StateAccessError
from statebackend.keygroups import KeyGroupRange, compute_key_group_range_for_operator_index
from statebackend.snapshot.keyed_format import FRAME_BYTES
from tests.conftest import Storage
from tests.s3.test_cli import cli

MAX_PARALLELISM = 64
PARALLELISMS = (1, 2, 3, 4, 7)
OPERATOR = "window"
CODECS = ("none", "lz4", "zstd")
BIG_KEY_GROUP = 5
"""A key group whose stream spans several frames."""


def key_group_range(parallelism: int, index: int) -> KeyGroupRange:
    """Subtask ``index``'s range (Flink's formula, written out here independently)."""
    start = (index * MAX_PARALLELISM + parallelism - 1) // parallelism
    end = ((index + 1) * MAX_PARALLELISM - 1) // parallelism
    return KeyGroupRange(start, end)


def model_streams(seed: int) -> dict[int, bytes]:
    """Streams of random key groups (about two in three have one), one spanning frames."""
    rng = random.Random(seed)
    streams = {
        group: rng.randbytes(rng.randrange(1, 300))
        for group in range(MAX_PARALLELISM)
        if rng.random() < 0.66
    }
    streams[BIG_KEY_GROUP] = rng.randbytes(FRAME_BYTES + 12345)
    return streams


_CACHE: dict[tuple[str, int], tuple[Storage, int, dict[int, bytes]]] = {}


def build_checkpoint(storage: Storage, parallelism: int) -> tuple[Storage, int, dict[int, bytes]]:
    """Subtasks at ``parallelism`` write the model's streams of their key groups,
    checkpoint, then keep writing; returns (storage, checkpoint id, streams at the cut)."""
    streams = model_streams(parallelism)
    checkpoints = CheckpointStorage(
        storage.url,
        "job",
        storage_options=storage.storage_options,
        compression=CODECS[parallelism % len(CODECS)],
    )
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=MAX_PARALLELISM)
    states = [RawKeyedState(key_group_range(parallelism, i)) for i in range(parallelism)]
    for group, data in streams.items():
        owner = next(s for s in states if group in s.key_group_range)
        owner.write(group, data)
    checkpoint_id = coordinator.trigger({OPERATOR: parallelism})
    futures = [
        checkpoints.snapshot_target(checkpoint_id, OPERATOR, i).write_raw_keyed_snapshot(
            checkpoint_id, state.sync_cut()
        )
        for i, state in enumerate(states)
    ]
    for state in states:  # after the cut: not in the checkpoint
        for group in state.key_group_range:
            state.write(group, b"late")
    try:
        for i, future in enumerate(futures):
            ack = SubtaskAck(
                OPERATOR, i, parallelism, None, None, coordinator.run_id, raw_keyed=future.result()
            )
            checkpoints.write_ack(checkpoint_id, ack)
        assert coordinator.poll(checkpoint_id) is not None
    finally:
        checkpoints.close()
    return storage, checkpoint_id, streams


class CountingFileSystem:
    """The checkpoint file system, counting the bytes of ranged reads."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.bytes_read = 0

    def read_range(self, path: str, start: int, length: int) -> bytes:
        data: bytes = self.fs.read_range(path, start, length)
        self.bytes_read += len(data)
        return data


@pytest.mark.parametrize("new_parallelism", PARALLELISMS)
@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_rescale(parallelism: int, new_parallelism: int, checkpoint_url: Storage) -> None:
    """Each new subtask gets exactly the streams of its key groups, reading only them."""
    scheme = checkpoint_url.url.split("://", 1)[0]
    if (scheme, parallelism) not in _CACHE:
        _CACHE[(scheme, parallelism)] = build_checkpoint(checkpoint_url, parallelism)
    storage, checkpoint_id, streams = _CACHE[(scheme, parallelism)]
    checkpoints = CheckpointStorage(storage.url, "job", storage_options=storage.storage_options)
    metadata = checkpoints.load(checkpoint_id)
    directory = checkpoints.resolve(checkpoint_id)
    restored: dict[int, bytes] = {}
    for i in range(new_parallelism):
        key_groups = compute_key_group_range_for_operator_index(MAX_PARALLELISM, new_parallelism, i)
        assert key_groups == key_group_range(new_parallelism, i)
        counting = CountingFileSystem(checkpoints.fs)
        state = restore_raw_keyed_state(
            counting,  # type: ignore[arg-type]
            directory,
            metadata,
            OPERATOR,
            key_groups,
        )
        assert state.is_restored
        mine = {g: s for g, s in streams.items() if g in key_groups}
        assert {g: state.read(g) for g in state.key_groups()} == mine
        # Frames add a 13-byte header each; nothing of other key groups is read.
        frames = sum(-(-len(s) // FRAME_BYTES) for s in mine.values())
        if CODECS[parallelism % len(CODECS)] == "none":
            assert counting.bytes_read == sum(map(len, mine.values())) + 13 * frames
        restored.update(mine)
    assert restored == streams


def test_absent_operator_restores_empty(tmp_path: Path) -> None:
    storage, checkpoint_id, _ = build_checkpoint(Storage(tmp_path.as_uri()), 2)
    checkpoints = CheckpointStorage(storage.url, "job")
    metadata = checkpoints.load(checkpoint_id)
    state = restore_raw_keyed_state(
        checkpoints.fs, checkpoints.resolve(checkpoint_id), metadata, "other", KeyGroupRange(0, 63)
    )
    assert not state.is_restored
    assert list(state.key_groups()) == []


def test_writes_outside_the_range_or_not_bytes_are_rejected() -> None:
    state = RawKeyedState(KeyGroupRange(10, 19))
    with pytest.raises(StateAccessError, match="key group 20 is outside"):
        state.write(20, b"x")
    with pytest.raises(SerializationError, match="must be bytes"):
        state.write(12, "text")  # type: ignore[arg-type]
    state.write(12, b"x")
    state.write(12, b"")
    assert list(state.key_groups()) == []


def test_ack_without_raw_keyed_state_keeps_its_old_json() -> None:
    """Additive: acks without raw keyed state write and read the JSON they always did."""
    old = {"operator": "op", "subtask": 0, "parallelism": 1, "keyed": None, "operator_state": None}
    ack = SubtaskAck.from_json(old)
    assert ack.raw_keyed is None
    assert ack.to_json() == old


def test_inspect_verify_and_savepoint(
    checkpoint_url: Storage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage, checkpoint_id, streams = build_checkpoint(checkpoint_url, 3)
    checkpoints = CheckpointStorage(storage.url, "job", storage_options=storage.storage_options)
    directory = checkpoints.resolve(checkpoint_id)

    status, out, _ = cli(capsys, storage, "inspect", directory, "--json")
    assert status == 0
    info = json.loads(out)["operators"][OPERATOR]
    assert info["raw_keyed_bytes"] > sum(map(len, streams.values()))
    assert [sub["raw_keyed_key_groups"] for sub in info["subtasks"]] == [
        sum(1 for g in streams if g in key_group_range(3, i)) for i in range(3)
    ]
    status, out, _ = cli(capsys, storage, "inspect", directory)
    assert "raw keyed state: " in out and f"in {len(streams)} key groups" in out
    assert cli(capsys, storage, "verify", directory)[0] == 0

    savepoint = str(tmp_path / "savepoint")
    copy_checkpoint(checkpoints.fs, directory, CheckpointStorage(savepoint, "x").fs, savepoint)
    saved = CheckpointStorage(savepoint, "x")
    state = restore_raw_keyed_state(
        saved.fs, savepoint, saved.load(savepoint), OPERATOR, KeyGroupRange(0, 63)
    )
    assert {g: state.read(g) for g in state.key_groups()} == streams

    handle = checkpoints.load(checkpoint_id).operators[OPERATOR].subtasks[1].raw_keyed
    assert handle is not None
    raw_file = f"{directory}/{handle.path}"
    data = bytearray(checkpoints.fs.read_file(raw_file))
    data[20] ^= 0xFF
    checkpoints.fs.write_atomic(raw_file, bytes(data))
    status, out, _ = cli(capsys, storage, "verify", directory)
    assert status == 1
    assert f"FAILED {raw_file}" in out


def _repeat_handle(subtasks: list[dict[str, Any]]) -> None:
    subtasks[1]["raw_keyed"] = subtasks[0]["raw_keyed"]


def _beyond_max_parallelism(subtasks: list[dict[str, Any]]) -> None:
    raw = subtasks[1]["raw_keyed"]
    raw["key_group_range"][1] = MAX_PARALLELISM + 100
    raw["key_groups"][-1][0] = MAX_PARALLELISM + 50


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [(_repeat_handle, "overlap"), (_beyond_max_parallelism, "go beyond 0..63")],
)
def test_raw_keyed_ranges_that_overlap_or_exceed_the_key_groups_are_refused(
    checkpoint_url: Storage, mutate: Callable[[list[dict[str, Any]]], None], reason: str
) -> None:
    """Two subtasks' raw keyed handles holding the same key groups (subtask 0's handle
    repeated as subtask 1's), or one holding a key group beyond the max parallelism,
    loaded; a restore silently lost the streams of subtask 1's key groups, or of that key
    group."""
    storage, checkpoint_id, streams = build_checkpoint(checkpoint_url, 2)
    checkpoints = CheckpointStorage(storage.url, "job", storage_options=storage.storage_options)
    path = checkpoints.layout.metadata_path(checkpoint_id)
    document = json.loads(checkpoints.fs.read_file(path))
    del document[DOCUMENT_CHECKSUM]
    mutate(document["operators"][OPERATOR]["subtasks"])
    checkpoints.fs.write_atomic(path, json.dumps(document).encode())
    with pytest.raises(CheckpointCorruptedError) as caught:
        checkpoints.load(checkpoint_id)
    assert path in str(caught.value) and "raw keyed key-group ranges" in str(caught.value)
    assert reason in str(caught.value)
