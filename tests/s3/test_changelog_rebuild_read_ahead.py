"""A rebuild reads its changelog records ahead of their replay, several at once (the
storage's transfer threads), and replays them in order: the state equals a plain-Python
model of every operation, and a record that cannot be read stops the rebuild at that
record, naming it, with nothing of it or of a later record applied."""

from __future__ import annotations

import copy
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from statebackend.checkpoint import changelog_restore
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import CheckpointFileSystem, open_filesystem
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.signing import FILE_CHECKSUM, SigningKey
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.checksums import CRC32
from statebackend.errors import CheckpointCorruptedError
from tests.conftest import Storage
from tests.s3.changelog_jobs import JOB, enabled, live_states, run_batch
from tests.s3.test_checkpoint_matrix import OPERATOR, KeyModel, make_backend, read_keyed

THREADS = 3
KEY = SigningKey(b"read-ahead-test-signing-key")


class InFlight(CheckpointFileSystem):
    """A file system that counts its ranged reads running at once (each held a little,
    so that reads started together overlap)."""

    def __init__(self, base: CheckpointFileSystem) -> None:
        super().__init__(base.fsspec, base.checksum_algorithm)
        self._counting = threading.Lock()
        self.running = self.most = self.reads = 0

    def read_range(self, path: str, start: int, length: int) -> bytes:
        with self._counting:
            self.running += 1
            self.reads += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.005)
            return super().read_range(path, start, length)
        finally:
            with self._counting:
                self.running -= 1


def open_job(storage: Storage, signed: bool) -> tuple[ChangelogStorage, InFlight]:
    key = KEY if signed else None
    algorithm = FILE_CHECKSUM if signed else CRC32
    base = open_filesystem(storage.url, storage.storage_options, checksum_algorithm=algorithm)
    fs = InFlight(base)
    checkpoints = CheckpointStorage(
        storage.url,
        JOB,
        storage_options=storage.storage_options,
        transfer_threads=THREADS,
        compression="lz4",
        filesystem=fs,
        signing_key=key,
    )
    return ChangelogStorage(checkpoints, retained=100), fs


def write_history(
    changelog: ChangelogStorage, parallelism: int, batches: int, tmp_path: Path
) -> tuple[list[BatchManifest], list[dict[str, dict[str, Any]]]]:
    """Batches 1..``batches`` of ``parallelism`` subtasks, no base: the manifests and
    the model's live state after each batch (index 0: before batch 1)."""
    rng = random.Random(parallelism * 31 + batches)
    models: dict[str, KeyModel] = {}
    backends = [
        enabled(make_backend("heap", tmp_path / f"writer-{i}", parallelism, i))
        for i in range(parallelism)
    ]
    manifests, states = [], [live_states(models)]
    try:
        for batch_id in range(1, batches + 1):
            manifests.append(run_batch(changelog, backends, batch_id, rng, models))
            states.append(copy.deepcopy(live_states(models)))
    finally:
        for backend in backends:
            backend.dispose()
    return manifests, states


def rebuilt_state(
    changelog: ChangelogStorage, manifest: BatchManifest, parallelism: int, kind: str, root: Path
) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for i in range(parallelism):
        backend = make_backend(kind, root / f"{kind}-{parallelism}-{i}", parallelism, i)
        try:
            rebuild_keyed_state(backend, changelog, manifest, OPERATOR)
            found.update(read_keyed(backend))
        finally:
            backend.dispose()
    return found


@pytest.mark.parametrize("signed", [False, True], ids=["plain", "signed"])
def test_a_rebuild_of_many_records_equals_the_model(
    s3_storage: Storage, tmp_path: Path, signed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 batches of 2 subtasks (80 records) rebuilt at 3 and at 1 subtasks from moto S3:
    every key's state is the model's; records were read up to ``THREADS`` at once (not
    one after another), and one at a time when the bytes ahead allow only one."""
    changelog, fs = open_job(s3_storage, signed)
    try:
        manifests, states = write_history(changelog, 2, 40, tmp_path)
        newest = manifests[-1]
        assert sum(len(batch.subtasks) for batch in newest.operators[OPERATOR]) == 80
        for parallelism, kind in [(3, "rocksdb"), (1, "heap")]:
            fs.most = fs.reads = 0
            found = rebuilt_state(changelog, newest, parallelism, kind, tmp_path / "rebuilt")
            assert found == states[-1]
            if not signed:  # a signed rebuild reads whole files through VerifiedReads
                assert fs.reads >= 80
                assert 2 <= fs.most <= THREADS
        monkeypatch.setattr(changelog_restore, "RECORD_BYTES_AHEAD", 1)
        fs.most = 0
        assert rebuilt_state(changelog, manifests[19], 2, "heap", tmp_path / "one") == states[20]
        if not signed:
            assert fs.most == 1
    finally:
        changelog.storage.close()


@pytest.mark.parametrize("damage", ["flipped", "missing"])
@pytest.mark.parametrize("signed", [False, True], ids=["plain", "signed"])
def test_a_bad_record_in_the_middle_of_the_window_stops_the_rebuild_there(
    s3_storage: Storage, tmp_path: Path, signed: bool, damage: str
) -> None:
    """Record 6 of 12 (one subtask) damaged or gone, while records 5-8 are read ahead:
    the rebuild fails naming record 6, and the backend holds exactly the state after
    batch 5: nothing of record 6 and nothing of the records after it."""
    changelog, _ = open_job(s3_storage, signed)
    try:
        manifests, states = write_history(changelog, 1, 12, tmp_path)
        newest = manifests[-1]
        (record,) = newest.operators[OPERATOR][5].subtasks
        assert record.batch_id == 6
        path = changelog.record_path(record)
        assert path is not None
        if damage == "missing":
            changelog.fs.delete(path)
            expected = "missing|not found|does not exist|gone"
        else:
            data = bytearray(changelog.fs.read_file(path))
            data[len(data) // 2] ^= 0xFF
            changelog.fs.write_atomic(path, bytes(data))
            expected = "does not match" if signed else "checksum|damaged|corrupt"
        backend = make_backend("heap", tmp_path / "rebuilt", 1, 0)
        try:
            with pytest.raises(CheckpointCorruptedError) as caught:
                rebuild_keyed_state(backend, changelog, newest, OPERATOR)
            message = str(caught.value)
            assert path.split("://")[-1] in message
            assert any(word in message for word in expected.split("|")), message
            assert read_keyed(backend) == states[5]
        finally:
            backend.dispose()
    finally:
        changelog.storage.close()
