"""A checkpoint must not be able to run code, on file:// and s3://.

Pickled state is never unpickled by the ``statebackend`` command unless asked: a value
whose ``__reduce__`` would create a marker file is read without creating it. With a
signing key, ``_metadata`` is signed (HMAC-SHA256 over itself and every file's SHA-256)
and a tampered ``_metadata`` or data file, an unsigned checkpoint, or another key's
signature is refused before anything is deserialized, by restore and by the command.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.layout import metadata_path
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state, restore_operator_state
from statebackend.checkpoint.signing import SigningKey, verified_reads
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointCorruptedError, ConfigurationError
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import IntSerializer, PickleSerializer
from statebackend.snapshot.handles import resolve_path
from statebackend.spark.conf import StateBackendConf
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState
from tests.conftest import Storage, raw_fs
from tests.s3.test_cli import cli, read_cmd

M = 128
OPERATOR = "op"
VALUES = ValueStateDescriptor("value", PickleSerializer())
COUNT = ValueStateDescriptor("count", IntSerializer())
KEY = SigningKey(b"0123456789abcdef-test-key")


class Payload:
    """A value whose unpickling runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def job_storage(
    location: Storage, key: SigningKey | None = None, **options: Any
) -> CheckpointStorage:
    """The checkpoint storage of job ``job`` at ``location``, signing with ``key``."""
    return CheckpointStorage(
        location.url, "job", storage_options=location.storage_options, signing_key=key, **options
    )


def take_checkpoint(
    storage: CheckpointStorage,
    backend: KeyedStateBackend,
    operator_state: OperatorStateBackend,
    savepoint_dir: str | None = None,
) -> str:
    """A one-subtask checkpoint of ``backend`` and ``operator_state``; its directory."""
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    checkpoint_id = coordinator.trigger({OPERATOR: 1}, savepoint_dir=savepoint_dir)
    target = storage.snapshot_target(checkpoint_id, OPERATOR, 0)
    keyed = backend.snapshot(checkpoint_id, target).result()
    ops = target.write_operator_snapshot(checkpoint_id, operator_state.sync_cut()).result()
    storage.write_ack(checkpoint_id, SubtaskAck(OPERATOR, 0, 1, keyed, ops, coordinator.run_id))
    directory = coordinator.poll(checkpoint_id)
    assert directory is not None
    return directory


def test_the_cli_never_unpickles_by_default(
    checkpoint_url: Storage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    storage = job_storage(checkpoint_url)
    backend = HeapKeyedStateBackend(max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1))
    values = cast(ValueState, backend.get_state(VALUES))
    for key in ("alice", "bob"):
        backend.set_current_key(key)
        values.update(Payload(marker))
    operator_state = OperatorStateBackend()
    operator_state.get_list_state("evil", PickleSerializer()).add(Payload(marker))
    directory = take_checkpoint(storage, backend, operator_state)
    assert not marker.exists()
    payload = base64.b64encode(pickle.dumps(Payload(marker), protocol=5)).decode()
    opaque = {"serializer": "pickle", "base64": payload}

    status, out, err = cli(capsys, checkpoint_url, *read_cmd(directory, OPERATOR, "value"))
    assert status == 0, err
    assert sorted(map(json.loads, out.splitlines()), key=str) == [
        {"key": "alice", "value": opaque},
        {"key": "bob", "value": opaque},
    ]
    for argv in (
        read_cmd(directory, OPERATOR, "evil"),
        read_cmd(directory, OPERATOR, "value", "--format", "table"),
        read_cmd(directory, OPERATOR, "value", "--key", "alice"),
        ("plan", directory, "-p", "2", "--json"),
        ("inspect", directory),
        ("verify", directory),
    ):
        status, out, err = cli(capsys, checkpoint_url, *argv)
        assert status == 0, (argv, err)
    assert not marker.exists()
    # The payload is real: asking to unpickle it runs it.
    status, _, err = cli(
        capsys, checkpoint_url, *read_cmd(directory, OPERATOR, "evil", "--allow-pickle")
    )
    assert status == 0, err
    assert marker.exists()
    storage.close()


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "signing.key"
    path.write_bytes(KEY.secret + b"\n")
    return str(path)


class SignedJob:
    """A one-subtask job writing signed checkpoints, and its model."""

    def __init__(self, location: Storage, local_dir: Path, incremental: bool) -> None:
        self.location = location
        self.storage = job_storage(location, KEY, incremental=incremental)
        options: dict[str, Any] = {"max_parallelism": M, "key_group_range": KeyGroupRange(0, M - 1)}
        self.backend: KeyedStateBackend = (
            RocksDBKeyedStateBackend(local_dir, **options)
            if incremental
            else HeapKeyedStateBackend(**options)
        )
        self.model: dict[str, int] = {}
        self.operator_state = OperatorStateBackend()
        # Over the inline limit: the operator state is a file, read by ranges.
        self.operator_state.get_list_state("offsets", IntSerializer()).add_all(range(5000))

    def checkpoint(self, records: int, savepoint_dir: str | None = None) -> str:
        count = cast(ValueState, self.backend.get_state(COUNT))
        for n in range(records):
            key = f"key-{n % 97}"
            self.backend.set_current_key(key)
            count.update((count.value() or 0) + n)
            self.model[key] = self.model.get(key, 0) + n
        return take_checkpoint(self.storage, self.backend, self.operator_state, savepoint_dir)

    def restore(self, directory: str, key: SigningKey | None = KEY) -> dict[str, int]:
        """The keyed state of ``directory`` restored with ``key``, and its offsets checked."""
        storage = job_storage(self.location, key)
        metadata = storage.load(directory)
        backend = HeapKeyedStateBackend(max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1))
        with verified_reads(storage.fs, directory, metadata.files(), key) as reads:
            restore_keyed_state(backend, reads, directory, metadata, OPERATOR)
            ops = restore_operator_state(reads, directory, metadata, OPERATOR, 0, 1)
        assert ops.get_list_state("offsets", IntSerializer()).get() == list(range(5000))
        count = cast(ValueState, backend.get_state(COUNT))
        restored = {}
        for k in backend.keys("count"):
            backend.set_current_key(k)
            restored[k] = count.value()
        storage.close()
        return restored

    def close(self) -> None:
        self.backend.dispose()
        self.storage.close()


@pytest.fixture(params=["full", "incremental"])
def signed(
    request: pytest.FixtureRequest, checkpoint_url: Storage, tmp_path: Path
) -> Iterator[SignedJob]:
    job = SignedJob(checkpoint_url, tmp_path / "db", request.param == "incremental")
    yield job
    job.close()


def read_count(
    capsys: pytest.CaptureFixture[str], job: SignedJob, directory: str, *more: str
) -> tuple[int, dict[str, int], str]:
    status, out, err = cli(capsys, job.location, *read_cmd(directory, OPERATOR, "count", *more))
    return status, {r["key"]: r["value"] for r in map(json.loads, out.splitlines())}, err


def test_signed_checkpoints_restore_and_read_with_the_key(
    signed: SignedJob, key_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    signed.checkpoint(500)
    directory = signed.checkpoint(300)
    document = json.loads(raw_fs(signed.location).cat_file(metadata_path(directory)))
    assert document["format_version"] == 2
    assert document["signature"]["algorithm"] == "hmac-sha256"
    files = signed.storage.load(directory).files()
    assert files and all(f.checksum.startswith("sha256:") for f in files)
    assert signed.restore(directory) == signed.model
    status, counts, err = read_count(capsys, signed, directory, "--signing-key-file", key_file)
    assert (status, counts) == (0, signed.model), err
    status, out, err = cli(
        capsys, signed.location, "verify", directory, "--signing-key-file", key_file
    )
    assert status == 0 and out.startswith("OK"), err


def test_a_tampered_metadata_is_refused(
    signed: SignedJob, key_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = signed.checkpoint(300)
    path = metadata_path(directory)
    fs = raw_fs(signed.location)
    document = json.loads(fs.cat_file(path))
    document["max_parallelism"] = document["max_parallelism"]  # unchanged: still valid
    document["properties"] = {"injected": True}
    fs.pipe_file(path, json.dumps(document).encode())
    with pytest.raises(CheckpointCorruptedError, match="signature does not match") as caught:
        signed.restore(directory)
    assert path in str(caught.value)
    for command in ("read", "verify", "inspect"):
        argv = [command, directory, "--signing-key-file", key_file]
        if command == "read":
            argv += ["--operator", OPERATOR, "--state", "count"]
        status, out, err = cli(capsys, signed.location, *argv)
        assert status == 1 and out == "" and path in err and "signature does not match" in err
    # Removing the signature does not help: an unsigned checkpoint is refused too.
    del document["signature"]
    fs.pipe_file(path, json.dumps(document).encode())
    with pytest.raises(CheckpointCorruptedError, match="is not signed"):
        signed.restore(directory)


def test_a_tampered_data_file_is_refused(
    signed: SignedJob, key_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = signed.checkpoint(300)
    metadata = signed.storage.load(directory)
    fs = raw_fs(signed.location)
    files = metadata.files()  # keyed (incremental: shared, then private) and operator state
    for stored in dict.fromkeys([files[0], files[-2], files[-1]]):
        path = resolve_path(directory, stored.path)
        original = fs.cat_file(path)
        fs.pipe_file(path, original[:-1] + bytes([original[-1] ^ 1]) if original else b"x")
        with pytest.raises(CheckpointCorruptedError) as caught:
            signed.restore(directory)
        assert path.split("://")[-1] in str(caught.value)
        status, _, err = read_count(capsys, signed, directory, "--signing-key-file", key_file)
        if status == 0:  # the read did not need this file: verify names it
            status, _, err = cli(
                capsys, signed.location, "verify", directory, "--signing-key-file", key_file
            )
        assert status == 1 and path.split("://")[-1] in err
        fs.pipe_file(path, original)
    assert signed.restore(directory) == signed.model


def test_an_unsigned_or_foreign_checkpoint_is_refused_with_a_key(
    checkpoint_url: Storage, key_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unsigned = job_storage(checkpoint_url)
    backend = HeapKeyedStateBackend(max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1))
    backend.set_current_key("a")
    cast(ValueState, backend.get_state(COUNT)).update(1)
    directory = take_checkpoint(unsigned, backend, OperatorStateBackend())
    status, _, err = cli(
        capsys,
        checkpoint_url,
        *read_cmd(directory, OPERATOR, "count", "--signing-key-file", key_file),
    )
    assert status == 1 and "is not signed" in err and metadata_path(directory) in err
    other = SigningKey(b"another key of 16+ bytes")
    signed = job_storage(checkpoint_url, other)
    with pytest.raises(CheckpointCorruptedError, match="is not signed"):
        signed.load(directory)
    directory = take_checkpoint(signed, backend, OperatorStateBackend())
    checked = job_storage(checkpoint_url, KEY)
    with pytest.raises(CheckpointCorruptedError, match="signature does not match"):
        checked.load(directory)
    assert unsigned.load(directory).checkpoint_id == 2  # readable without a key
    for storage in (unsigned, signed, checked):
        storage.close()
    backend.dispose()


def test_an_empty_signing_key_file_is_refused_not_taken_for_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--signing-key-file "$KEY_FILE"`` with the variable unset: verify said OK for an
    unsigned checkpoint, as if no key had been asked for."""
    location = Storage(tmp_path.as_uri())
    unsigned = job_storage(location)
    backend = HeapKeyedStateBackend(max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1))
    directory = take_checkpoint(unsigned, backend, OperatorStateBackend())
    for command in (["verify", directory], ["inspect", directory]):
        status, out, err = cli(capsys, location, *command, "--signing-key-file", "")
        assert (status, out) == (1, "")
        assert err == (
            "statebackend: error: the checkpoint signing key file is empty: give the key's "
            "file, or leave the option out to read without checking signatures\n"
        )
    unsigned.close()
    backend.dispose()


def test_savepoints_of_signed_checkpoints_are_signed(
    signed: SignedJob, key_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    triggered = signed.checkpoint(300, savepoint_dir=f"{signed.location.url}/sp-triggered")
    assert signed.restore(triggered) == signed.model
    copied = f"{signed.location.url}/sp-copied"
    status, out, err = cli(
        capsys,
        signed.location,
        "savepoint",
        "create",
        "--from",
        triggered,
        "--to",
        copied,
        "--signing-key-file",
        key_file,
    )
    assert status == 0 and "not signed" not in err, err
    assert signed.restore(copied) == signed.model
    unsigned_copy = f"{signed.location.url}/sp-unsigned"
    status, out, err = cli(
        capsys, signed.location, "savepoint", "create", "--from", triggered, "--to", unsigned_copy
    )
    assert status == 0 and "is not signed" in err
    with pytest.raises(CheckpointCorruptedError, match="is not signed"):
        signed.restore(unsigned_copy)


def test_the_signing_key_settings(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(b"k" * 32 + b"\n")
    conf = StateBackendConf.from_pairs(
        [("spark.statebackend.checkpoint.signing-key-file", str(key_file))]
    )
    assert conf.checkpoint_signing_key() == SigningKey(b"k" * 32)
    conf = StateBackendConf.from_pairs([("spark.statebackend.checkpoint.signing-key", "s" * 20)])
    assert conf.checkpoint_signing_key() == SigningKey(b"s" * 20)
    assert "s" * 20 not in repr(conf)
    assert StateBackendConf().checkpoint_signing_key() is None
    with pytest.raises(ConfigurationError, match="at least 16"):
        StateBackendConf.from_pairs(
            [("spark.statebackend.checkpoint.signing-key", "short")]
        ).checkpoint_signing_key()
    with pytest.raises(ConfigurationError, match="give one"):
        both = StateBackendConf(signing_key="s" * 20, signing_key_file=str(key_file))
        both.checkpoint_signing_key()
    with pytest.raises(ConfigurationError, match="cannot read"):
        StateBackendConf(signing_key_file=str(tmp_path / "nope")).checkpoint_signing_key()
