"""``statebackend savepoint transform`` and ``savepoint bootstrap``, run in-process.

A checkpoint of two operators (``enrich``: keyed state of three kinds with a TTL on
one, operator state, raw keyed state; ``source``: operator state only) is transformed
at P -> P' (a state dropped, one renamed, an operator dropped), then restored at P'' and
compared with a plain-Python model of what it must hold. The source never changes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, cast

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.backends.raw_keyed import RawKeyedState
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import (
    restore_keyed_state,
    restore_operator_state,
    restore_raw_keyed_state,
)
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.checksums import DOCUMENT_CHECKSUM
from statebackend.keygroups import assign_to_key_group, compute_key_group_range_for_operator_index
from statebackend.serializers import IntSerializer, PickleSerializer, StrSerializer
from statebackend.snapshot.frames import CODECS, FRAME_HEADER
from statebackend.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateDescriptor,
    ValueStateDescriptor,
)
from statebackend.state.interfaces import ValueState
from statebackend.state.ttl import StateTtlConfig
from statebackend.tools.location import open_checkpoint
from statebackend.tools.transform import plan_transform, transform_savepoint
from tests.conftest import Storage
from tests.s3.test_cli import cli

M = 32
KEYS = [f"k{n}" for n in range(60)]
COUNT = ValueStateDescriptor("count", IntSerializer())
EVENTS = ListStateDescriptor("events", IntSerializer())
ATTRS = MapStateDescriptor("attrs", StrSerializer(), IntSerializer(), ttl=StateTtlConfig(3600))
OFFSETS = "offsets"


def backends(parallelism: int) -> list[HeapKeyedStateBackend]:
    return [
        HeapKeyedStateBackend(
            max_parallelism=M,
            key_group_range=compute_key_group_range_for_operator_index(M, parallelism, i),
        )
        for i in range(parallelism)
    ]


def owner(key: str, states: list[HeapKeyedStateBackend]) -> HeapKeyedStateBackend:
    group = assign_to_key_group(key.encode(), M)
    return next(b for b in states if group in b.key_group_range)


def build(storage: Storage, parallelism: int) -> tuple[str, dict[str, Any]]:
    """A completed checkpoint at ``parallelism`` and the model of what it holds."""
    rng = random.Random(parallelism)
    model: dict[str, Any] = {
        "count": {k: rng.randrange(100) for k in KEYS},
        "events": {k: [rng.randrange(9) for _ in range(rng.randrange(1, 4))] for k in KEYS[::2]},
        "attrs": {k: {"a": rng.randrange(9), "b": 1} for k in KEYS[::3]},
        "offsets": [rng.randrange(1000) for _ in range(7)],
        "raw": {g: rng.randbytes(10) for g in range(0, M, 3)},
    }
    checkpoints = CheckpointStorage(storage.url, "job", storage_options=storage.storage_options)
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=M)
    keyed = backends(parallelism)
    for descriptor in (COUNT, EVENTS, ATTRS):
        for key, value in model[descriptor.name].items():
            backend = owner(key, keyed)
            backend.set_current_key(key)
            state: Any = backend.get_state(descriptor)
            state.put_all(value) if descriptor is ATTRS else state.update(value)
    checkpoint_id = coordinator.trigger({"enrich": parallelism, "source": 1})
    source_state = OperatorStateBackend()
    source_state.get_list_state("positions", IntSerializer()).add_all([1, 2, 3])
    source_target = checkpoints.snapshot_target(checkpoint_id, "source", 0)
    checkpoints.write_ack(
        checkpoint_id,
        SubtaskAck(
            "source",
            0,
            1,
            None,
            source_target.write_operator_snapshot(checkpoint_id, source_state.sync_cut()).result(),
            coordinator.run_id,
        ),
    )
    for i, backend in enumerate(keyed):
        target = checkpoints.snapshot_target(checkpoint_id, "enrich", i)
        operator_state = OperatorStateBackend()
        share = model["offsets"][i::parallelism]
        operator_state.get_list_state(OFFSETS, IntSerializer()).add_all(share)
        raw = RawKeyedState(backend.key_group_range)
        for group, data in model["raw"].items():
            if group in backend.key_group_range:
                raw.write(group, data)
        ack = SubtaskAck(
            "enrich",
            i,
            parallelism,
            backend.snapshot(checkpoint_id, target).result(),
            target.write_operator_snapshot(checkpoint_id, operator_state.sync_cut()).result(),
            coordinator.run_id,
            raw_keyed=target.write_raw_keyed_snapshot(checkpoint_id, raw.sync_cut()).result(),
        )
        checkpoints.write_ack(checkpoint_id, ack)
    completed = coordinator.poll(checkpoint_id)
    assert completed is not None
    checkpoints.close()
    return completed, model


def restore(
    storage: Storage, directory: str, parallelism: int, descriptors: list[StateDescriptor]
) -> dict[str, Any]:
    """Everything ``enrich`` restores at ``parallelism``, shaped like the model."""
    checkpoints = CheckpointStorage(directory, "x", storage_options=storage.storage_options)
    metadata = checkpoints.load(directory)
    found: dict[str, Any] = {d.name: {} for d in descriptors}
    found["offsets"], found["raw"] = [], {}
    for i, backend in enumerate(backends(parallelism)):
        restore_keyed_state(backend, checkpoints.fs, directory, metadata, "enrich")
        for descriptor in descriptors:
            state: Any = backend.get_state(descriptor)
            for key in backend.keys(descriptor.name):
                backend.set_current_key(key)
                kind = descriptor.kind.value
                found[descriptor.name][key] = (
                    state.value()
                    if kind == "value"
                    else dict(state.items())
                    if kind == "map"
                    else state.get()
                )
        offsets = restore_operator_state(
            checkpoints.fs, directory, metadata, "enrich", i, parallelism
        ).get_list_state(OFFSETS, IntSerializer())
        found["offsets"] += offsets.get()
        raw = restore_raw_keyed_state(
            checkpoints.fs, directory, metadata, "enrich", backend.key_group_range
        )
        found["raw"].update({g: raw.read(g) for g in raw.key_groups()})
    return found


def target_of(storage: Storage, name: str) -> str:
    return f"{storage.url}/savepoints/{name}"


def transform(
    storage: Storage,
    capsys: pytest.CaptureFixture[str],
    source: str,
    target: str,
    *options: str,
) -> tuple[int, str, str]:
    """``statebackend savepoint transform --from source --to target *options``."""
    return cli(
        capsys, storage, "savepoint", "transform", "--from", source, "--to", target, *options
    )


@pytest.mark.parametrize(("parallelism", "new_parallelism"), [(2, 2), (3, 1), (1, 4)])
def test_transform_round_trip(
    checkpoint_url: Storage,
    capsys: pytest.CaptureFixture[str],
    parallelism: int,
    new_parallelism: int,
) -> None:
    source, model = build(checkpoint_url, parallelism)
    checkpoints = CheckpointStorage(source, "x", storage_options=checkpoint_url.storage_options)
    before = checkpoints.fs.read_file(f"{source}/_metadata")
    target = target_of(checkpoint_url, "v2")
    status, out, err = transform(
        checkpoint_url,
        capsys,
        source,
        target,
        "--drop-state",
        "enrich/events",
        "--rename-state",
        "enrich/count=n",
        "--drop-operator",
        "source",
        "-p",
        str(new_parallelism),
    )
    assert status == 0, err
    assert out.strip() == target
    assert checkpoints.fs.read_file(f"{source}/_metadata") == before
    assert cli(capsys, checkpoint_url, "verify", source)[0] == 0
    assert cli(capsys, checkpoint_url, "verify", target)[0] == 0

    status, out, _ = cli(capsys, checkpoint_url, "inspect", target, "--json")
    info = json.loads(out)
    assert info["kind"] == "savepoint"
    assert list(info["operators"]) == ["enrich"]
    enrich = info["operators"]["enrich"]
    assert enrich["parallelism"] == new_parallelism
    assert sorted(enrich["keyed_states"]) == ["attrs", "n"]
    assert enrich["keyed_states"]["attrs"]["serializer"] == "user_key: str, value: ttl(int)"

    renamed = ValueStateDescriptor("n", IntSerializer())
    for restore_parallelism in {1, 3, new_parallelism}:
        found = restore(checkpoint_url, target, restore_parallelism, [renamed, ATTRS])
        assert found["n"] == model["count"]
        assert found["attrs"] == model["attrs"]
        assert sorted(found["offsets"]) == sorted(model["offsets"])
        assert found["raw"] == model["raw"]
    # The dropped state is gone; the source still has it.
    assert restore(checkpoint_url, target, 2, [EVENTS])["events"] == {}
    assert restore(checkpoint_url, source, 2, [EVENTS])["events"] == model["events"]


def test_transform_errors(checkpoint_url: Storage, capsys: pytest.CaptureFixture[str]) -> None:
    source, _ = build(checkpoint_url, 2)
    target = target_of(checkpoint_url, "bad")
    cases = [
        (["--drop-state", "enrich/nope"], "operator 'enrich' has no state 'nope'"),
        (["--drop-operator", "nope"], "has no operator 'nope'"),
        (["--rename-state", "enrich/count=events"], "cannot rename 'count' to 'events'"),
        (["--rename-state", "enrich/count"], "is not OPERATOR/STATE=NEW"),
        (["--drop-state", "count"], "is not OPERATOR/STATE"),
        (
            ["--drop-state", "enrich/count", "--rename-state", "enrich/count=c"],
            "state enrich/count is both dropped and renamed to 'c'",
        ),
        (
            ["--drop-operator", "enrich", "--rename-state", "enrich/count=c"],
            "state enrich/count is both dropped and renamed to 'c'",
        ),
        (["-p", str(M + 1)], "parallelism"),
    ]
    for more, message in cases:
        status, _, err = transform(checkpoint_url, capsys, source, target, *more)
        assert status == 1
        assert message in err
    status, _, err = transform(checkpoint_url, capsys, source, source)
    assert status == 1
    assert "already holds a checkpoint or savepoint" in err


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def test_bootstrap_from_files(
    checkpoint_url: Storage, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(7)
    counts = {k: rng.randrange(1000) for k in KEYS}
    attrs = {k: {"x": rng.randrange(9)} for k in KEYS[:20]}
    count_file = write_jsonl(
        tmp_path / "c.jsonl", [{"key": k, "value": v} for k, v in counts.items()]
    )
    attrs_file = write_jsonl(
        tmp_path / "a.jsonl", [{"key": k, "value": v} for k, v in attrs.items()]
    )
    target = target_of(checkpoint_url, "boot")
    status, out, err = cli(
        capsys,
        checkpoint_url,
        "savepoint",
        "bootstrap",
        "--to",
        target,
        "--operator",
        "enrich",
        "--state",
        f"count:value={count_file}",
        "--state",
        f"attrs:map={attrs_file}",
        "--value-serializer",
        "int",
        "--max-parallelism",
        str(M),
        "-p",
        "3",
    )
    assert status == 0, err
    assert out.strip() == target
    assert cli(capsys, checkpoint_url, "verify", target)[0] == 0
    plain_attrs = MapStateDescriptor("attrs", StrSerializer(), IntSerializer())
    for parallelism in (1, 2, 5):
        found = restore(checkpoint_url, target, parallelism, [COUNT, plain_attrs])
        assert found["count"] == counts
        assert found["attrs"] == attrs


@pytest.mark.parametrize(
    ("rows", "key_serializer", "message"),
    [
        ([{"key": "a", "value": 1}, {"key": "a", "value": 2}], "str", "key 'a' is given twice"),
        ([{"key": "a", "value": 1}], "int", "key 'a' does not fit the key serializer int"),
        ([{"key": "a", "value": "x"}], "str", "int serializer cannot encode"),
        (["not an object"], "str", "line 1: not a JSON object"),
    ],
)
def test_bootstrap_rejects_bad_rows(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    rows: list[Any],
    key_serializer: str,
    message: str,
) -> None:
    storage = Storage(tmp_path.as_uri())
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    status, _, err = cli(
        capsys,
        storage,
        "savepoint",
        "bootstrap",
        "--to",
        str(tmp_path / "sp"),
        "--operator",
        "op",
        "--state",
        f"count:value={path}",
        "--key-serializer",
        key_serializer,
        "--value-serializer",
        "int",
        "-p",
        "2",
    )
    assert status == 1
    assert message in err
    assert not (tmp_path / "sp" / "_metadata").exists()


def test_a_parallelism_of_zero_is_refused_not_taken_for_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage = Storage(tmp_path.as_uri())
    source, _ = build(storage, 2)
    target = target_of(storage, "zero")
    status, _, err = transform(storage, capsys, source, target, "-p", "0")
    assert (status, err) == (
        1,
        "statebackend: error: parallelism 0 is invalid: it must be an integer >= 1\n",
    )
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"key": "a", "value": 1}])
    bootstrap = ["savepoint", "bootstrap", "--to", target, "--operator", "op"]
    status, _, err = cli(
        capsys, storage, *bootstrap, "--state", f"count:value={rows}", "-p", "2",
        "--max-parallelism", "0",
    )  # fmt: skip
    assert (status, err) == (
        1,
        "statebackend: error: max parallelism 0 is out of range: it must be an integer "
        "from 1 to 32768\n",
    )
    assert not (tmp_path / "savepoints" / "zero").exists()


@pytest.mark.parametrize("operator", ["../../escaped", "a/b", ""])
def test_bootstrap_refuses_an_operator_id_that_is_no_file_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], operator: str
) -> None:
    """The operator id starts the names of the savepoint's files: one with a '/' or '..'
    would put them outside ``--to`` (or in a subdirectory no restore looks into)."""
    work = tmp_path / "work"
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"key": "a", "value": 1}])
    before = sorted(tmp_path.rglob("*"))
    status, _, err = cli(
        capsys,
        Storage(tmp_path.as_uri()),
        "savepoint",
        "bootstrap",
        "--to",
        str(work / "sp"),
        "--operator",
        operator,
        "--state",
        f"count:value={rows}",
        "-p",
        "2",
    )
    assert status == 1
    assert err.startswith(f"statebackend: error: operator id {operator!r} is invalid")
    assert err.count("\n") == 1
    assert sorted(tmp_path.rglob("*")) == before


def test_transform_operator_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Operator states are dropped and renamed like keyed ones; other operators stay."""
    storage = Storage(tmp_path.as_uri())
    source, model = build(storage, 2)
    target = target_of(storage, "ops")
    status, _, err = transform(
        storage,
        capsys,
        source,
        target,
        "--rename-state",
        f"enrich/{OFFSETS}=positions",
        "--drop-state",
        "source/positions",
        "-p",
        "3",
    )
    assert status == 0, err
    checkpoints = CheckpointStorage(target, "x")
    metadata = checkpoints.load(target)
    assert sorted(metadata.operators) == ["enrich", "source"]
    positions = []
    for i in range(3):
        enrich = restore_operator_state(checkpoints.fs, target, metadata, "enrich", i, 3)
        positions += enrich.get_list_state("positions", IntSerializer()).get()
        assert enrich.get_list_state(OFFSETS, IntSerializer()).get() == []
        restored_source = restore_operator_state(checkpoints.fs, target, metadata, "source", i, 3)
        assert restored_source.get_list_state("positions", IntSerializer()).get() == []
    assert sorted(positions) == sorted(model["offsets"])


def frame_codecs(directory: Path) -> set[str]:
    """The codecs of the frames of every file a savepoint's ``_metadata`` references."""
    metadata = CheckpointStorage(directory.parent.as_uri(), "unused").load(directory.as_uri())
    codecs = set()
    for stored in metadata.files():
        data = (directory / stored.path).read_bytes()
        position = 0
        while position < len(data):
            codec, _, length, _ = FRAME_HEADER.unpack_from(data, position)
            codecs.add(CODECS[codec])
            position += FRAME_HEADER.size + length
    return codecs


def test_savepoints_the_command_writes_are_lz4_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bootstrap and transform compress as a job's checkpoints do (lz4) unless told."""
    rows = [{"key": f"user-{n}", "value": n % 7} for n in range(2000)]
    state = f"count:value={write_jsonl(tmp_path / 'c.jsonl', rows)}"
    storage = Storage(tmp_path.as_uri())
    boot = ("savepoint", "bootstrap", "--operator", "op", "--state", state, "-p", "2")
    assert cli(capsys, storage, *boot, "--to", str(tmp_path / "boot"))[0] == 0
    assert frame_codecs(tmp_path / "boot") == {"lz4"}
    assert transform(storage, capsys, str(tmp_path / "boot"), str(tmp_path / "lz4"))[0] == 0
    assert frame_codecs(tmp_path / "lz4") == {"lz4"}
    plain = (str(tmp_path / "boot"), str(tmp_path / "plain"), "--compression", "none")
    assert transform(storage, capsys, *plain)[0] == 0
    assert frame_codecs(tmp_path / "plain") == {"none"}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, pressed once the first subtask is written."""


def test_an_interrupted_transform_leaves_nothing_and_a_used_target_is_refused(
    checkpoint_url: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C after the first subtask's files are written: the target is removed (it was
    empty), so the same command runs again into it; a target holding any file (what a
    write cut short elsewhere left) is refused, naming it."""
    source, model = build(checkpoint_url, 2)
    target = target_of(checkpoint_url, "interrupted")
    ref = open_checkpoint(source, checkpoint_url.storage_options)
    rewrites = plan_transform(ref, drop_operators=["source"], parallelism=3)
    written: list[int] = []

    def interrupt(operator_id: str, subtask: int) -> None:
        written.append(subtask)
        raise Interrupted

    with pytest.raises(Interrupted):
        transform_savepoint(
            ref, target, rewrites, storage_options=checkpoint_url.storage_options, written=interrupt
        )
    assert written == [0]
    assert not ref.fs.exists(target)
    status, _, err = transform(checkpoint_url, capsys, source, target, "--drop-operator", "source")
    assert status == 0, err
    assert restore(checkpoint_url, target, 2, [COUNT])["count"] == model["count"]

    used = target_of(checkpoint_url, "used")
    ref.fs.write_atomic(f"{used}/enrich-0-leftover", b"cut short")
    status, _, err = transform(checkpoint_url, capsys, source, used)
    assert status == 1
    assert f"{used} is not empty (it holds enrich-0-leftover)" in err


UNPICKLED: list[str] = []
"""Filled by ``_unpickled`` whenever a ``Planted`` value is unpickled."""


def _unpickled(marker: str) -> str:
    UNPICKLED.append(marker)
    return marker


class Planted:
    """A value whose unpickling calls ``_unpickled``: code a checkpoint carries."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickled, ("ran",))


def test_transform_never_unpickles_without_allow_pickle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two subtasks storing a pickled state with different serializer configs (a
    ``version`` edited in ``_metadata``): restoring both into one subtask (``-p 1``)
    migrated one subtask's values, unpickling them, though the command never unpickles
    without ``--allow-pickle``."""
    storage = Storage(tmp_path.as_uri())
    descriptor = ValueStateDescriptor("blob", PickleSerializer())
    checkpoints = CheckpointStorage(storage.url, "job")
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=M)
    keyed = backends(2)
    for key in KEYS:
        backend = owner(key, keyed)
        backend.set_current_key(key)
        cast(ValueState, backend.get_state(descriptor)).update(Planted())
    checkpoint_id = coordinator.trigger({"enrich": 2})
    for i, backend in enumerate(keyed):
        target = checkpoints.snapshot_target(checkpoint_id, "enrich", i)
        handle = backend.snapshot(checkpoint_id, target).result()
        ack = SubtaskAck("enrich", i, 2, handle, None, coordinator.run_id)
        checkpoints.write_ack(checkpoint_id, ack)
    source = coordinator.poll(checkpoint_id)
    assert source is not None
    checkpoints.close()
    path = f"{source}/_metadata"
    document = json.loads(checkpoints.fs.read_file(path))
    del document[DOCUMENT_CHECKSUM]
    (state,) = document["operators"]["enrich"]["subtasks"][1]["keyed"]["states"]
    state["serializers"]["value"]["version"] = 0
    checkpoints.fs.write_atomic(path, json.dumps(document).encode())
    UNPICKLED.clear()

    status, out, err = transform(storage, capsys, source, target_of(storage, "p1"), "-p", "1")
    assert UNPICKLED == []
    assert status == 1 and out == "" and "--allow-pickle" in err, err
    status, out, err = transform(
        storage, capsys, source, target_of(storage, "p1"), "-p", "1", "--allow-pickle"
    )
    assert status == 0, err
    assert UNPICKLED  # asked for: the pickled values were migrated
