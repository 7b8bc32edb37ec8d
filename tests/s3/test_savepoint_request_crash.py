"""A driver killed (SIGKILL) while it copies a requested savepoint: the partial copy is
never taken for a savepoint, and the savepoint the request then gets from a newer
checkpoint holds exactly the files its ``_metadata`` references (and that ``_metadata``),
none of the killed copy's. The driver runs in another process and reaches S3 through
``tests/faultproxy.py``, slowed once its checkpoint is acknowledged, so that it is killed
with part of the copy written."""

from __future__ import annotations

import posixpath
import subprocess
import sys
import time
from pathlib import Path

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.layout import metadata_path
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.requests import (
    answer_savepoint_request,
    pending_savepoint_requests,
    request_savepoint,
    wait_for_savepoint,
)
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
)
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState
from tests.conftest import S3Endpoint, Storage, raw_fs
from tests.faultproxy import Fault, FaultProxy
from tests.processes import kill_when
from tests.s3.test_cli import assert_one_error_line
from tests.s3.test_cli_write_safety import run_cli
from tests.scripts import REPO

pytestmark = pytest.mark.s3

M = 128
P = 8
OPERATOR = "op"
COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)
_DRIVER = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from tests.s3.test_savepoint_request_crash import checkpoint_into_request
url, endpoint = sys.argv[1:]
options = {{"endpoint_url": endpoint, "key": "testing", "secret": "testing"}}
checkpoint_into_request(url, options, seed=1, between=lambda: (
    print("acknowledged", flush=True), sys.stdin.readline()))
"""
"""A driver serving the job's savepoint request with a checkpoint of ``P`` subtasks; it
says when the checkpoint is acknowledged and completes it (copying the savepoint) once
told to."""


def model(seed: int) -> dict[str, int]:
    """The state of the checkpoint of ``seed``: a count per key."""
    return {f"key-{n}": n * 31 + seed for n in range(400)}


def checkpoint_into_request(
    url: str, options: dict[str, str], seed: int, between: object = None
) -> str:
    """Serve the job's oldest savepoint request as its driver does: trigger a checkpoint
    into the request's directory, acknowledge it (``P`` heap subtasks holding
    ``model(seed)``), call ``between``, complete it (which copies the savepoint) and
    answer; the savepoint's path."""
    storage = CheckpointStorage(url, "job", storage_options=options)
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    [request] = pending_savepoint_requests(storage.fs, storage.layout.job_dir)
    checkpoint_id = coordinator.trigger(
        {OPERATOR: P}, savepoint_dir=request.savepoint_dir(storage.layout.job_dir)
    )
    values = model(seed)
    for i in range(P):
        backend = HeapKeyedStateBackend(
            max_parallelism=M, key_group_range=compute_key_group_range_for_operator_index(M, P, i)
        )
        count = backend.get_state(COUNT)
        assert isinstance(count, ValueState)
        for key, value in values.items():
            if assign_to_key_group(StrSerializer().serialize(key), M) in backend.key_group_range:
                backend.set_current_key(key)
                count.update(value)
        target = storage.snapshot_target(checkpoint_id, OPERATOR, i, coordinator.run_id)
        handle = backend.snapshot(checkpoint_id, target).result()
        storage.write_ack(
            checkpoint_id, SubtaskAck(OPERATOR, i, P, handle, None, coordinator.run_id)
        )
        backend.dispose()
    if callable(between):
        between()
    while (path := coordinator.poll(checkpoint_id)) is None:
        time.sleep(0.05)
    answer_savepoint_request(storage.fs, storage.layout.job_dir, request, path)
    storage.close()
    return path


def _files(location: Storage, directory: str) -> set[str]:
    """The files under ``directory``, relative to it."""
    fs = raw_fs(location)
    root = directory.split("://", 1)[-1].rstrip("/")
    return {posixpath.relpath(path, root) for path in fs.find(root)}


def _restored(storage: CheckpointStorage, directory: str) -> dict[str, int]:
    backend = HeapKeyedStateBackend(
        max_parallelism=M, key_group_range=compute_key_group_range_for_operator_index(M, 1, 0)
    )
    restore_keyed_state(
        backend, storage.fs, directory, load_metadata(storage.fs, directory), OPERATOR
    )
    count = backend.get_state(COUNT)
    assert isinstance(count, ValueState)
    out = {}
    for key in backend.keys("count"):
        backend.set_current_key(key)
        out[key] = count.value()
    backend.dispose()
    return out


def test_a_driver_killed_while_copying_a_requested_savepoint_leaves_nothing_of_it(
    s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    location = s3_endpoint.new_storage()
    storage = CheckpointStorage(location.url, "job", storage_options=location.storage_options)
    job_dir = storage.layout.job_dir
    request_id = request_savepoint(storage.fs, job_dir)
    [request] = pending_savepoint_requests(storage.fs, job_dir)
    savepoint = request.savepoint_dir(job_dir)

    with FaultProxy(s3_endpoint.endpoint_url, bytes_per_second=4000) as proxy:
        driver = subprocess.Popen(
            [sys.executable, "-c", _DRIVER, location.url, proxy.url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert driver.stdout is not None and driver.stdin is not None
            assert driver.stdout.readline().strip() == "acknowledged"
            proxy.inject(Fault.SLOW)
            driver.stdin.write("go\n")
            driver.stdin.flush()
            kill_when(lambda: bool(_files(location, savepoint)), driver, "copied a file")
        finally:
            if driver.poll() is None:  # it failed before the kill
                driver.kill()
                driver.wait()
    partial = _files(location, savepoint)
    assert partial and "_metadata" not in partial  # killed midway

    # The partial copy is no savepoint: not for the request, verify, nor a restore.
    assert [r.request_id for r in pending_savepoint_requests(storage.fs, job_dir)] == [request_id]
    result = run_cli(location, "verify", savepoint)
    assert result.returncode == 1
    assert_one_error_line(result.stderr)

    # The next driver serves the request from a newer checkpoint.
    served = checkpoint_into_request(location.url, location.storage_options, seed=2)
    assert wait_for_savepoint(storage.fs, job_dir, request_id, 10) == served
    metadata = load_metadata(storage.fs, served)
    assert metadata.is_savepoint and metadata.checkpoint_id == 2
    referenced = {relative for relative, _, _ in metadata.files()}
    assert _files(location, served) == referenced | {"_metadata"}
    assert run_cli(location, "verify", served).returncode == 0
    assert _restored(storage, served) == model(2)
    assert storage.fs.exists(metadata_path(served))
    storage.close()


def test_a_savepoint_create_killed_midway_is_cleaned_up_by_the_next_one(
    s3_endpoint: S3Endpoint,
) -> None:
    """``savepoint create`` killed while it copies into a directory holding a file of the
    user's: run again from a newer checkpoint, it deletes the killed copy's files, keeps
    the user's file, and the savepoint holds exactly the files its ``_metadata``
    references."""
    location = s3_endpoint.new_storage()
    storage = CheckpointStorage(location.url, "job", storage_options=location.storage_options)
    job_dir = storage.layout.job_dir
    request_savepoint(storage.fs, job_dir)
    checkpoint_into_request(location.url, location.storage_options, seed=3)
    source = storage.latest_completed()
    assert source is not None
    target = posixpath.join(job_dir, "savepoints", "by-hand")
    storage.fs.write_atomic(posixpath.join(target, "notes.txt"), b"the user's")
    argv = ["-m", "statebackend", "savepoint", "create", "--from", source, "--to", target]
    with FaultProxy(s3_endpoint.endpoint_url, bytes_per_second=4000) as proxy:
        proxy.inject(Fault.SLOW)
        options = {**location.storage_options, "endpoint_url": proxy.url}
        copier = subprocess.Popen(
            [sys.executable, *argv, *(f"--storage-option={k}={v}" for k, v in options.items())],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        kill_when(
            lambda: bool(_files(location, target) - {"notes.txt", "_copying"}),
            copier,
            "copied a file",
        )
    assert "_metadata" not in _files(location, target)
    request_savepoint(storage.fs, job_dir)  # a newer checkpoint, of other files
    newer = checkpoint_into_request(location.url, location.storage_options, seed=4)
    source = storage.latest_completed()
    assert source is not None and source != newer
    result = run_cli(location, "savepoint", "create", "--from", source, "--to", target)
    assert result.returncode == 0, result.stderr
    metadata = load_metadata(storage.fs, target)
    referenced = {relative for relative, _, _ in metadata.files()}
    assert _files(location, target) == referenced | {"_metadata", "notes.txt"}
    assert _restored(storage, target) == model(4)
    storage.close()
