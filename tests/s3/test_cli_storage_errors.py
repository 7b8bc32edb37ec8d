"""The ``statebackend`` command when its storage is not there: nothing listening at the
endpoint, or a bucket that does not exist. One error line that says which, at once."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from statebackend.checkpoint.filesystem import RetryPolicy, open_filesystem
from statebackend.cli import main
from statebackend.errors import CheckpointError, ConfigurationError
from tests.conftest import S3Endpoint, Storage
from tests.faultproxy import Fault, FaultProxy
from tests.s3.test_cli import assert_one_error_line, cli

pytestmark = pytest.mark.s3


def closed_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_closed_endpoint_is_one_error_line_within_seconds() -> None:
    """Run as a user runs it (a process of its own, so that the retry warnings would reach
    stderr): it used to retry for about 30 s, printing a line per retry."""
    endpoint = f"http://127.0.0.1:{closed_port()}"
    options = [f"endpoint_url={endpoint}", "key=testing", "secret=testing"]
    argv = ["list", "s3://bucket/checkpoints", *(f"--storage-option={o}" for o in options)]
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "statebackend", *argv], capture_output=True, text=True, timeout=60
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1 and result.stdout == ""
    assert_one_error_line(result.stderr)
    assert endpoint in result.stderr and "nothing listens" in result.stderr
    assert elapsed < 5, f"took {elapsed:.1f} s"


def test_savepoint_writes_to_a_closed_endpoint_fail_within_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``savepoint bootstrap`` and ``transform`` write through the savepoint writer, which
    retried a refused connection for about 35 s where the other commands give up at once."""
    rows = tmp_path / "counts.jsonl"
    rows.write_text('{"key": "a", "value": 1}\n')
    bootstrap = ["savepoint", "bootstrap", "--operator", "op", "--state", f"count:value={rows}"]
    bootstrap += ["--value-serializer", "int", "-p", "1"]
    assert main([*bootstrap, "--to", str(tmp_path / "local")]) == 0
    transform = ["savepoint", "transform", "--from", str(tmp_path / "local")]
    transform += ["--rename-state", "op/count=total"]
    endpoint = f"http://127.0.0.1:{closed_port()}"
    options = [f"endpoint_url={endpoint}", "key=testing", "secret=testing"]
    for command in (bootstrap, transform):
        capsys.readouterr()
        started = time.monotonic()
        argv = [*command, "--to", "s3://bucket/sp", *(f"--storage-option={o}" for o in options)]
        status = main(argv)
        elapsed = time.monotonic() - started
        out, err = capsys.readouterr()
        assert (status, out) == (1, ""), command
        assert_one_error_line(err)
        assert endpoint in err and "nothing listens" in err, err
        assert elapsed < 5, f"{command[1]} took {elapsed:.1f} s"


def test_a_jobs_file_system_still_retries_a_refused_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only the command gives up at once: a job's storage may be restarting. (botocore's
    own retries are switched off here to keep the test short.)"""
    url = "s3://bucket/checkpoints"
    options = {
        "endpoint_url": f"http://127.0.0.1:{closed_port()}",
        "key": "testing",
        "secret": "testing",
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }
    fs = open_filesystem(url, options, retry=RetryPolicy(attempts=3, first_delay=0.01))
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError, match="nothing listens"):
        fs.list_dir(url)
    assert [r.getMessage().split(")")[0] for r in caplog.records] == [
        f"could not list {url} (try 1 of 3",
        f"could not list {url} (try 2 of 3",
    ]


def test_a_missing_bucket_is_named_as_missing(
    capsys: pytest.CaptureFixture[str], s3_endpoint: S3Endpoint
) -> None:
    """``list`` used to say there were no job checkpoints under the URL, as if the bucket
    held an empty directory; a missing directory in a bucket that exists still says that."""
    storage = Storage(
        f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ckpt", s3_endpoint.storage_options
    )
    status, out, err = cli(capsys, storage, "list", storage.url)
    assert (status, out) == (1, "")
    assert_one_error_line(err)
    assert f"could not list {storage.url}: its bucket does not exist" in err
    existing = s3_endpoint.new_storage()
    status, out, err = cli(capsys, existing, "list", existing.url)
    assert (status, out) == (1, "")
    assert "no job checkpoints under" in err and "bucket" not in err.replace(existing.url, "")


def test_credentials_of_digits_stay_text(
    capsys: pytest.CaptureFixture[str], s3_endpoint: S3Endpoint
) -> None:
    """Option values that parse as JSON are read as JSON (--storage-option, and the job's
    spark.statebackend.storage.*), except credentials and the endpoint: an access key of
    digits became a number, and the command failed with "sequence item 0: expected str
    instance, int found". Given as a JSON string it is the same key; a number given through
    the Python API is one error."""
    options = {"endpoint_url": s3_endpoint.endpoint_url, "key": "12345678", "secret": "testing"}
    for key in ("12345678", '"12345678"'):
        storage = Storage(f"s3://{s3_endpoint.bucket}/ckpt", {**options, "key": key})
        status, out, err = cli(capsys, storage, "list", storage.url)
        assert (status, out) == (1, "") and "no job checkpoints under" in err, err
    with pytest.raises(ConfigurationError, match="storage option key of .* is the number 12345678"):
        open_filesystem(f"s3://{s3_endpoint.bucket}/ckpt", {**options, "key": 12345678})


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("name", ["chk-1", "latest", "manifests/3"])
def test_a_checkpoint_in_a_missing_bucket_is_named_as_missing(
    capsys: pytest.CaptureFixture[str], s3_endpoint: S3Endpoint, command: str, name: str
) -> None:
    """``inspect`` and ``verify`` of a checkpoint used to say it had no ``_metadata``, as
    if the bucket held an unfinished one."""
    bucket = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}"
    storage = Storage(f"{bucket}/ckpt", s3_endpoint.storage_options)
    status, out, err = cli(capsys, storage, command, f"{storage.url}/job/{name}")
    assert (status, out) == (1, "")
    assert_one_error_line(err)
    assert f"could not list {bucket}/ckpt/job" in err and "its bucket does not exist" in err, err


def test_without_an_endpoint_url_a_failing_connection_says_none_is_set(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, s3_endpoint: S3Endpoint
) -> None:
    """Without endpoint_url the S3 client goes to AWS, which cannot be reached from here;
    the command retried and gave the client's error alone. A proxy on 127.0.0.1 that
    resets every connection stands in for the way to AWS, so no request leaves the
    machine (its count of resets shows the requests went there)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    # A key no other test gives: a file system fsspec cached with AWS_ENDPOINT_URL set
    # is not reused.
    storage = Storage("s3://bucket/ckpt", {"key": f"k-{uuid.uuid4().hex}", "secret": "s"})
    with FaultProxy(s3_endpoint.endpoint_url) as proxy:
        proxy.inject(Fault.RESET)
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        status, out, err = cli(capsys, storage, "list", storage.url)
    assert proxy.injected[Fault.RESET] > 0, err
    assert (status, out) == (1, "")
    assert_one_error_line(err)
    assert f"could not list {storage.url}: " in err, err
    assert ": no endpoint_url is set, so the S3 client went to AWS" in err, err
    assert "--storage-option endpoint_url=URL" in err, err
