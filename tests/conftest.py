"""Shared fixtures: checkpoint storage on the local file system and on a real local S3.

The S3 endpoint is moto's HTTP server on 127.0.0.1, used through s3fs as a user would
use S3 or MinIO. Dummy credentials are set, and AWS_ENDPOINT_URL points at a closed
local port, so that a client that forgets the endpoint fails locally instead of
contacting AWS.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.utils import get_protocol

_BUCKET = "statebackend-test"
_AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


@dataclass(frozen=True)
class Storage:
    """A checkpoint location: an fsspec URL and the storage options to open it with."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class S3Endpoint:
    """The local S3 server: its URL, a bucket that exists, and options to reach it."""

    endpoint_url: str
    bucket: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint_url, "key": "testing", "secret": "testing"}

    def new_storage(self) -> Storage:
        """A fresh, empty prefix in the bucket."""
        return Storage(f"s3://{self.bucket}/{uuid.uuid4().hex}", self.storage_options)


def raw_fs(location: Storage) -> fsspec.AbstractFileSystem:
    """A plain fsspec file system on ``location``'s storage, for the test's own I/O."""
    protocol = get_protocol(location.url)
    return fsspec.filesystem(
        protocol, **({"auto_mkdir": True} if protocol == "file" else location.storage_options)
    )


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """moto's S3 server on a free port of 127.0.0.1, with dummy AWS credentials set."""
    import boto3
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AWS_PROFILE", raising=False)
        for name, value in _AWS_TEST_ENV.items():
            mp.setenv(name, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint = S3Endpoint(endpoint_url=f"http://{host}:{port}", bucket=_BUCKET)
            client = boto3.client("s3", endpoint_url=endpoint.endpoint_url)
            client.create_bucket(Bucket=endpoint.bucket)
            yield endpoint
        finally:
            server.stop()


@pytest.fixture
def s3_storage(s3_endpoint: S3Endpoint) -> Storage:
    """A fresh s3:// prefix on the local S3 server."""
    return s3_endpoint.new_storage()


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def checkpoint_url(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """A fresh checkpoint location, once as a file:// directory and once as an s3:// prefix."""
    if request.param == "s3":
        storage: Storage = request.getfixturevalue("s3_storage")
        return storage
    return Storage(tmp_path.as_uri())
