"""S3 faults: connection resets, stalls, truncated responses and slow bandwidth between s3fs
and the local S3 server (``tests/faultproxy.py``), during checkpoints and restores.

The client here gives up quickly on its own (s3fs and botocore retry once, 1 s timeouts),
so that the retries that count are those of ``CheckpointFileSystem``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import s3fs

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import CheckpointFileSystem, RetryPolicy
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata
from statebackend.errors import CheckpointError, CheckpointUnreadableError
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.spark.local_state import LocalKeyedState, LocalVersion, local_keyed_state
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState
from statebackend.tools.gc import find_garbage
from tests.conftest import S3Endpoint
from tests.faultproxy import Fault, FaultProxy

pytestmark = pytest.mark.s3

MAX_PARALLELISM = 16
OPERATOR = "op"
COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)
FAST_RETRY = RetryPolicy(attempts=4, first_delay=0.05, max_delay=0.2)


@pytest.fixture
def proxy(s3_endpoint: S3Endpoint) -> Iterator[FaultProxy]:
    with FaultProxy(s3_endpoint.endpoint_url, stall_seconds=2.0) as running:
        yield running


def fragile_fs(proxy: FaultProxy, retry: RetryPolicy = FAST_RETRY) -> CheckpointFileSystem:
    """s3fs through the proxy, retrying once itself, with 1 s timeouts."""
    fs = s3fs.S3FileSystem(
        endpoint_url=proxy.url,
        key="testing",
        secret="testing",
        skip_instance_cache=True,
        config_kwargs={
            "connect_timeout": 1,
            "read_timeout": 1,
            "retries": {"total_max_attempts": 1},
        },
    )
    fs.retries = 1
    return CheckpointFileSystem(fs, retry=retry)


def prefix(s3_endpoint: S3Endpoint) -> str:
    return s3_endpoint.new_storage().url


@pytest.mark.parametrize("fault", [Fault.RESET, Fault.TRUNCATE, Fault.STALL])
def test_reads_survive_transient_faults(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, fault: Fault
) -> None:
    fs = fragile_fs(proxy)
    path = f"{prefix(s3_endpoint)}/data.bin"
    data = random.Random(1).randbytes(50_000)
    fs.write_atomic(path, data)

    proxy.inject(fault, count=2)
    assert fs.read_range(path, 1000, 20_000) == data[1000:21_000]
    proxy.inject(fault, count=2)
    assert fs.read_file(path) == data
    assert proxy.injected[fault] == 4
    proxy.inject(fault, count=2)
    assert fs.size(path) == len(data)  # a HEAD has no body to truncate


def test_writes_of_metadata_and_acks_survive_transient_faults(
    proxy: FaultProxy, s3_endpoint: S3Endpoint
) -> None:
    fs = fragile_fs(proxy)
    path = f"{prefix(s3_endpoint)}/chk-1/_metadata"

    proxy.inject(Fault.RESET, count=2)
    fs.write_atomic(path, b"complete")

    assert proxy.injected[Fault.RESET] == 2
    assert fs.read_file(path) == b"complete"


def test_a_persistent_fault_is_one_error_naming_the_file(
    proxy: FaultProxy, s3_endpoint: S3Endpoint
) -> None:
    fs = fragile_fs(proxy)
    path = f"{prefix(s3_endpoint)}/data.bin"
    fs.write_atomic(path, b"x" * 1000)

    proxy.inject(Fault.RESET)
    with pytest.raises(CheckpointError, match=f"could not read {path}"):
        fs.read_range(path, 0, 100)
    assert proxy.injected[Fault.RESET] >= FAST_RETRY.attempts


ALL = KeyGroupRange(0, MAX_PARALLELISM - 1)


def new_backend() -> HeapKeyedStateBackend:
    return HeapKeyedStateBackend(max_parallelism=MAX_PARALLELISM, key_group_range=ALL)


def update(backend: HeapKeyedStateBackend, model: dict[str, int], rng: random.Random) -> None:
    """Add to random keys' counts, in the backend and in the plain-Python model."""
    count = cast(ValueState, backend.get_state(COUNT))
    for _ in range(300):
        key = f"k{rng.randrange(60)}"
        backend.set_current_key(key)
        count.update(count.value() + 1)
        model[key] = model.get(key, 0) + 1


def restored(fs: CheckpointFileSystem, directory: str) -> dict[str, int]:
    backend = new_backend()
    restore_keyed_state(backend, fs, directory, load_metadata(fs, directory), OPERATOR)
    count = cast(ValueState, backend.get_state(COUNT))
    state = {}
    for key in backend.keys("count"):
        backend.set_current_key(key)
        state[key] = count.value()
    return state


def checkpoint(
    coordinator: CheckpointCoordinator, storage: CheckpointStorage, backend: HeapKeyedStateBackend
) -> str | None:
    """Checkpoint ``backend`` as the only subtask; the completed directory."""
    checkpoint_id = coordinator.trigger({OPERATOR: 1})
    target = storage.snapshot_target(checkpoint_id, OPERATOR, 0)
    handle = backend.snapshot(checkpoint_id, target).result()
    ack = SubtaskAck(OPERATOR, 0, 1, handle, None, coordinator.run_id)
    return coordinator.acknowledge(checkpoint_id, ack)


def checkpointed(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, seed: int
) -> tuple[CheckpointStorage, str, dict[str, int]]:
    """A completed checkpoint, through the proxy, of a backend given ``seed``'s updates;
    its storage, directory and model."""
    storage = CheckpointStorage(prefix(s3_endpoint), "job", filesystem=fragile_fs(proxy))
    coordinator = CheckpointCoordinator(storage, max_parallelism=MAX_PARALLELISM)
    backend, model = new_backend(), {}  # type: ignore[var-annotated]
    update(backend, model, random.Random(seed))
    directory = checkpoint(coordinator, storage, backend)
    assert directory is not None
    return storage, directory, model


@pytest.mark.parametrize("fault", [Fault.RESET, Fault.STALL, Fault.TRUNCATE])
def test_a_checkpoint_meeting_a_fault_fails_and_the_next_one_completes(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, fault: Fault
) -> None:
    storage = CheckpointStorage(prefix(s3_endpoint), "job", filesystem=fragile_fs(proxy))
    coordinator = CheckpointCoordinator(storage, max_parallelism=MAX_PARALLELISM)
    backend, model, rng = new_backend(), {}, random.Random(2)  # type: ignore[var-annotated]
    update(backend, model, rng)

    proxy.inject(fault)  # every request until switched off
    with pytest.raises(CheckpointError):
        checkpoint(coordinator, storage, backend)
    proxy.inject(Fault.PASS)
    coordinator.abort_all()
    update(backend, model, rng)  # the job goes on
    directory = checkpoint(coordinator, storage, backend)

    assert directory is not None and proxy.injected[fault] > 0
    assert restored(storage.fs, directory) == model
    assert find_garbage(storage.fs, storage.layout.job_dir) == []


@pytest.mark.parametrize(
    ("fault", "count"),
    [(Fault.RESET, 2), (Fault.TRUNCATE, 2), (Fault.STALL, 1), (Fault.SLOW, None)],
)
def test_a_restore_through_faults_is_exact(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, fault: Fault, count: int | None
) -> None:
    storage, directory, model = checkpointed(proxy, s3_endpoint, seed=3)

    proxy.inject(fault, count)
    assert restored(storage.fs, directory) == model
    assert proxy.injected[fault] > 0


def test_a_failed_restore_leaves_no_local_state(
    proxy: FaultProxy, s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    storage, directory, model = checkpointed(proxy, s3_endpoint, seed=4)

    def local(generation: str, previous: int | None, restore: str | None) -> LocalKeyedState:
        version = LocalVersion(generation, previous, restore, 1, MAX_PARALLELISM, accepted=("a",))
        return local_keyed_state(tmp_path / "local", 0, version, storage, OPERATOR, StrSerializer())

    with local("g1", None, None) as state:  # a local copy, current at batch 0
        state.commit(0, "a")
    proxy.inject(Fault.RESET)
    with pytest.raises(CheckpointUnreadableError, match=f"cannot restore from {directory}"):
        local("g2", None, directory).__enter__()
    proxy.inject(Fault.PASS)

    # Nothing of the partial restore, and no marker that could make anything look current.
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["subtask-0.lock"]
    with local("g3", None, directory) as state:
        assert state.backend is not None and state.restored_bytes > 0
        count = cast(ValueState, state.backend.get_state(COUNT))
        for key, value in model.items():
            state.backend.set_current_key(key)
            assert count.value() == value
