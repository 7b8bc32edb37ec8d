"""The ``statebackend`` command on checkpoints made by the library, on file:// and s3://.

Commands run in-process through ``main(argv)``; their output is compared with a
plain-Python model of the job's operations and with what a restore does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import open_filesystem
from statebackend.checkpoint.layout import join
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.requests import (
    answer_savepoint_request,
    pending_savepoint_requests,
)
from statebackend.checkpoint.restore import restore_keyed_state, restore_operator_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from statebackend.errors import StateBackendError
from statebackend.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import (
    FloatSerializer,
    IntSerializer,
    JsonSerializer,
    StrSerializer,
    TupleSerializer,
)
from statebackend.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)
from statebackend.state.ttl import StateTtlConfig
from tests import sigint
from tests.conftest import Storage

M = 128
P = 2
JOB = "job1"
OFFSETS = TupleSerializer(IntSerializer(), IntSerializer())
TOTAL = ValueStateDescriptor("total", IntSerializer(), default=0)
ITEMS = MapStateDescriptor("items", StrSerializer(), IntSerializer())
EVENTS = ListStateDescriptor("events", JsonSerializer())
LAST_SEEN = ValueStateDescriptor("last-seen", FloatSerializer(), ttl=StateTtlConfig(3600))
EXPIRED_CLOCK = 1000.0  # 1970: values written then have long expired


@dataclass
class Model:
    """What the job's state should be, computed in plain Python."""

    totals: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    items: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    events: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    last_seen: dict[str, float] = field(default_factory=dict)
    offsets: list[int] = field(default_factory=lambda: [0, 0, 0, 0])


@dataclass
class Job:
    """A small job: operator ``source`` (split list state ``offsets`` of 4 partitions over
    2 subtasks) and ``user-totals`` keyed by user, with value, map, list and TTL state."""

    storage: Storage
    checkpoints: CheckpointStorage
    coordinator: CheckpointCoordinator
    keyed: list[KeyedStateBackend]
    sources: list[OperatorStateBackend]
    model: Model
    now: list[float]

    @property
    def job_dir(self) -> str:
        return self.checkpoints.layout.job_dir

    def process(self, count: int, seed: int) -> None:
        """Apply ``count`` events to the backends and to the model."""
        for n in range(count):
            user, item = f"user-{(n * 7 + seed) % 40}", f"item-{(n + seed) % 5}"
            amount = (n * 13 + seed) % 17 + 1
            partition = n % 4
            self.model.offsets[partition] += 1
            key_group = assign_to_key_group(StrSerializer().serialize(user), M)
            backend = self.keyed[compute_operator_index_for_key_group(M, P, key_group)]
            backend.set_current_key(user)
            total = backend.get_state(TOTAL)
            total.update(total.value() + amount)  # type: ignore[attr-defined]
            items = backend.get_state(ITEMS)
            items.put(item, (items.get(item) or 0) + amount)  # type: ignore[attr-defined]
            backend.get_state(EVENTS).add({"item": item, "amount": amount})  # type: ignore[attr-defined]
            self.model.totals[user] += amount
            self.model.items[user][item] = self.model.items[user].get(item, 0) + amount
            self.model.events[user].append({"item": item, "amount": amount})
            expired = user.endswith("0")
            self.now[0] = EXPIRED_CLOCK if expired else time.time()
            backend.get_state(LAST_SEEN).update(self.now[0])  # type: ignore[attr-defined]
            if expired:
                self.model.last_seen.pop(user, None)
            else:
                self.model.last_seen[user] = self.now[0]
        for i, source in enumerate(self.sources):
            partitions = (2 * i, 2 * i + 1)
            source.get_list_state("offsets", OFFSETS).update(
                [(p, self.model.offsets[p]) for p in partitions]
            )

    def snapshot(self, checkpoint_id: int) -> None:
        """Write every subtask's snapshot and acknowledgement of checkpoint N."""
        storage = self.checkpoints
        for i, source in enumerate(self.sources):
            target = storage.snapshot_target(checkpoint_id, "source", i)
            handle = target.write_operator_snapshot(checkpoint_id, source.sync_cut()).result()
            storage.write_ack(
                checkpoint_id, SubtaskAck("source", i, P, None, handle, self.coordinator.run_id)
            )
        for i, backend in enumerate(self.keyed):
            target = storage.snapshot_target(checkpoint_id, "user-totals", i)
            keyed = backend.snapshot(checkpoint_id, target).result()
            storage.write_ack(
                checkpoint_id, SubtaskAck("user-totals", i, P, keyed, None, self.coordinator.run_id)
            )

    def checkpoint(self, savepoint_dir: str | None = None) -> str:
        """Take a checkpoint (or savepoint) and return its directory."""
        checkpoint_id = self.coordinator.trigger(
            {"source": P, "user-totals": P}, savepoint_dir=savepoint_dir
        )
        self.snapshot(checkpoint_id)
        path = self.coordinator.poll(checkpoint_id)
        assert path is not None
        return path


def make_job(storage: Storage, tmp_path: Path, backend: str = "heap") -> Job:
    checkpoints = CheckpointStorage(
        storage.url, JOB, storage_options=storage.storage_options, compression="lz4"
    )
    now = [time.time()]
    keyed: list[KeyedStateBackend] = []
    for i in range(P):
        options: dict[str, Any] = {
            "max_parallelism": M,
            "key_group_range": compute_key_group_range_for_operator_index(M, P, i),
            "clock": lambda: now[0],
        }
        keyed.append(
            RocksDBKeyedStateBackend(tmp_path / f"db-{i}", **options)
            if backend == "rocksdb"
            else HeapKeyedStateBackend(**options)
        )
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=M)
    sources = [OperatorStateBackend() for _ in range(P)]
    return Job(storage, checkpoints, coordinator, keyed, sources, Model(), now)


@pytest.fixture(params=["heap", "rocksdb"])
def job(request: pytest.FixtureRequest, checkpoint_url: Storage, tmp_path: Path) -> Iterator[Job]:
    """A job with two completed checkpoints (the second is the model's state)."""
    made = make_job(checkpoint_url, tmp_path, request.param)
    made.process(300, seed=1)
    made.checkpoint()
    made.process(200, seed=2)
    made.checkpoint()
    yield made
    for backend in made.keyed:
        backend.dispose()
    made.checkpoints.close()


def cli(capsys: pytest.CaptureFixture[str], storage: Storage, *argv: str) -> tuple[int, str, str]:
    """Run the command with the storage's options; (exit status, stdout, stderr)."""
    capsys.readouterr()
    options = [f"--storage-option={k}={v}" for k, v in storage.storage_options.items()]
    status = main([*argv, *options])
    out, err = capsys.readouterr()
    return status, out, err


def read_cmd(checkpoint: str, operator: str, state: str, *more: str) -> tuple[str, ...]:
    """The argv of ``statebackend read``."""
    return ("read", checkpoint, "--operator", operator, "--state", state, *more)


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def latest(job: Job) -> str:
    path = job.checkpoints.latest_completed()
    assert path is not None
    return path


def assert_one_error_line(err: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("statebackend: error: "), err


def assert_copy_onto_itself_refused(
    capsys: pytest.CaptureFixture[str], storage: Storage, savepoint: str
) -> None:
    """``savepoint create`` from ``savepoint`` onto itself fails with one error line."""
    status, _, err = cli(
        capsys, storage, "savepoint", "create", "--from", savepoint, "--to", savepoint
    )
    assert status == 1
    assert_one_error_line(err)


def assert_reads_model(capsys: pytest.CaptureFixture[str], job: Job, checkpoint: str) -> None:
    def read(state: str, *more: str) -> dict[str, Any]:
        status, out, err = cli(
            capsys, job.storage, *read_cmd(checkpoint, "user-totals", state, *more)
        )
        assert status == 0, err
        records = jsonl(out)
        keys = [r["key"] for r in records]
        assert len(keys) == len(set(keys))
        return {r["key"]: r["value"] for r in records}

    model = job.model
    assert read("total") == model.totals
    assert read("items") == model.items
    assert read("events") == model.events
    assert read("last-seen") == model.last_seen  # expired TTL values are skipped
    status, out, _ = cli(capsys, job.storage, *read_cmd(checkpoint, "source", "offsets"))
    assert status == 0
    assert [r["value"] for r in jsonl(out)] == [[p, o] for p, o in enumerate(model.offsets)]


def test_read_matches_the_model(capsys: pytest.CaptureFixture[str], job: Job) -> None:
    checkpoint = latest(job)
    assert_reads_model(capsys, job, checkpoint)
    user = "user-3"
    status, out, _ = cli(
        capsys, job.storage, *read_cmd(checkpoint, "user-totals", "items", "--key", user)
    )
    assert status == 0
    assert jsonl(out) == [{"key": user, "value": job.model.items[user]}]
    metadata_file = checkpoint + "/_metadata"
    status, out, err = cli(
        capsys, job.storage, *read_cmd(metadata_file, "user-totals", "total", "--key", "nobody")
    )
    assert (status, out) == (0, "")
    assert "key 'nobody' has no state 'total' in operator 'user-totals'" in err
    status, out, _ = cli(
        capsys, job.storage, *read_cmd(checkpoint, "user-totals", "total", "--format", "csv")
    )
    rows = out.splitlines()
    assert rows[0] == "key,value"
    assert {tuple(r.split(",")) for r in rows[1:]} == {
        (k, str(v)) for k, v in job.model.totals.items()
    }
    status, out, _ = cli(
        capsys, job.storage, *read_cmd(checkpoint, "source", "offsets", "--format", "table")
    )
    assert status == 0 and out.splitlines()[0].split() == ["VALUE"]
    assert len(out.splitlines()) == 5


def test_verify_catches_missing_truncated_and_corrupted_files(
    capsys: pytest.CaptureFixture[str], job: Job
) -> None:
    checkpoint = latest(job)
    status, out, err = cli(capsys, job.storage, "verify", checkpoint)
    assert status == 0 and out.startswith("OK "), err
    metadata = job.checkpoints.load(checkpoint)
    handle = metadata.operators["user-totals"].subtasks[1].keyed
    assert handle is not None
    fs, path = job.checkpoints.fs, join(checkpoint, handle.path)
    original = fs.read_file(path)
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF
    for damage in ("delete", "truncate", "flip"):
        fs.delete(path)
        if damage != "delete":
            fs.write_file(path, [original[:-7] if damage == "truncate" else bytes(flipped)])
        status, out, err = cli(capsys, job.storage, "verify", checkpoint)
        assert status == 1, damage
        assert_one_error_line(err)
        assert handle.path in err and f"FAILED {path}" in out, damage
        fs.delete(path)
        fs.write_file(path, [original])
    assert cli(capsys, job.storage, "verify", checkpoint)[0] == 0


@pytest.mark.parametrize("parallelism", [1, 2, 4])
def test_plan_matches_restore(
    capsys: pytest.CaptureFixture[str], job: Job, parallelism: int
) -> None:
    checkpoint = latest(job)
    status, out, err = cli(
        capsys, job.storage, "plan", checkpoint, "-p", str(parallelism), "--json"
    )
    assert status == 0, err
    plans = json.loads(out)
    metadata = job.checkpoints.load(checkpoint)
    fs = job.checkpoints.fs
    seen: set[str] = set()
    for i, plan in enumerate(plans["user-totals"]):
        key_groups = compute_key_group_range_for_operator_index(M, parallelism, i)
        assert plan["key_group_range"] == key_groups.to_json()
        backend = HeapKeyedStateBackend(max_parallelism=M, key_group_range=key_groups)
        restore_keyed_state(backend, fs, checkpoint, metadata, "user-totals")
        keys = set(backend.keys("total"))
        expected = {k for k in job.model.totals if assign_to_key_group(k.encode(), M) in key_groups}
        assert keys == expected and not keys & seen
        seen |= keys
        assert (plan["keyed_bytes"] > 0) == bool(keys)
    assert seen == set(job.model.totals)
    partitions: list[list[int]] = []
    for i, plan in enumerate(plans["source"]):
        restored = restore_operator_state(fs, checkpoint, metadata, "source", i, parallelism)
        offsets = restored.get_list_state("offsets", OFFSETS).get()
        share = plan["operator_state"]["offsets"]
        assert [tuple(r["value"]) for r in share["values"]] == offsets
        assert share["elements"] == len(offsets)
        partitions += [r["value"] for r in share["values"]]
    assert sorted(partitions) == [[p, o] for p, o in enumerate(job.model.offsets)]
    status, out, _ = cli(
        capsys, job.storage, "plan", checkpoint, "-p", str(parallelism), "--operator", "source"
    )
    assert status == 0
    assert out.count("offsets:") == parallelism
    assert all(f"({p}, {o})" in out for p, o in enumerate(job.model.offsets))


def test_gc_finds_only_unreferenced_files(
    capsys: pytest.CaptureFixture[str], checkpoint_url: Storage, tmp_path: Path
) -> None:
    job = make_job(checkpoint_url, tmp_path)
    fs = job.checkpoints.fs
    job.process(100, seed=3)
    job.checkpoint()  # chk-1
    aborted = job.coordinator.trigger({"source": P, "user-totals": P})  # chk-2
    job.coordinator.abort(aborted)
    job.process(50, seed=4)
    completed = job.checkpoint()  # chk-3
    job.snapshot(aborted)  # a late upload of the aborted chk-2 lands after its abort
    stray = job.keyed[0].snapshot(3, job.checkpoints.snapshot_target(3, "user-totals", 0))
    stray_path = join(completed, stray.result().path)  # e.g. a retried task's upload
    orphan = join(job.checkpoints.layout.shared_dir, "orphan.sst")
    fs.write_file(orphan, [b"x" * 100])
    pending = job.coordinator.trigger({"source": P, "user-totals": P})  # chk-4
    job.snapshot(pending)

    status, out, err = cli(capsys, job.storage, "gc", job.job_dir, "--grace", "0")
    assert status == 0, err
    listed = {line.split()[1] for line in out.splitlines()[:-1]}
    late = {p for p in listed if "/chk-2/" in p}
    # 2 keyed files; no acks: they are refused once chk-2 is aborted; inline source state
    assert len(late) == 2
    # The orphan is newer than chk-3's trigger: it may be an upload of a pending checkpoint.
    assert listed == late | {stray_path}
    referenced = set()
    for checkpoint_id in job.checkpoints.completed_checkpoint_ids():
        directory = job.checkpoints.resolve(checkpoint_id)
        md = job.checkpoints.load(checkpoint_id)
        referenced |= {join(directory, f) for f, _, _ in md.files()}
    assert referenced and not listed & referenced
    assert not any("/chk-4/" in p for p in listed)

    job.coordinator.abort(pending)
    status, out, _ = cli(
        capsys, job.storage, "gc", job.checkpoints.layout.checkpoint_dir, "--grace", "0"
    )
    assert {line.split()[1] for line in out.splitlines()[:-1]} == listed
    status, out, _ = cli(capsys, job.storage, "gc", job.job_dir, "--apply", "--grace", "0")
    assert status == 0 and out.splitlines()[-1].startswith(f"deleted {len(listed)} files")
    assert not fs.exists(stray_path) and fs.exists(orphan)
    assert fs.exists(join(completed, "_metadata"))
    assert not fs.exists(join(job.job_dir, "chk-2"))
    status, out, _ = cli(capsys, job.storage, "gc", job.job_dir, "--grace", "0")
    assert out.strip() == f"0 unreferenced files, 0 B, in {job.job_dir}"
    assert cli(capsys, job.storage, "verify", completed)[0] == 0
    assert_reads_model(capsys, job, completed)
    job.checkpoints.close()


def test_savepoint_create_restores_without_the_checkpoint(
    capsys: pytest.CaptureFixture[str], job: Job, tmp_path: Path
) -> None:
    target = (tmp_path / "savepoints" / "sp-1").as_uri()  # s3 -> file for the s3 run
    status, out, err = cli(
        capsys, job.storage, "savepoint", "create", "--from", latest(job), "--to", target
    )
    assert status == 0, err
    assert out.strip() == target
    job.checkpoints.fs.delete(job.job_dir, recursive=True)
    assert cli(capsys, job.storage, "verify", target)[0] == 0
    status, out, _ = cli(capsys, job.storage, "inspect", target, "--json")
    assert json.loads(out)["kind"] == "savepoint"
    assert_reads_model(capsys, job, target)
    savepoint = CheckpointStorage(target, JOB)
    backend = HeapKeyedStateBackend(max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1))
    restore_keyed_state(backend, savepoint.fs, target, savepoint.load(target), "user-totals")
    backend.set_current_key("user-3")
    assert backend.get_state(TOTAL).value() == job.model.totals["user-3"]  # type: ignore[attr-defined]
    assert_copy_onto_itself_refused(capsys, job.storage, target)


def test_savepoint_trigger_round_trip(
    capsys: pytest.CaptureFixture[str], checkpoint_url: Storage, tmp_path: Path
) -> None:
    job = make_job(checkpoint_url, tmp_path)
    job.process(100, seed=5)
    job.checkpoint()
    fs, job_dir = job.checkpoints.fs, job.job_dir
    stop = threading.Event()

    def driver() -> None:  # the job's driver: serves requests between micro-batches
        while not stop.is_set():
            for request in pending_savepoint_requests(fs, job_dir):
                try:
                    path = job.checkpoint(savepoint_dir=request.savepoint_dir(job_dir))
                except StateBackendError as exc:
                    job.coordinator.abort_all()
                    answer_savepoint_request(fs, job_dir, request, error=str(exc))
                else:
                    answer_savepoint_request(fs, job_dir, request, savepoint_path=path)
            stop.wait(0.05)

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    try:
        status, out, err = cli(capsys, job.storage, "savepoint", "trigger", job_dir, "--wait", "30")
        assert status == 0, err
        savepoint = out.strip()
        assert savepoint.startswith(join(job_dir, "savepoints") + "/")
        assert job.checkpoints.load(savepoint).is_savepoint
        status, out, _ = cli(capsys, job.storage, "list", job_dir, "--json")
        [listed] = json.loads(out)
        assert [s["path"] for s in listed["savepoints"]] == [savepoint]
        assert listed["savepoints"][0]["kind"] == "savepoint"
        # a target that already holds a savepoint: the job answers with an error
        status, _, err = cli(
            capsys,
            job.storage,
            "savepoint",
            "trigger",
            job_dir,
            "--to",
            savepoint,
            "--wait",
            "30",
        )
        assert status == 1 and "already holds" in err
        assert_one_error_line(err)
    finally:
        stop.set()
        thread.join()
    status, out, err = cli(capsys, job.storage, "savepoint", "trigger", job_dir, "--wait", "0.3")
    assert status == 1 and "no answer" in err
    status, out, _ = cli(capsys, job.storage, "savepoint", "trigger", job_dir)
    assert status == 0 and out.startswith("requested savepoint ")
    assert len(pending_savepoint_requests(fs, job_dir)) == 2
    job.checkpoints.close()


def test_savepoint_trigger_to_a_relative_path_asks_for_it_where_the_command_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's driver, another process in another working directory, took the request's
    relative --to from its own: the savepoint was not where the user looked for it."""
    storage = Storage(tmp_path.as_uri())
    job = make_job(storage, tmp_path)
    job.process(10, seed=5)
    job.checkpoint()
    shell = tmp_path / "shell"
    shell.mkdir()
    monkeypatch.chdir(shell)
    status, _, err = cli(capsys, storage, "savepoint", "trigger", job.job_dir, "--to", "sp/v2")
    assert status == 0, err
    monkeypatch.chdir(tmp_path)  # the driver's working directory
    [request] = pending_savepoint_requests(job.checkpoints.fs, job.job_dir)
    assert request.savepoint_dir(job.job_dir) == str(shell / "sp" / "v2")
    job.checkpoints.close()


COMMAND_SCRIPT = "import sys; from statebackend.cli import main; sys.exit(main())"
"""What the installed ``statebackend`` script runs."""


def _list_with_sigint(
    tmp_path: Path, how: str, **moment: str
) -> tuple[Storage, Any, subprocess.CompletedProcess[str]]:
    """A job with one checkpoint, and ``statebackend list`` of it run as ``how`` (``-m``
    or a script) in a process that gets SIGINT at ``moment`` (``tests.sigint.env``)."""
    storage = Storage(tmp_path.as_uri())
    job = make_job(storage, tmp_path)
    job.process(10, seed=5)
    job.checkpoint()
    start = ["-m", "statebackend"] if how == "-m" else ["-c", COMMAND_SCRIPT]
    result = subprocess.run(
        [sys.executable, *start, "list", job.job_dir],
        capture_output=True,
        text=True,
        timeout=120,
        env=sigint.env(**moment),
    )
    return storage, job, result


@pytest.mark.parametrize("how", ["-m", "script"])
@pytest.mark.parametrize("module", ["rocksdict", "fsspec", "statebackend.cli.commands"])
def test_ctrl_c_while_the_command_imports_is_one_line_and_status_130(
    tmp_path: Path, how: str, module: str
) -> None:
    """Ctrl-C while the command was still importing (``from statebackend.cli import main``
    loaded the whole package before ``main`` caught anything) printed a traceback and
    ended the process by SIGINT. The process gets SIGINT as ``module`` starts to be
    imported (``tests.sigint``)."""
    _, job, result = _list_with_sigint(tmp_path, how, at_import=module)
    assert (result.returncode, result.stdout) == (130, ""), result.stderr
    assert result.stderr.splitlines() == ["statebackend: interrupted"]
    job.checkpoints.close()


@pytest.mark.parametrize("moment", [{"after": "statebackend.cli:main"}, {"at_exit": "1"}])
@pytest.mark.parametrize("how", ["-m", "script"])
def test_ctrl_c_after_the_command_did_its_work_keeps_its_status(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, how: str, moment: dict[str, str]
) -> None:
    """Ctrl-C after the command had done its work and printed its result, as ``main``
    returned, turned a success into a traceback and an end by SIGINT (status 130 in a
    shell); while the process exited, into a traceback. The process gets SIGINT at those
    moments (``tests.sigint``)."""
    storage, job, result = _list_with_sigint(tmp_path, how, **moment)
    assert cli(capsys, storage, "list", job.job_dir) == (0, result.stdout, "")
    assert (result.returncode, result.stderr) == (0, "")
    job.checkpoints.close()


def test_savepoint_trigger_to_a_home_relative_path_asks_for_it_in_the_home_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--to '~/sp'`` (quoted, or ``--to=~/sp``: the shell leaves it) was made absolute as a
    relative path, ``<working dir>/~/sp``, where ``savepoint create --to '~/sp'`` writes
    into the home directory (fsspec expands it)."""
    storage = Storage(tmp_path.as_uri())
    job = make_job(storage, tmp_path)
    job.process(10, seed=5)
    job.checkpoint()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    status, _, err = cli(capsys, storage, "savepoint", "trigger", job.job_dir, "--to=~/sp/v2/")
    assert status == 0, err
    [request] = pending_savepoint_requests(job.checkpoints.fs, job.job_dir)
    assert request.savepoint_dir(job.job_dir) == str(tmp_path / "home" / "sp" / "v2")
    job.checkpoints.close()


@pytest.mark.parametrize(
    "target",
    [
        "{job_dir}",
        "{job_dir}/",
        "{job_dir}/chk-9",
        "{job_dir}/shared/sp",
        "{job_dir}/savepoints",
        "{checkpoint_dir}",
        "{other_storage}/sp",
        "{job_dir}/savepoints/full",
        "{job_dir}/savepoints/taken",
    ],
)
def test_savepoint_trigger_refuses_a_target_the_job_cannot_write_a_savepoint_into(
    capsys: pytest.CaptureFixture[str], checkpoint_url: Storage, tmp_path: Path, target: str
) -> None:
    """A request was written whatever its target, and the running job used it as given: a
    directory of the job's own (its checkpoints' ``_metadata``, ``chk-<N>`` it writes
    later, ``shared/`` that gc cleans) or holding it, on another storage than the job's
    (a local job wrote ``s3://b/sp`` below its working directory, an s3 job a bucket
    named ``file:``), or a directory already holding files (mixed with the savepoint's) or
    a savepoint (refused by the job after a checkpoint). Each is now refused at once, with
    one line naming the directory, and no request is left for the job."""
    job = make_job(checkpoint_url, tmp_path)
    job.process(10, seed=5)
    job.checkpoint()
    fs, job_dir = job.checkpoints.fs, job.job_dir
    fs.write_atomic(join(job_dir, "savepoints", "full", "notes.txt"), b"the user's")
    taken = join(job_dir, "savepoints", "taken")
    assert (
        cli(capsys, job.storage, "savepoint", "create", "--from", latest(job), "--to", taken)[0]
        == 0
    )
    other = "s3://elsewhere" if checkpoint_url.url.startswith("file:") else tmp_path.as_uri()
    given = target.format(
        job_dir=job_dir, checkpoint_dir=job.checkpoints.layout.checkpoint_dir, other_storage=other
    )
    status, out, err = cli(capsys, job.storage, "savepoint", "trigger", job_dir, "--to", given)
    assert (status, out) == (1, ""), err
    assert_one_error_line(err)
    assert given.rstrip("/") in err, err
    assert pending_savepoint_requests(fs, job_dir) == []
    assert fs.read_file(join(job_dir, "savepoints", "full", "notes.txt")) == b"the user's"
    job.checkpoints.close()


@pytest.mark.timeout(60)  # --wait nan waited forever
@pytest.mark.parametrize("wait", ["-1", "nan", "soon"])
def test_savepoint_trigger_refuses_a_bad_wait_before_requesting(
    capsys: pytest.CaptureFixture[str], checkpoint_url: Storage, tmp_path: Path, wait: str
) -> None:
    job = make_job(checkpoint_url, tmp_path)
    job.process(10, seed=5)
    job.checkpoint()
    fs, job_dir = job.checkpoints.fs, job.job_dir
    with pytest.raises(SystemExit) as exit:
        cli(capsys, job.storage, "savepoint", "trigger", job_dir, "--wait", wait)
    assert exit.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("statebackend savepoint trigger: error: argument --wait:")
    assert repr(wait) in error
    # no request the job would serve after the command failed
    assert pending_savepoint_requests(fs, job_dir) == []
    job.checkpoints.close()


def test_a_file_where_a_directory_is_expected_is_named_as_a_file(
    capsys: pytest.CaptureFixture[str], checkpoint_url: Storage, tmp_path: Path
) -> None:
    """``list FILE`` said "could not list FILE/FILE: Not a directory" and ``savepoint
    transform --to FILE`` "FILE is not empty (it holds FILE)": fsspec lists a file as an
    entry of itself."""
    fs = open_filesystem(checkpoint_url.url, checkpoint_url.storage_options)
    path = f"{checkpoint_url.url}/notes.txt"
    fs.write_atomic(path, b"not a directory")
    rows = tmp_path / "input" / "rows.jsonl"
    rows.parent.mkdir()
    rows.write_text('{"key": "a", "value": 1}\n')
    for argv in (
        ["list", path],
        ["gc", path, "--apply"],
        ["savepoint", "trigger", path],
        ["savepoint", "bootstrap", "--to", path, "--operator", "op", "--state",
         f"count:value={rows}", "-p", "1"],
    ):  # fmt: skip
        status, out, err = cli(capsys, checkpoint_url, *argv)
        assert (status, out) == (1, ""), argv
        assert_one_error_line(err)
        assert f"error: {path} is a file" in err, err
    assert fs.read_file(path) == b"not a directory"
    assert set(fs.list_dir(checkpoint_url.url)) - {"input"} == {"notes.txt"}


def test_list_and_inspect_show_the_metadata(capsys: pytest.CaptureFixture[str], job: Job) -> None:
    pending = job.coordinator.trigger({"source": P, "user-totals": P})
    job.snapshot(pending)  # acknowledged, not yet completed by the coordinator
    root = job.checkpoints.layout.checkpoint_dir
    status, out, err = cli(capsys, job.storage, "list", root, "--json")
    assert status == 0, err
    [listed] = json.loads(out)
    assert listed["job_dir"] == job.job_dir
    statuses = {c["checkpoint_id"]: c["status"] for c in listed["checkpoints"]}
    assert statuses == {1: "completed", 2: "completed", pending: "pending or aborted"}
    for entry in listed["checkpoints"][:2]:
        md = job.checkpoints.load(entry["checkpoint_id"])
        assert entry["state_bytes"] == md.state_bytes()
        assert entry["completed_at"] == md.completed_at
        assert entry["max_parallelism"] == M
        assert entry["operators"] == {"source": P, "user-totals": P}
    status, out, _ = cli(capsys, job.storage, "list", root)
    assert status == 0 and "pending or aborted" in out and "user-totals (P=2)" in out

    checkpoint = latest(job)
    md = job.checkpoints.load(checkpoint)
    status, out, _ = cli(capsys, job.storage, "inspect", checkpoint, "--json")
    info = json.loads(out)
    assert (info["checkpoint_id"], info["max_parallelism"], info["kind"]) == (2, M, "checkpoint")
    assert info["state_bytes"] == md.state_bytes()
    keyed = info["operators"]["user-totals"]
    assert {n: s["kind"] for n, s in keyed["keyed_states"].items()} == {
        "events": "list",
        "items": "map",
        "last-seen": "value",
        "total": "value",
    }
    assert keyed["keyed_states"]["last-seen"]["serializer"] == "value: ttl(float)"
    assert keyed["keyed_states"]["items"]["serializers"] == {
        "user_key": StrSerializer().config(),
        "value": IntSerializer().config(),
    }
    for sub, ack in zip(keyed["subtasks"], md.operators["user-totals"].subtasks, strict=True):
        assert ack.keyed is not None
        assert sub["key_group_range"] == ack.keyed.key_group_range.to_json()
        assert sub["keyed_bytes"] == ack.keyed.size
    source = info["operators"]["source"]
    assert source["operator_states"]["offsets"]["mode"] == "split"
    assert source["operator_states"]["offsets"]["elements"] == 4
    assert source["operator_states"]["offsets"]["serializer"] == "value: tuple(int, int)"
    assert [s["operator_state_elements"] for s in source["subtasks"]] == [{"offsets": 2}] * 2
    status, out, _ = cli(capsys, job.storage, "inspect", checkpoint)
    assert status == 0 and "ttl(float)" in out and "split" in out


def test_bad_input_is_one_error_line(
    capsys: pytest.CaptureFixture[str], job: Job, tmp_path: Path
) -> None:
    checkpoint = latest(job)
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (
        ("inspect", str(empty)),
        ("verify", job.job_dir),
        ("list", str(empty)),
        ("gc", str(empty)),
        ("savepoint", "trigger", job.checkpoints.layout.checkpoint_dir),
        read_cmd(checkpoint, "nope", "total"),
        read_cmd(checkpoint, "user-totals", "nope"),
        read_cmd(checkpoint, "source", "offsets", "--key", "1"),
        ("plan", checkpoint, "-p", str(M + 1)),
        ("plan", checkpoint, "-p", "2", "--operator", "nope"),
        ("inspect", "nosuchprotocol://x/y"),
    ):
        status, out, err = cli(capsys, job.storage, *argv)
        assert status == 1, argv
        assert_one_error_line(err)


def test_help_has_examples_for_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    commands = ["list", "inspect", "verify", "plan", "read", "savepoint", "gc"]
    for argv in [[], *([c] for c in commands), ["savepoint", "create"], ["savepoint", "trigger"]]:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--help"])
        assert exit_info.value.code == 0
        assert "examples:" in capsys.readouterr().out, argv


def test_a_mistyped_option_shows_the_usage_of_its_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, usage in (
        (["read", "/x/chk-1", "--operator", "op", "--state", "s", "--kye", "k"], "read"),
        (["savepoint", "create", "--from", "a", "--to", "b", "--paralelism", "3"], "create"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"usage: statebackend {' '.join(argv[: argv.index(usage) + 1])}" in err
        assert f"unrecognized arguments: {argv[-2]} {argv[-1]}" in err


def test_python_dash_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "statebackend", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "examples:" in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "statebackend", "inspect", "/nonexistent/chk-1"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert_one_error_line(result.stderr)


@pytest.mark.s3
def test_a_misspelt_storage_option_is_one_error_naming_it(
    capsys: pytest.CaptureFixture[str], s3_storage: Storage
) -> None:
    """fsspec hands storage options to the client it creates: a typo used to end in the
    client's own TypeError text. Now one line says it is a storage option."""
    options = {**s3_storage.storage_options}
    options["endpoint_ur"] = options.pop("endpoint_url")
    status, out, err = cli(capsys, Storage(s3_storage.url, options), "list", s3_storage.url)
    assert (status, out) == (1, "")
    assert_one_error_line(err)
    assert "a storage option is not one the file system" in err and "endpoint_ur" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "", "--apply", "--grace", "0"],
        ["list", ""],
        ["inspect", ""],
        ["verify", ""],
        ["savepoint", "create", "--from", "", "--to", "sp"],
        ["savepoint", "create", "--from", "chk-1", "--to", ""],
        ["savepoint", "trigger", "", "--to", "sp"],
        ["report", ""],
    ],
)
def test_an_empty_path_is_refused_not_taken_as_the_working_directory(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
) -> None:
    """An empty path (an unset shell variable) was the working directory: ``gc "" --apply``
    looked for garbage there, ``savepoint create --to ""`` wrote into it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stray").write_bytes(b"not the command's")
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert "an empty path" in capsys.readouterr().err.splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stray"]
