"""Signed checkpoints' small files (``signing.SMALL_FILE_BYTES``) are read into memory
with one request, on file:// and on moto's S3: only checked bytes are served, and the
copies in memory stay within their budget."""

from __future__ import annotations

import gc
import hashlib
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import s3fs.core

from statebackend.checkpoint.filesystem import CheckpointFileSystem, open_filesystem
from statebackend.checkpoint.signing import (
    FILE_CHECKSUM,
    IN_MEMORY,
    SMALL_FILE_BYTES,
    MemoryBudget,
    VerifiedReads,
)
from statebackend.errors import CheckpointCorruptedError
from statebackend.snapshot.handles import StoredFile, resolve_path
from tests.conftest import Storage, raw_fs


class PeakBudget(MemoryBudget):
    """A memory budget that remembers the most bytes it ever had taken."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.peak = 0

    def take(self, n: int) -> bool:
        taken = super().take(n)
        self.peak = max(self.peak, self.in_use)
        return taken


@pytest.fixture
def fs(checkpoint_url: Storage) -> Iterator[CheckpointFileSystem]:
    yield open_filesystem(
        checkpoint_url.url, checkpoint_url.storage_options, checksum_algorithm=FILE_CHECKSUM
    )


def signed_entry(name: str, data: bytes) -> StoredFile:
    return StoredFile(name, len(data), f"sha256:{hashlib.sha256(data).hexdigest()}")


def test_a_small_files_tampered_byte_is_refused(
    checkpoint_url: Storage, fs: CheckpointFileSystem
) -> None:
    data = bytes(n * 7 % 251 for n in range(3000))
    path = resolve_path(checkpoint_url.url, "small")
    raw = raw_fs(checkpoint_url)
    files = [signed_entry("small", data)]
    flipped = data[:1500] + bytes([data[1500] ^ 1]) + data[1501:]
    for tampered in (flipped, data + b"\0", data[:-1], b""):
        raw.pipe_file(path, tampered)
        budget = MemoryBudget(1 << 20)
        with VerifiedReads(fs, checkpoint_url.url, files, budget) as reads:
            for read in (lambda: reads.read_range(path, 0, 10), lambda: reads.read_file(path)):
                with pytest.raises(CheckpointCorruptedError, match="does not match") as caught:
                    read()
                assert path.split("://")[-1] in str(caught.value)
                assert budget.in_use == 0
    raw.rm_file(path)
    with (
        VerifiedReads(fs, checkpoint_url.url, files) as reads,
        pytest.raises(CheckpointCorruptedError, match="missing"),
    ):
        reads.read_file(path)
    raw.pipe_file(path, data)
    budget = MemoryBudget(1 << 20)
    with VerifiedReads(fs, checkpoint_url.url, files, budget) as reads:
        assert reads.read_range(path, 1499, 3) == data[1499:1502]
        assert budget.in_use == len(data)  # held in memory, not in a temporary file
        assert reads.read_file(path) == data
    assert budget.in_use == 0


def test_many_small_files_stay_within_the_memory_bound(
    checkpoint_url: Storage, fs: CheckpointFileSystem
) -> None:
    """60 files of ~1 kB read by 4 threads with room for 10 kB in memory: every read
    gives its file's bytes, at most 10 kB were ever held, and close gives them back."""
    contents = {f"record-{n:02d}": bytes([n]) * (1000 + n) for n in range(60)}
    raw = raw_fs(checkpoint_url)
    for name, data in contents.items():
        raw.pipe_file(resolve_path(checkpoint_url.url, name), data)
    files = [signed_entry(name, data) for name, data in contents.items()]
    budget = PeakBudget(10_000)
    in_use = IN_MEMORY.in_use
    failures: list[str] = []
    with VerifiedReads(fs, checkpoint_url.url, files, budget) as reads:

        def read_all(offset: int) -> None:
            names = list(contents)
            for name in names[offset:] + names[:offset]:
                path, data = resolve_path(checkpoint_url.url, name), contents[name]
                if reads.read_range(path, 10, 20) != data[10:30]:
                    failures.append(f"range of {name}")
                if reads.read_file(path) != data:
                    failures.append(name)

        threads = [threading.Thread(target=read_all, args=(n * 15,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert failures == []
        assert 9_000 <= budget.peak <= 10_000
        assert budget.in_use <= 10_000
    assert budget.in_use == 0
    assert IN_MEMORY.in_use == in_use  # another budget given: the process's untouched


def test_a_file_over_the_small_size_is_not_held_in_memory(
    checkpoint_url: Storage, fs: CheckpointFileSystem
) -> None:
    data = b"abc" * (SMALL_FILE_BYTES // 3 + 1)
    path = resolve_path(checkpoint_url.url, "large")
    raw_fs(checkpoint_url).pipe_file(path, data)
    budget = MemoryBudget(4 * SMALL_FILE_BYTES)
    with VerifiedReads(fs, checkpoint_url.url, [signed_entry("large", data)], budget) as reads:
        assert reads.read_range(path, len(data) - 5, 5) == data[-5:]
        assert budget.in_use == 0


@pytest.mark.s3
def test_a_small_file_is_read_with_one_get(
    s3_storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No HEAD for its size, one GET: of 5 small files, read by ranges and whole."""
    fs = open_filesystem(
        s3_storage.url, s3_storage.storage_options, checksum_algorithm=FILE_CHECKSUM
    )
    contents = {f"small-{n}": bytes([n]) * 2000 for n in range(5)}
    raw = raw_fs(s3_storage)
    for name, data in contents.items():
        raw.pipe_file(resolve_path(s3_storage.url, name), data)
    sent: Counter[str] = Counter()
    call = s3fs.core.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        sent[method] += 1
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", counted)
    files = [signed_entry(name, data) for name, data in contents.items()]
    with VerifiedReads(fs, s3_storage.url, files, MemoryBudget(1 << 20)) as reads:
        for name, data in contents.items():
            path = resolve_path(s3_storage.url, name)
            assert reads.read_range(path, 100, 50) == data[100:150]
            assert reads.read_file(path) == data
    assert sent == Counter({"get_object": 5})


def test_reads_never_closed_give_their_memory_back_when_collected(
    checkpoint_url: Storage, fs: CheckpointFileSystem
) -> None:
    """The statebackend command's checkpoint reads are never closed: once gone, their
    copies in memory no longer count against the budget of the process."""
    data = b"small" * 100
    raw_fs(checkpoint_url).pipe_file(resolve_path(checkpoint_url.url, "small"), data)
    budget = MemoryBudget(1 << 20)
    reads = VerifiedReads(fs, checkpoint_url.url, [signed_entry("small", data)], budget)
    assert reads.read_file(resolve_path(checkpoint_url.url, "small")) == data
    assert budget.in_use == len(data)
    del reads
    gc.collect()
    assert budget.in_use == 0
