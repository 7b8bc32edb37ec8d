"""S3 faults: connection resets, stalls, truncated responses and slow bandwidth between s3fs
and the local S3 server (``tests/faultproxy.py``), during checkpoints and restores.

The client here gives up quickly on its own (s3fs and botocore retry once, 1 s timeouts),
so that the retries that count are those of ``CheckpointFileSystem``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import CheckpointFileSystem, RetryPolicy
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointError
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.state.descriptors import ValueStateDescriptor
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
    return CheckpointFileSystem(fs, retry)


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
