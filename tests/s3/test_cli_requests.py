"""The requests the ``statebackend`` commands send to S3 (moto's server) for a job with
many checkpoints, batch manifests and changelog records: each command asks for what it
needs, not once per checkpoint or file more than that. Requests are counted by S3
operation and key around s3fs's calls to the real server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import s3fs.core
from fsspec.asyn import sync_wrapper

from statebackend.checkpoint.layout import METADATA_FILE, METRICS_DIR
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from tests.conftest import S3Endpoint, Storage
from tests.scripts import load_script

pytestmark = pytest.mark.s3

OPERATOR = "counts"
M = 32
P = 2
BATCHES = 24
EVERY = 2
"""A checkpoint (and materialization) after every second batch."""
CLI_JOB = load_script("scripts/bench/cli_job.py", "cli_job")


@dataclass
class Job:
    storage: Storage
    job_dir: str
    checkpoints: list[str]
    """The completed checkpoints' directories, oldest first."""
    totals: dict[str, int]
    """The model: each key's total."""


@pytest.fixture(scope="module")
def job(s3_endpoint: S3Endpoint) -> Iterator[Job]:
    """``BATCHES`` batches of keyed operator ``counts`` (P=2) with operator ``source``'s
    offsets, as the command's benchmark writes them (``cli_job.write_job``): each writes
    its changelog records, commits its manifest (all retained) and its metrics record (a
    history segment each), and every ``EVERY`` batches a checkpoint completes and becomes
    the manifests' base."""
    storage = s3_endpoint.new_storage()
    checkpoints = CheckpointStorage(storage.url, "job", storage_options=storage.storage_options)
    written = CLI_JOB.write_job(
        checkpoints,
        BATCHES,
        EVERY,
        parallelism=P,
        max_parallelism=M,
        keys=17,
        updates_per_batch=5,
        segment_bytes=1,
    )
    yield Job(storage, written.job_dir, written.checkpoints, written.totals)
    checkpoints.close()


class Requests(Counter[tuple[str, str]]):
    """The S3 requests sent: (operation, key) -> how many, and the most requests of each
    operation (and of each operation on the metrics history, ``"get_object metrics"``,
    and on ``_metadata`` files, ``"get_object _metadata"``) that were in flight at once."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: Counter[str] = Counter()
        self.most_in_flight: Counter[str] = Counter()


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> Requests:
    """The S3 requests sent from now on."""
    sent = Requests()
    call = s3fs.core.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        key = str(kwargs.get("Key", kwargs.get("Prefix", "")))
        sent[method, key] += 1
        kinds = [method] + [f"{method} {d}" for d in (METRICS_DIR,) if f"/{d}/" in key]
        kinds += [f"{method} {METADATA_FILE}"] if key.endswith(f"/{METADATA_FILE}") else []
        for kind in kinds:
            sent.in_flight[kind] += 1
            sent.most_in_flight[kind] = max(sent.most_in_flight[kind], sent.in_flight[kind])
        try:
            return await call(self, method, *args, **kwargs)
        finally:
            for kind in kinds:
                sent.in_flight[kind] -= 1

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", counted)
    monkeypatch.setattr(s3fs.core.S3FileSystem, "call_s3", sync_wrapper(counted))
    return sent


def cli(capsys: pytest.CaptureFixture[str], storage: Storage, *argv: str) -> str:
    capsys.readouterr()
    options = [f"--storage-option={k}={v}" for k, v in storage.storage_options.items()]
    status = main([*argv, *options])
    out, err = capsys.readouterr()
    assert status == 0, err
    return out


def of(requests: Requests, operation: str) -> Counter[str]:
    """The keys of ``operation``'s requests, with how many each."""
    return Counter({key: n for (op, key), n in requests.items() if op == operation})


def test_latest_looks_only_at_the_newest_checkpoint(
    capsys: pytest.CaptureFixture[str], job: Job, requests: Requests
) -> None:
    """``<job>/latest`` looked for ``_metadata`` in every one of the job's checkpoints
    (a HEAD each: 200 for 200 checkpoints) to take the newest; it now looks at the
    newest first and stops there. Latest is manifest ``BATCHES - 1``, committed before
    the newest checkpoint became the base: its base is the checkpoint before."""
    out = cli(capsys, job.storage, "inspect", f"{job.job_dir}/latest")
    assert out.startswith(f"manifest of batch {BATCHES - 1} ")
    looked_at = {key.rsplit("/", 2)[-2] for key in of(requests, "head_object") if "/chk-" in key}
    assert looked_at == {path.rsplit("/", 1)[1] for path in job.checkpoints[-2:]}


def test_list_reads_each_file_with_one_get(
    capsys: pytest.CaptureFixture[str], job: Job, requests: Requests
) -> None:
    """A whole-file read on S3 asked the file's size first (s3fs's concurrent download
    of large files): ``list`` sent a HEAD for each ``_metadata`` besides its existence
    check, and one for each manifest unless a listing had cached its size. Each file is
    now read with one GET."""
    out = cli(capsys, job.storage, "list", job.job_dir)
    assert sum(line.startswith("  manifests/") for line in out.splitlines()) == BATCHES
    prefix = job.job_dir.split("://", 1)[1].split("/", 1)[1] + "/manifests/"
    manifests = {f"{prefix}{batch}" for batch in range(BATCHES)}
    assert of(requests, "get_object") & Counter(manifests) == Counter(manifests)
    assert not set(of(requests, "head_object")) & manifests
    heads = of(requests, "head_object")
    metadata = Counter({key: n for key, n in heads.items() if key.endswith("/_metadata")})
    assert set(metadata) <= {
        f"{path.split('://', 1)[1].split('/', 1)[1]}/_metadata" for path in job.checkpoints
    }
    assert all(n == 1 for n in metadata.values())  # at most an existence check, no size


def test_list_reads_manifests_and_metadata_several_at_once(
    capsys: pytest.CaptureFixture[str], job: Job, requests: Requests
) -> None:
    """``list`` (and ``report``, which lists the job) read the job's ``_metadata`` files
    and manifests one after the other: 2,210 GETs in a row, 16 s for 200 checkpoints
    and 2,000 manifests on moto. Several are now in flight at once; the answer is the
    same: every checkpoint completed, every manifest committed."""
    out = cli(capsys, job.storage, "list", "--json", job.job_dir)
    assert requests.most_in_flight["get_object"] > 1
    (listed,) = json.loads(out)
    assert [c["path"] for c in listed["checkpoints"]] == job.checkpoints
    assert {c["status"] for c in listed["checkpoints"]} == {"completed"}
    assert [m["batch_id"] for m in listed["manifests"]] == list(range(BATCHES))
    assert {m["status"] for m in listed["manifests"]} == {"committed"}
    materialized = [c["materializes"] for c in listed["checkpoints"]]
    assert materialized == list(range(EVERY - 1, BATCHES - 1, EVERY)) + [None]


def test_gc_lists_the_job_once_and_sends_no_request_per_candidate(
    capsys: pytest.CaptureFixture[str], job: Job, requests: Requests
) -> None:
    """``gc`` listed every checkpoint directory twice and every changelog batch directory,
    and sent two HEADs (size, time) per candidate file, all again before deleting (5,132
    requests, 57 s for 200 checkpoints and 2,000 manifests). It now lists the job once
    (the listing's pages carry sizes and times), and reads the manifests several at
    once; it finds and deletes the same files."""
    fs = CheckpointStorage(job.storage.url, "job", storage_options=job.storage.storage_options).fs
    garbage = {f"{path}/orphan" for path in job.checkpoints[:3]}
    garbage.add(f"{job.job_dir}/changelog/0/counts-0-speculative")
    for path in garbage:
        fs.write_atomic(path, b"nobody references this")
    requests.clear()
    out = cli(capsys, job.storage, "gc", job.job_dir, "--grace", "0")
    listed = {line.split()[1] for line in out.splitlines()[:-1]}
    assert listed == garbage
    keys = {path.split("://", 1)[1].split("/", 1)[1] for path in garbage}
    assert not {key for (_, key) in requests} & keys  # no HEAD (nor anything) per candidate
    lists = of(requests, "list_objects_v2")
    assert not [prefix for prefix in lists if "/chk-" in prefix or "/changelog/" in prefix]
    assert requests.most_in_flight["get_object"] > 1

    out = cli(capsys, job.storage, "gc", job.job_dir, "--grace", "0", "--apply")
    assert {line.split()[1] for line in out.splitlines()[:-1]} == garbage
    assert not any(fs.exists(path) for path in garbage)


def test_savepoint_create_on_the_same_storage_copies_server_side(
    capsys: pytest.CaptureFixture[str], job: Job, requests: Requests
) -> None:
    """``savepoint create`` of a checkpoint into the same bucket downloaded every file
    and uploaded it again (a GET and a PUT each): it opens the target as a second file
    system, and only the same object copied server-side. Now a COPY each; the savepoint
    holds the checkpoint's state."""
    source = job.checkpoints[-1]
    target = f"{job.storage.url}/savepoint-copy"
    prefix = source.split("://", 1)[1].split("/", 1)[1] + "/"
    assert cli(capsys, job.storage, "savepoint", "create", "--from", source, "--to", target)
    source_files = [key for (op, key) in requests if op == "copy_object"]
    downloaded = [key for key in of(requests, "get_object") if key.startswith(prefix)]
    assert downloaded == [prefix + "_metadata"]
    assert len(source_files) == P  # the keyed files (operator state is inline)
    out = cli(capsys, job.storage, "read", target, "--operator", OPERATOR, "--state", "total")
    rows = [json.loads(line) for line in out.splitlines()]
    assert {row["key"]: row["value"] for row in rows} == job.totals


def test_verify_asks_each_files_size_once(
    capsys: pytest.CaptureFixture[str], job: Job, requests: Requests
) -> None:
    """``verify`` asked each file's size (a HEAD), then opened it, which asks again (a
    HEAD), then read it: now the opened stream's size serves, one HEAD and one GET a
    file."""
    source = job.checkpoints[-1]
    out = cli(capsys, job.storage, "verify", source)
    assert out.startswith(f"OK {source}: {P} files")
    prefix = source.split("://", 1)[1].split("/", 1)[1] + "/"
    heads = {k: n for k, n in of(requests, "head_object").items() if "-keyed-" in k}
    gets = {k: n for k, n in of(requests, "get_object").items() if "-keyed-" in k}
    assert len(gets) == P and all(key.startswith(prefix) for key in gets)
    assert heads == gets == dict.fromkeys(gets, 1)


def test_report_reads_the_history_segments_several_at_once(
    capsys: pytest.CaptureFixture[str], job: Job, requests: Requests
) -> None:
    """``report`` read the metrics history's segments one after the other (64 GETs in a
    row for a full history); several are now in flight at once, and every batch is in
    the report."""
    report = json.loads(cli(capsys, job.storage, "report", job.job_dir, "--json"))
    assert [b["batch_id"] for b in report["batches"]] == list(range(BATCHES))
    segments = [key for key in of(requests, "get_object") if f"/{METRICS_DIR}/" in key]
    assert len(segments) == BATCHES + BATCHES // EVERY  # a record each: batches, checkpoints
    assert requests.most_in_flight[f"get_object {METRICS_DIR}"] > 1


def test_gc_reads_the_metadata_files_several_at_once(
    capsys: pytest.CaptureFixture[str], job: Job, requests: Requests
) -> None:
    """``gc`` checked that each ``_metadata`` exists (a HEAD) and read it, one checkpoint
    after the other (420 requests in a row for 200 checkpoints and 10 savepoints): its
    listing says which exist, and they are now read several at once, each once."""
    out = cli(capsys, job.storage, "gc", job.job_dir, "--grace", "0")
    assert out.startswith("0 unreferenced files")
    metadata = {f"{path.split('://', 1)[1].split('/', 1)[1]}/_metadata" for path in job.checkpoints}
    assert not {key for key in of(requests, "head_object") if key.endswith("/_metadata")}
    reads = of(requests, "get_object")
    assert {key: reads[key] for key in metadata} == dict.fromkeys(metadata, 1)
    assert requests.most_in_flight[f"get_object {METADATA_FILE}"] > 1


def test_a_location_opened_twice_shares_one_client(job: Job) -> None:
    """A command opens its storage more than once (``<job>/latest``: the job's directory,
    then the checkpoint; ``savepoint create``: source and target). In a new process the
    second opening made a new S3 client (~0.2 s here): the first had changed the default
    options it was given (s3fs adds to ``retries``), so fsspec's instance cache missed.
    Both now get the same one."""
    program = (
        "import json, sys\n"
        "from statebackend.tools.location import open_location\n"
        "url, options = sys.argv[1], json.loads(sys.argv[2])\n"
        "first = open_location(url, options)\n"
        "first.list_dir(url)\n"
        "print(open_location(url + '/chk-1', options).fsspec is first.fsspec)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, job.job_dir, json.dumps(job.storage.storage_options)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr
