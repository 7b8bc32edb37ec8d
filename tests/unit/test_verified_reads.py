"""``VerifiedReads`` (signed checkpoints' reads) on the local file system: when the
checked copies of files are held and dropped."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from statebackend.checkpoint.filesystem import (
    FAIL_FAST_RETRY,
    CheckpointFileSystem,
    open_filesystem,
)
from statebackend.checkpoint.signing import FILE_CHECKSUM, VerifiedReads
from statebackend.errors import CheckpointCorruptedError, CheckpointError
from statebackend.snapshot.handles import StoredFile, resolve_path


def stored(directory: Path, name: str, data: bytes) -> StoredFile:
    """Write ``data`` to ``directory``/``name``; its entry in a signed file list."""
    (directory / name).write_bytes(data)
    return StoredFile(name, len(data), f"sha256:{hashlib.sha256(data).hexdigest()}")


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


class HeldOpens(LocalFileSystem):
    """The local file system, whose opens for reading wait until ``go`` is set (after
    setting ``opening``)."""

    cachable = False  # its own instance, not fsspec's shared local one

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.opening = threading.Event()
        self.go = threading.Event()

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            self.opening.set()
            assert self.go.wait(10)
        return super()._open(path, mode, **kwargs)


@pytest.mark.parametrize("size", [1000, (4 << 20) + 1], ids=["small", "large"])
def test_a_download_that_ends_after_close_serves_its_read_and_keeps_nothing(
    tmp_path: Path, size: int
) -> None:
    """close() while another thread still downloads a file: that thread's read gets the
    file's bytes, and its copy is dropped, not kept open after the reads were closed."""
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    files = [stored(tmp_path, "file", data)]
    path = resolve_path(str(tmp_path), "file")
    held = HeldOpens()
    reads = VerifiedReads(CheckpointFileSystem(held, FILE_CHECKSUM), str(tmp_path), files)
    before = open_descriptors()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(reads.read_file(path)))
    reader.start()
    assert held.opening.wait(10)
    reads.close()
    held.go.set()
    reader.join(10)
    assert got == [data]
    assert open_descriptors() == before, "a copy of the file is still open after close"


def test_a_large_file_grown_past_its_signed_size_is_refused_without_reading_it_all(
    tmp_path: Path,
) -> None:
    """A file signed at 5 MB and replaced by one of 45 MB is refused after reading at most
    a chunk past its signed size, not downloaded whole to a local temporary file."""
    signed = b"s" * (5 << 20)
    files = [stored(tmp_path, "big", signed)]
    (tmp_path / "big").write_bytes(signed + b"x" * (40 << 20))
    fs = CheckpointFileSystem(LocalFileSystem(), FILE_CHECKSUM)
    reads = VerifiedReads(fs, str(tmp_path), files)
    with pytest.raises(CheckpointCorruptedError, match="does not match the signed") as caught:
        reads.read_range(resolve_path(str(tmp_path), "big"), 0, 10)
    assert str(tmp_path / "big") in str(caught.value)
    assert reads.bytes_read <= len(signed) + (8 << 20), reads.bytes_read
    reads.close()


def test_reads_keep_the_retry_policy_of_their_file_system(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A command's file system gives up at once on a refused connection
    (FAIL_FAST_RETRY); the signed reads on it retried as a job does instead."""
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "testing", "secret": "testing"}
    url = "s3://no-such-bucket/job/chk-1"
    fs = open_filesystem(url, options, checksum_algorithm=FILE_CHECKSUM, retry=FAIL_FAST_RETRY)
    reads = VerifiedReads(fs, url, [StoredFile("f", 10, "sha256:" + "0" * 64)])
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError, match="nothing listens"):
        reads.read_file(f"{url}/f")
    assert [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()] == []
