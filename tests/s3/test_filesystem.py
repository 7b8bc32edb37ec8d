"""The checkpoint file system on file:// and on s3:// through a real local S3 endpoint."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import pytest

from statebackend.checkpoint.filesystem import (
    CheckpointFileSystem,
    checksum,
    open_filesystem,
    verify_checksum,
)
from statebackend.cli import main
from statebackend.errors import (
    CheckpointCancelledError,
    CheckpointCorruptedError,
    CheckpointError,
    ConfigurationError,
)
from tests.conftest import S3Endpoint, Storage

MIB = 1 << 20


@pytest.fixture
def fs(checkpoint_url: Storage) -> CheckpointFileSystem:
    return open_filesystem(checkpoint_url.url, checkpoint_url.storage_options)


@pytest.fixture
def root(checkpoint_url: Storage) -> str:
    return checkpoint_url.url


def pattern(size: int) -> bytes:
    """Bytes that differ at most offsets, so a misplaced range is noticed."""
    return bytes(i * 7 % 251 for i in range(size))


def chunked(data: bytes, chunk_size: int) -> Iterator[bytes]:
    for start in range(0, len(data), chunk_size):
        yield data[start : start + chunk_size]


def test_chunked_write_round_trip(fs: CheckpointFileSystem, root: str) -> None:
    data = pattern(300_000)
    path = f"{root}/job/chk-1/state.bin"

    written = fs.write_file(path, chunked(data, 64 * 1024))

    assert (written.path, written.size, written.checksum) == (path, len(data), checksum(data))
    assert written.checksum.startswith("crc32:")
    assert fs.bytes_written == len(data)
    assert fs.read_file(path) == data
    assert fs.bytes_read == len(data)
    assert fs.size(path) == len(data)
    fs.verify(path, written.size, written.checksum)


def test_empty_write(fs: CheckpointFileSystem, root: str) -> None:
    written = fs.write_file(f"{root}/empty", [])
    assert (written.size, written.checksum) == (0, checksum(b""))
    assert fs.read_file(f"{root}/empty") == b""


def test_cancel_between_chunks_leaves_no_file(fs: CheckpointFileSystem, root: str) -> None:
    path = f"{root}/job/chk-1/state.bin"
    seen: list[int] = []

    def chunks() -> Iterator[bytes]:
        for i in range(10):
            seen.append(i)
            yield pattern(10_000)

    with pytest.raises(CheckpointCancelledError, match="state.bin"):
        fs.write_file(path, chunks(), should_stop=lambda: len(seen) > 2)

    assert seen == [0, 1, 2]
    assert not fs.exists(path)
    assert "state.bin" not in fs.list_dir(f"{root}/job/chk-1")


def test_cancel_after_the_last_chunk_still_aborts(fs: CheckpointFileSystem, root: str) -> None:
    calls = iter([False, True])
    with pytest.raises(CheckpointCancelledError):
        fs.write_file(f"{root}/f", [b"data"], should_stop=lambda: next(calls))
    assert not fs.exists(f"{root}/f")


def test_a_write_failing_after_it_was_told_to_stop_is_cancelled(
    fs: CheckpointFileSystem, root: str
) -> None:
    """An abort deletes the checkpoint's directory while its uploads may still write into
    it: a write that fails once ``should_stop`` says stop was cancelled, not broken."""
    path = f"{root}/job/chk-2/state.bin"
    aborted: list[bool] = []

    def chunks() -> Iterator[bytes]:
        yield pattern(10_000)
        aborted.append(True)  # the abort lands, and the directory goes with it
        raise OSError("No such file or directory")

    with pytest.raises(CheckpointCancelledError, match="state.bin.*No such file") as info:
        fs.write_file(path, chunks(), should_stop=lambda: bool(aborted))

    assert isinstance(info.value.__cause__, OSError)
    assert not fs.exists(path)


def test_a_write_whose_directory_vanishes_as_it_opens_is_cancelled_once_told_to_stop(
    tmp_path: Path,
) -> None:
    """On a local file system, opening a file whose directory is being deleted by an
    abort fails (its parent is found and gone); the write was cancelled if ``should_stop``
    says stop by then, and is a CheckpointError naming the path otherwise."""
    fs = open_filesystem(tmp_path.as_uri())
    (tmp_path / "chk-2").write_bytes(b"")  # the parent cannot be made: open fails
    path = f"{tmp_path.as_uri()}/chk-2/MANIFEST"

    with pytest.raises(CheckpointCancelledError, match="MANIFEST") as cancelled:
        fs.write_file(path, [b"x"], should_stop=lambda: True)
    assert isinstance(cancelled.value.__cause__, FileExistsError)
    with pytest.raises(CheckpointError, match="could not open for writing .*MANIFEST") as info:
        fs.write_file(path, [b"x"], should_stop=lambda: False)
    assert not isinstance(info.value, CheckpointCancelledError)


def test_an_exception_mid_write_leaves_no_file(fs: CheckpointFileSystem, root: str) -> None:
    path = f"{root}/job/chk-1/state.bin"

    def chunks() -> Iterator[bytes]:
        yield pattern(10_000)
        raise RuntimeError("disk on fire")

    with pytest.raises(CheckpointError, match="state.bin.*disk on fire") as info:
        fs.write_file(path, chunks())

    assert isinstance(info.value.__cause__, RuntimeError)
    assert not fs.exists(path)


def test_checkpoint_errors_from_the_chunks_pass_unwrapped(
    fs: CheckpointFileSystem, root: str
) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"x"
        raise CheckpointCorruptedError("source file is corrupted")

    with pytest.raises(CheckpointCorruptedError, match="source file is corrupted"):
        fs.write_file(f"{root}/f", chunks())
    assert not fs.exists(f"{root}/f")


def test_ranged_reads(fs: CheckpointFileSystem, root: str) -> None:
    data = pattern(2 * MIB)
    path = f"{root}/state.bin"
    fs.write_file(path, chunked(data, MIB))
    before = fs.bytes_read

    assert fs.read_range(path, 0, 10) == data[:10]
    assert fs.read_range(path, 1_000_000, 100) == data[1_000_000:1_000_100]
    assert fs.read_range(path, len(data) - 5, 5) == data[-5:]
    assert fs.read_range(path, 17, 0) == b""

    assert fs.bytes_read - before == 115


def test_range_checksum_is_checked_separately(fs: CheckpointFileSystem, root: str) -> None:
    data = pattern(1000)
    path = f"{root}/state.bin"
    fs.write_file(path, [data])
    range_checksum = checksum(data[100:200])

    verify_checksum(fs.read_range(path, 100, 100), range_checksum, f"{path}[100:200]")
    with pytest.raises(CheckpointCorruptedError, match=r"state.bin\[101:201\]: checksum"):
        verify_checksum(fs.read_range(path, 101, 100), range_checksum, f"{path}[101:201]")


def test_a_range_past_the_end_is_truncation(fs: CheckpointFileSystem, root: str) -> None:
    path = f"{root}/state.bin"
    fs.write_file(path, [pattern(100)])
    with pytest.raises(CheckpointCorruptedError, match="state.bin is truncated: read 10 of 20"):
        fs.read_range(path, 90, 20)


def test_a_huge_range_past_the_end_is_truncation_without_reading(
    fs: CheckpointFileSystem, root: str
) -> None:
    """A range far larger than the file (a corrupted index: 1 PB) is truncation, named
    with the file's size; on a local disk the read allocated the range first and failed
    with an empty MemoryError ("could not read X: ")."""
    path = f"{root}/state.bin"
    fs.write_file(path, [pattern(100)])
    with pytest.raises(CheckpointCorruptedError, match="state.bin is truncated: it has 100 bytes"):
        fs.read_range(path, 0, 10**15)


def test_open_read_streams_and_seeks(fs: CheckpointFileSystem, root: str) -> None:
    data = pattern(100_000)
    path = f"{root}/state.bin"
    fs.write_file(path, [data])
    before = fs.bytes_read

    with fs.open_read(path) as f:
        assert f.read(10) == data[:10]
        f.seek(50_000)
        assert f.tell() == 50_000
        assert f.read(5) == data[50_000:50_005]
        assert f.read() == data[50_005:]

    assert fs.bytes_read - before == 10 + len(data) - 50_000


def test_missing_files_are_reported_with_their_path(fs: CheckpointFileSystem, root: str) -> None:
    path = f"{root}/nope.bin"
    for read in (fs.read_file, fs.size, fs.open_read, lambda p: fs.read_range(p, 0, 1)):
        with pytest.raises(CheckpointCorruptedError, match="nope.bin is missing"):
            read(path)


def test_write_atomic(fs: CheckpointFileSystem, root: str) -> None:
    path = f"{root}/job/chk-3/_metadata"
    fs.write_atomic(path, b'{"v": 1}')
    fs.write_atomic(path, b'{"v": 2}')

    assert fs.read_file(path) == b'{"v": 2}'
    assert fs.list_dir(f"{root}/job/chk-3") == ["_metadata"]
    assert fs.bytes_written == 16


def test_write_atomic_flushes_a_local_file_and_its_rename_to_disk(
    fs: CheckpointFileSystem, root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power loss must not leave an empty ``_metadata``: on a local disk the temp file is
    flushed (fsync) before its rename, its directory after. Power loss cannot be simulated,
    so the fsync calls are recorded. An object store's single PUT has nothing to flush."""
    path = f"{root}/job/chk-3/_metadata"
    local = os.path.realpath(path.removeprefix("file://"))
    synced: list[tuple[str, bool]] = []  # (what was flushed, whether ``path`` existed then)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), os.path.exists(local)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fs.write_atomic(path, b'{"v": 1}')

    assert fs.read_file(path) == b'{"v": 1}'
    if not root.startswith("file://"):
        assert synced == []
        return
    assert len(synced) == 2, synced
    (temp, renamed_before), directory = synced
    assert temp.startswith(f"{local}.") and temp.endswith(".tmp") and not renamed_before
    assert directory == (os.path.dirname(local), True)


def test_verify_catches_missing_truncated_and_flipped_files(
    fs: CheckpointFileSystem, root: str
) -> None:
    data = pattern(5000)
    path = f"{root}/state.bin"
    written = fs.write_file(path, [data])
    fs.verify(path, written.size, written.checksum)

    fs.write_atomic(path, data[:4000])
    with pytest.raises(CheckpointCorruptedError, match="state.bin: size 4000 != expected 5000"):
        fs.verify(path, written.size, written.checksum)

    flipped = bytearray(data)
    flipped[2500] ^= 0x01
    fs.write_atomic(path, bytes(flipped))
    with pytest.raises(CheckpointCorruptedError, match="state.bin: checksum mismatch"):
        fs.verify(path, written.size, written.checksum)

    fs.delete(path)
    with pytest.raises(CheckpointCorruptedError, match="state.bin is missing"):
        fs.verify(path, written.size, written.checksum)


def test_copy(fs: CheckpointFileSystem, root: str) -> None:
    data = pattern(200_000)
    written = fs.write_file(f"{root}/job/chk-1/state.bin", [data])

    fs.copy(written.path, f"{root}/savepoint/state.bin")

    fs.verify(f"{root}/savepoint/state.bin", written.size, written.checksum)
    assert fs.read_file(written.path) == data


def test_copy_of_a_missing_file(fs: CheckpointFileSystem, root: str) -> None:
    with pytest.raises(CheckpointCorruptedError, match="nope is missing"):
        fs.copy(f"{root}/nope", f"{root}/dst")


def test_list_exists_and_delete(fs: CheckpointFileSystem, root: str) -> None:
    job = f"{root}/job"
    for name in ("chk-1/_metadata", "chk-1/a", "chk-2/_metadata", "shared/x.sst"):
        fs.write_atomic(f"{job}/{name}", b"1")

    assert fs.list_dir(job) == ["chk-1", "chk-2", "shared"]
    assert fs.list_dir(f"{job}/chk-1") == ["_metadata", "a"]
    assert fs.list_dir(f"{root}/missing") == []
    assert fs.exists(f"{job}/chk-1") and fs.exists(f"{job}/chk-1/a")

    fs.delete(f"{job}/chk-1/a")
    assert not fs.exists(f"{job}/chk-1/a")
    fs.delete(f"{job}/chk-1", recursive=True)
    assert not fs.exists(f"{job}/chk-1")
    assert fs.list_dir(job) == ["chk-2", "shared"]
    fs.delete(f"{job}/chk-1", recursive=True)
    fs.delete(f"{job}/nothing-here")


def test_a_listing_sees_files_written_by_another_client(
    checkpoint_url: Storage, fs: CheckpointFileSystem, root: str
) -> None:
    chk = f"{root}/job/chk-1"
    fs.write_atomic(f"{chk}/_metadata", b"1")
    assert fs.list_dir(chk) == ["_metadata"]

    other = fsspec.filesystem(
        fsspec.utils.get_protocol(root), skip_instance_cache=True, **checkpoint_url.storage_options
    )
    other.pipe_file(f"{chk}/ack", b"2")

    assert fs.list_dir(chk) == ["_metadata", "ack"]
    assert fs.exists(f"{chk}/ack")
    assert fs.size(f"{chk}/ack") == 1


def test_pickled_filesystem_reaches_the_same_storage(fs: CheckpointFileSystem, root: str) -> None:
    fs.write_atomic(f"{root}/f", b"hello")
    copy = pickle.loads(pickle.dumps(fs))
    assert copy.read_file(f"{root}/f") == b"hello"
    assert copy.bytes_read == 5


def test_memory_filesystem_round_trip() -> None:
    fs = open_filesystem("memory://statebackend-test", None)
    root = "memory://statebackend-test/job"
    written = fs.write_file(f"{root}/state.bin", chunked(pattern(1000), 100))
    fs.verify(written.path, written.size, written.checksum)
    fs.write_atomic(f"{root}/_metadata", b"{}")
    assert fs.list_dir(root) == ["_metadata", "state.bin"]
    fs.delete(root, recursive=True)
    assert not fs.exists(root)


def test_plain_local_paths(tmp_path: Any) -> None:
    fs = open_filesystem(str(tmp_path), None)
    fs.write_atomic(f"{tmp_path}/a/b/_metadata", b"x")
    assert (tmp_path / "a" / "b" / "_metadata").read_bytes() == b"x"


def test_unknown_protocol_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="'nope://bucket/cp'.*unknown protocol"):
        open_filesystem("nope://bucket/cp", None)


def test_s3_without_s3fs_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from statebackend.checkpoint.filesystem import open_filesystem\n"
        "from statebackend.errors import ConfigurationError\n"
        "try:\n"
        "    open_filesystem('s3://bucket/cp', None)\n"
        "except ConfigurationError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "'s3://bucket/cp'" in result.stdout
    assert "pip install statebackend[s3]" in result.stdout


@pytest.mark.s3
def test_s3_ranged_read_is_an_http_range_request(s3_storage: Storage) -> None:
    fs = open_filesystem(s3_storage.url, s3_storage.storage_options)
    path = f"{s3_storage.url}/state.bin"
    fs.write_file(path, [pattern(MIB)])
    ranges: list[bytes | str] = []

    def record(request: Any, **_: Any) -> None:
        ranges.append(request.headers.get("Range"))

    # fsspec caches instances by their options, so this is the client `fs` uses.
    client = fsspec.filesystem("s3", **s3_storage.storage_options).s3
    client.meta.events.register("before-send.s3.GetObject", record)
    try:
        assert fs.read_range(path, 1000, 100) == pattern(MIB)[1000:1100]
    finally:
        client.meta.events.unregister("before-send.s3.GetObject", record)
    assert [r.decode() if isinstance(r, bytes) else r for r in ranges] == ["bytes=1000-1099"]


@pytest.mark.s3
def test_s3_large_write_is_a_multipart_upload(s3_endpoint: S3Endpoint) -> None:
    storage = s3_endpoint.new_storage()
    options = {**storage.storage_options, "default_block_size": 5 * MIB}
    fs = open_filesystem(storage.url, options)
    data = os.urandom(12 * MIB)
    path = f"{storage.url}/big.bin"

    written = fs.write_file(path, chunked(data, MIB))

    fs.verify(path, written.size, written.checksum)
    etag = fsspec.filesystem("s3", **options).info(path)["ETag"]
    assert etag.strip('"').endswith("-3"), etag


@pytest.mark.s3
def test_s3_cancelled_multipart_upload_leaves_nothing(s3_endpoint: S3Endpoint) -> None:
    import boto3

    storage = s3_endpoint.new_storage()
    fs = open_filesystem(storage.url, {**storage.storage_options, "default_block_size": 5 * MIB})
    written: list[int] = []

    def chunks() -> Iterator[bytes]:
        for _ in range(12):
            written.append(MIB)
            yield os.urandom(MIB)

    with pytest.raises(CheckpointCancelledError):
        fs.write_file(f"{storage.url}/big.bin", chunks(), should_stop=lambda: len(written) > 8)

    assert not fs.exists(f"{storage.url}/big.bin")
    client = boto3.client("s3", endpoint_url=s3_endpoint.endpoint_url)
    uploads = client.list_multipart_uploads(Bucket=s3_endpoint.bucket).get("Uploads", [])
    assert [u for u in uploads if u["Key"].startswith(storage.url.split("/", 3)[3])] == []


@pytest.mark.s3
def test_s3_without_credentials_says_how_to_give_them(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No key in the options nor in the environment: one ConfigurationError (the CLI's one
    line) naming the path and where credentials go, not botocore's bare message."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    url = f"s3://{s3_endpoint.bucket}/no-credentials"
    fs = open_filesystem(url, {"endpoint_url": s3_endpoint.endpoint_url})
    with pytest.raises(
        ConfigurationError, match=r"could not list .*no-credentials: .*--storage-option key="
    ):
        fs.list_dir(url)
    status = main(["list", url, "--storage-option", f"endpoint_url={s3_endpoint.endpoint_url}"])
    assert status != 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "AWS_ACCESS_KEY_ID" in line


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("hdfs:/ckpt", "'hdfs:/ckpt' has one '/' after 'hdfs:'"),
        ("s3:/bucket/ckpt", "'s3:/bucket/ckpt' has one '/' after 's3:'"),
        ("file://tmp/ckpt", "'file://tmp/ckpt' names the host 'tmp'"),
    ],
)
def test_a_url_fsspec_would_take_for_a_relative_local_path_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    url: str,
    says: str,
) -> None:
    """fsspec reads these as local paths relative to the working directory (./hdfs:/ckpt,
    ./tmp/ckpt), which differs between a Spark driver and its executors: checkpoints
    landed on local disks instead of HDFS or S3, and a restart found none."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match=f"^checkpoint storage {says}"):
        open_filesystem(url)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"key": "a", "value": 1}\n')
    status = main(
        ["savepoint", "bootstrap", "--to", url, "--operator", "op", "--state",
         f"count:value={rows}", "-p", "1"]
    )  # fmt: skip
    assert status == 1
    assert capsys.readouterr().err.startswith(f"statebackend: error: checkpoint storage {says}")
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]
    assert open_filesystem("file:" + str(tmp_path)).exists(str(rows))  # Hadoop's file:/path


def test_create_exclusive_writes_once_among_racing_writers(
    fs: CheckpointFileSystem, root: str
) -> None:
    """Of eight writers creating one file at once exactly one writes it, whole; the
    others are told it exists; and no temp file is left beside it."""
    path = f"{root}/dir/claim.json"
    barrier = threading.Barrier(8)

    def create(i: int) -> bool:
        barrier.wait()
        return fs.create_exclusive(path, pattern(1000 + i))

    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(create, range(8)))
    assert created.count(True) == 1
    assert fs.read_file(path) == pattern(1000 + created.index(True))
    assert fs.create_exclusive(path, b"later") is False
    assert fs.list_dir(f"{root}/dir") == ["claim.json"]
