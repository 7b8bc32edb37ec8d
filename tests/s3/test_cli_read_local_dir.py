"""Where ``statebackend read`` downloads: into ``--local-dir`` (default: where
``spark.statebackend.local.dir``'s default is), not the system's temp directory, in a read
copy it locks (``local_copies.read_scratch``), so that what a read killed midway leaves is
found and removed by ``statebackend local-gc``, while a read still running keeps its own.

The reads go to S3 through ``tests/faultproxy.py``, slowed until the test lets them end.
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import StrSerializer
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState
from statebackend.tools.local_copies import READS, LocalCopy
from tests.conftest import S3Endpoint
from tests.faultproxy import Fault, FaultProxy
from tests.processes import WAIT, kill_when, wait_for
from tests.scripts import REPO

pytestmark = pytest.mark.s3

M = 128
OPERATOR = "op"
STATE = ValueStateDescriptor("blob", StrSerializer())
SLOW = 16 * 1024
"""Bytes per second of a slowed response: the state's files (about 1 MB) take a minute."""


@dataclass
class Source:
    """What the reads read (a checkpoint or a manifest on S3) and what they must print
    (the plain-Python model)."""

    path: str
    expected: dict[str, str]


def _blobs(rng: random.Random, keys: range) -> dict[str, str]:
    """Incompressible values of 400 characters."""
    return {f"key-{n}": base64.b64encode(rng.randbytes(300)).decode() for n in keys}


def _put(backend: RocksDBKeyedStateBackend, values: dict[str, str]) -> None:
    state = backend.get_state(STATE)
    assert isinstance(state, ValueState)
    for key, value in values.items():
        backend.set_current_key(key)
        state.update(value)


def _checkpoint(
    storage: CheckpointStorage, backend: RocksDBKeyedStateBackend, batch_id: int | None = None
) -> int:
    """A completed incremental checkpoint of the one subtask; its id."""
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    properties = None if batch_id is None else {"batch_id": batch_id}
    checkpoint_id = coordinator.trigger({OPERATOR: 1}, properties=properties)
    handle = backend.snapshot(
        checkpoint_id, storage.snapshot_target(checkpoint_id, OPERATOR, 0)
    ).result()
    coordinator.acknowledge(
        checkpoint_id, SubtaskAck(OPERATOR, 0, 1, handle, None, coordinator.run_id)
    )
    assert storage.latest_completed() == storage.resolve(checkpoint_id)
    return checkpoint_id


@pytest.fixture(params=["checkpoint", "manifest"])
def source(
    request: pytest.FixtureRequest, s3_endpoint: S3Endpoint, tmp_path: Path
) -> Iterator[Source]:
    """An incremental checkpoint of about 1 MB, or a batch manifest on one (its base) and
    the changelog record of a later batch."""
    location = s3_endpoint.new_storage()
    storage = CheckpointStorage(
        location.url, "job", storage_options=location.storage_options, incremental=True
    )
    backend = RocksDBKeyedStateBackend(
        tmp_path / "db", max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1)
    )
    rng = random.Random(7)
    model = _blobs(rng, range(2500))
    try:
        if request.param == "checkpoint":
            _put(backend, model)
            yield Source(storage.resolve(_checkpoint(storage, backend)), model)
            return
        changelog = ChangelogStorage(storage)
        backend.enable_changelog()
        for batch_id, changed in ((1, model), (2, _blobs(rng, range(0, 3000, 7)))):
            _put(backend, changed)
            record = changelog.write_record(batch_id, OPERATOR, 0, "a1", backend.drain_changelog())
            changelog.commit(batch_id, {OPERATOR: [record]}, max_parallelism=M)
            model = {**model, **changed}
            if batch_id == 1:
                changelog.materialized(_checkpoint(storage, backend, batch_id), batch_id)
        manifest = changelog.load_manifest(2)
        assert manifest.base is not None  # the rebuild downloads the incremental base
        yield Source(changelog.layout.manifest_path(2), model)
    finally:
        backend.dispose()
        storage.close()


def _env(temp: Path) -> dict[str, str]:
    """The environment of a command whose system temp directory is ``temp``."""
    return {
        **os.environ,
        "TMPDIR": str(temp),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def _options(endpoint_url: str, s3_endpoint: S3Endpoint) -> list[str]:
    options = {**s3_endpoint.storage_options, "endpoint_url": endpoint_url}
    return [f"--storage-option={k}={v}" for k, v in options.items()]


def _reader(argv: list[str], temp: Path, output: Path) -> subprocess.Popen[bytes]:
    """``statebackend read`` in another process, printing into ``output`` (a file: a
    pipe nobody reads would stop it) and its errors into ``output`` + ``.err``."""
    with output.open("wb") as out, output.with_suffix(".err").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "statebackend", *argv], env=_env(temp), stdout=out, stderr=err
        )


def _records(reader: subprocess.Popen[bytes], output: Path) -> dict[str, Any]:
    """What ``reader`` printed, once it ended well."""
    assert reader.wait(timeout=WAIT) == 0, output.with_suffix(".err").read_text()
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len({r["key"] for r in records}) == len(records)
    return {r["key"]: r["value"] for r in records}


def _files_in(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]


def test_a_killed_read_leaves_its_downloads_in_local_dir_for_local_gc(
    source: Source, s3_endpoint: S3Endpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two reads download slowly; one is killed (SIGKILL) midway. ``local-gc --apply``
    deletes what the killed one downloaded and keeps the live one's; the live one then
    prints the model's state, and neither the system's temp directory nor the local
    directory holds anything after."""
    local, temp = tmp_path / "local", tmp_path / "tmp"
    local.mkdir()
    temp.mkdir()
    live_copy, killed_copy = LocalCopy(local / READS, 0), LocalCopy(local / READS, 1)
    with FaultProxy(s3_endpoint.endpoint_url, bytes_per_second=SLOW) as proxy:
        proxy.inject(Fault.SLOW)
        argv = ["read", source.path, "--operator", OPERATOR, "--state", STATE.name]
        argv += [*_options(proxy.url, s3_endpoint), "--local-dir", str(local)]
        live = _reader(argv, temp, tmp_path / "live.jsonl")
        killed = None
        try:
            wait_for(lambda: bool(_files_in(live_copy.directory)), live, "downloaded")
            killed = _reader(argv, temp, tmp_path / "killed.jsonl")
            kill_when(lambda: bool(_files_in(killed_copy.directory)), killed, "downloaded")
            assert _files_in(killed_copy.directory)  # left behind
            assert list(temp.iterdir()) == []

            capsys.readouterr()
            assert main(["local-gc", str(local), "--apply"]) == 0
            lines = capsys.readouterr().out.splitlines()
            assert [Path(line.split()[1]) for line in lines[:-1]] == [killed_copy.directory]
            assert "downloads of a read" in lines[0]
            assert lines[-1].startswith("deleted 1 local copies")
            assert not killed_copy.directory.exists() and not killed_copy.lock.exists()
            assert live.poll() is None, "the live read ended before local-gc ran"
            assert _files_in(live_copy.directory) and live_copy.lock.exists()

            proxy.bytes_per_second = 1 << 30
            assert _records(live, tmp_path / "live.jsonl") == source.expected
        finally:
            for process in (live, killed):
                if process is not None and process.poll() is None:
                    process.kill()
                    process.wait()
    assert list(temp.iterdir()) == []
    assert list(local.iterdir()) == []


def test_read_downloads_where_local_dir_defaults_to(
    source: Source, s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    """Without --local-dir a read downloads under the default of
    spark.statebackend.local.dir (in the system's temp directory): where that is a file,
    the read fails naming it; once it is gone, the read prints the model's state and
    leaves no file in the system's temp directory."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    code = "from statebackend.spark.conf import StateBackendConf as C; print(C().local_dir)"
    default = Path(
        subprocess.run(
            [sys.executable, "-c", code], env=_env(temp), capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    assert default.parent == temp
    argv = ["read", source.path, "--operator", OPERATOR, "--state", STATE.name]
    argv += _options(s3_endpoint.endpoint_url, s3_endpoint)
    default.write_text("not a directory")
    failed = _reader(argv, temp, tmp_path / "failed.jsonl")
    assert failed.wait(timeout=WAIT) == 1
    [line] = (tmp_path / "failed.err").read_text().splitlines()
    assert line.startswith(f"statebackend: error: the local directory {default} is unusable")
    default.unlink()
    assert _records(_reader(argv, temp, tmp_path / "out.jsonl"), tmp_path / "out.jsonl") == (
        source.expected
    )
    assert [p for p in temp.rglob("*") if p.is_file()] == []
