"""The ``statebackend`` command on batch manifests (base checkpoint + changelog records),
on file:// and s3://, compared with a plain-Python model of the job's operations.

The job is ``changelog_jobs.changelog_job``: manifest 3 builds on nothing (records of
batches 1-3 at P=2), manifests 4 and 5 on chk-1, the materialization of batch 2 (records
3-4 at P=2, and 5 at P=3).
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.layout import join
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.signing import load_signing_key
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata
from statebackend.keygroups import compute_key_group_range_for_operator_index
from statebackend.serializers import JsonSerializer, PickleSerializer
from statebackend.state.descriptors import ValueStateDescriptor
from tests.conftest import Storage
from tests.s3.changelog_jobs import (
    ChangelogJob,
    changelog_job,
    checkpoint,
    enabled,
    expected_values,
    open_storage,
    rebuild,
)
from tests.s3.test_checkpoint_matrix import (
    MAX_PARALLELISM,
    OPERATOR,
    descriptors,
    make_backend,
    read_keyed,
    subtask_of,
)
from tests.s3.test_cli import (
    assert_copy_onto_itself_refused,
    assert_one_error_line,
    cli,
    jsonl,
)

STATES = ("count", "events", "attrs", "total", "average")


@pytest.fixture
def job(tmp_path: Path) -> Iterator[ChangelogJob]:
    """The job on file:// (one test runs it on S3)."""
    with changelog_job(Storage(tmp_path.as_uri()), tmp_path) as made:
        yield made


def read_records(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob, name: str, state: str, *more: str
) -> dict[str, Any]:
    status, out, err = cli(
        capsys, job.storage, "read", name, "--operator", OPERATOR, "--state", state, *more
    )
    assert status == 0, err
    records = jsonl(out)
    assert len({r["key"] for r in records}) == len(records)
    return {r["key"]: r["value"] for r in records}


def test_list_shows_manifests_and_materializations(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob
) -> None:
    status, out, err = cli(
        capsys, job.storage, "list", job.checkpoints.layout.checkpoint_dir, "--json"
    )
    assert status == 0, err
    [listed] = json.loads(out)
    assert listed["job_dir"] == job.job_dir
    [checkpoint] = listed["checkpoints"]
    assert (checkpoint["checkpoint_id"], checkpoint["materializes"]) == (1, 2)
    manifests = {m["batch_id"]: m for m in listed["manifests"]}
    assert sorted(manifests) == [3, 4, 5]  # three retained
    assert manifests[3]["base"] is None
    assert manifests[4]["base"]["checkpoint_id"] == manifests[5]["base"]["checkpoint_id"] == 1
    assert manifests[5]["operators"] == {OPERATOR: 3}
    for batch_id, entry in manifests.items():
        files = [
            job.changelog.record_path(h)
            for h in job.changelog.load_manifest(batch_id).handles()
            if h.path is not None
        ]
        assert entry["records"] == len(files)
        assert entry["record_bytes"] == sum(job.checkpoints.fs.size(f) for f in files if f)
    # Manifest 3 has no base: records of batches 1-3 at P=2; manifest 5: 3-4 at 2, 5 at 3.
    assert manifests[3]["records"] == 6 and manifests[5]["records"] == 7
    status, out, _ = cli(capsys, job.storage, "list", job.job_dir)
    assert status == 0
    assert "manifests/5" in out and "chk-1 (batch 2)" in out and "batch 2" in out


def test_list_names_a_savepoint_base_by_its_directory(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob
) -> None:
    """A job restored from a savepoint builds its manifests on it: ``list`` names the
    savepoint (its checkpoint id is the savepoint's, not one of the job's ``chk-N``),
    and no checkpoint of the job is marked as materializing its batch."""
    savepoint = "/backup/savepoints/savepoint-rescale-x"
    for batch_id in (4, 5):  # the manifests built on chk-1
        manifest = job.changelog.load_manifest(batch_id)
        assert manifest.base is not None and manifest.base.checkpoint_id == 1
        base = dataclasses.replace(manifest.base, path=savepoint)
        path = job.changelog.layout.manifest_path(batch_id)
        job.checkpoints.fs.write_atomic(path, dataclasses.replace(manifest, base=base).to_bytes())
    status, out, err = cli(capsys, job.storage, "list", job.job_dir)
    assert status == 0, err
    row = next(line for line in out.splitlines() if "manifests/5" in line)
    assert "savepoint-rescale-x (batch 2)" in row and "chk-1 (batch 2)" not in out
    status, out, _ = cli(capsys, job.storage, "list", job.job_dir, "--json")
    [listed] = json.loads(out)
    assert [c["materializes"] for c in listed["checkpoints"]] == [None]


def test_inspect_names_a_savepoint_base_by_its_directory(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob, tmp_path: Path
) -> None:
    """A job restored from a savepoint builds its manifests on it: ``inspect`` of such a
    manifest names the savepoint's directory, as ``list`` does, not a ``chk-N`` of the
    job (the savepoint's checkpoint id), which does not exist."""
    savepoint = join(tmp_path.as_uri(), "backup", "savepoint-rescale-x")
    status, _, err = cli(
        capsys, job.storage, "savepoint", "create", "--from", f"{job.job_dir}/chk-1",
        "--to", savepoint,
    )  # fmt: skip
    assert status == 0, err
    manifest = job.changelog.load_manifest(5)
    assert manifest.base is not None and manifest.base.checkpoint_id == 1
    base = dataclasses.replace(manifest.base, path=savepoint)
    path = job.changelog.layout.manifest_path(5)
    job.checkpoints.fs.write_atomic(path, dataclasses.replace(manifest, base=base).to_bytes())
    status, out, err = cli(capsys, job.storage, "inspect", f"{job.job_dir}/manifests/5")
    assert status == 0, err
    [line] = [line for line in out.splitlines() if line.startswith("  base: ")]
    assert line.startswith("  base: savepoint-rescale-x (state of batch 2), "), line
    assert line.endswith(savepoint) and "chk-1" not in line


@pytest.mark.parametrize("batch_id", [3, 5])
def test_read_a_manifest_matches_the_model(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob, batch_id: int
) -> None:
    for state in STATES:
        assert read_records(capsys, job, job.manifest(batch_id), state) == expected_values(
            job, batch_id, state
        ), state
    key = sorted(job.states[batch_id])[7]
    assert read_records(capsys, job, job.manifest(batch_id), "attrs", "--key", key) == {
        k: v for k, v in expected_values(job, batch_id, "attrs").items() if k == key
    }


def test_latest_is_the_newest_manifest_or_a_later_checkpoint(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob
) -> None:
    latest = join(job.job_dir, "latest")
    assert read_records(capsys, job, latest, "count") == expected_values(job, 5, "count")
    status, out, _ = cli(capsys, job.storage, "inspect", latest, "--json")
    assert (status, json.loads(out)["kind"], json.loads(out)["batch_id"]) == (0, "manifest", 5)
    # A checkpoint of batch 5 holds the same state as manifest 5: the manifest stays.
    checkpoint(job.changelog, job.coordinator, job.backends, 5)
    status, out, _ = cli(capsys, job.storage, "inspect", latest, "--json")
    assert json.loads(out)["kind"] == "manifest"
    # One of a later batch (e.g. a job that stopped writing the changelog) is newer.
    checkpoint(job.changelog, job.coordinator, job.backends, 6)
    status, out, _ = cli(capsys, job.storage, "inspect", latest, "--json")
    info = json.loads(out)
    assert (status, info["kind"], info["checkpoint_id"]) == (0, "checkpoint", 3)


def test_latest_passes_over_a_damaged_newest_checkpoint_to_the_newest_manifest(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, job: ChangelogJob
) -> None:
    """The newest checkpoint's ``_metadata`` damaged, its manifests and their base intact:
    ``latest`` is the newest manifest, as a restore falls back to it, with a warning."""
    newest = job.checkpoints.layout.checkpoint_path(
        checkpoint(job.changelog, job.coordinator, job.backends, 6)
    )
    job.checkpoints.fs.write_atomic(join(newest, "_metadata"), b"{damaged")
    status, out, err = cli(capsys, job.storage, "verify", join(job.job_dir, "latest"))
    assert status == 0, err
    assert "manifests/5" in out and "not a checkpoint metadata file" in caplog.text


def test_verify_a_manifest_catches_damaged_records_and_base(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob
) -> None:
    name = job.manifest(5)
    status, out, err = cli(capsys, job.storage, "verify", name)
    assert status == 0 and out.startswith(f"OK {name}: "), err
    base_files = len(job.checkpoints.load(1).files())
    assert f": {base_files + 7} files" in out
    fs = job.checkpoints.fs
    manifest = job.changelog.load_manifest(5)
    record = next(h for h in manifest.handles() if h.path is not None and h.batch_id == 5)
    path = job.changelog.record_path(record)
    assert path is not None
    original = fs.read_file(path)
    for damage in ("flip", "truncate", "delete"):
        fs.delete(path)
        if damage != "delete":
            changed = bytes([original[0] ^ 0xFF]) + original[1:]
            fs.write_file(path, [changed if damage == "flip" else original[:-3]])
        status, out, err = cli(capsys, job.storage, "verify", name)
        assert status == 1, damage
        assert_one_error_line(err)
        assert f"FAILED {path}" in out and path in err, damage
        if fs.exists(path):
            fs.delete(path)
        fs.write_file(path, [original])
    assert cli(capsys, job.storage, "verify", name)[0] == 0
    # The base is verified as a checkpoint: a damaged keyed file of chk-1 is named.
    metadata = job.checkpoints.load(1)
    keyed = metadata.operators[OPERATOR].subtasks[0].keyed
    assert keyed is not None
    base_file = join(job.checkpoints.layout.checkpoint_path(1), keyed.path)
    fs.delete(base_file)
    status, out, err = cli(capsys, job.storage, "verify", name)
    assert status == 1 and f"FAILED {base_file}" in out
    # Manifest 3 does not need chk-1.
    assert cli(capsys, job.storage, "verify", job.manifest(3))[0] == 0


def test_inspect_and_plan_a_manifest(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob, tmp_path: Path
) -> None:
    status, out, err = cli(capsys, job.storage, "inspect", job.manifest(5), "--json")
    assert status == 0, err
    info = json.loads(out)
    assert (info["kind"], info["batch_id"], info["max_parallelism"]) == ("manifest", 5, 128)
    assert info["base"]["checkpoint_id"] == 1 and info["base"]["batch_id"] == 2
    op = info["operators"][OPERATOR]
    assert op["parallelism"] == 3
    assert {n: s["kind"] for n, s in op["keyed_states"].items()} == {
        "attrs": "map",
        "average": "aggregating",
        "count": "value",
        "events": "list",
        "total": "reducing",
    }
    assert [(b["batch_id"], b["parallelism"]) for b in op["batches"]] == [(3, 2), (4, 2), (5, 3)]
    for batch in op["batches"]:
        for sub in batch["subtasks"]:
            expected = compute_key_group_range_for_operator_index(
                MAX_PARALLELISM, batch["parallelism"], sub["subtask"]
            )
            assert sub["key_group_range"] == expected.to_json()
            assert sub["bytes"] == (
                job.checkpoints.fs.size(sub["path"]) if sub["path"] is not None else 0
            )
    status, out, _ = cli(capsys, job.storage, "inspect", job.manifest(5))
    assert status == 0 and "base: chk-1 (state of batch 2)" in out and "aggregating" in out

    for parallelism in (1, 4):
        status, out, err = cli(
            capsys, job.storage, "plan", job.manifest(5), "-p", str(parallelism), "--json"
        )
        assert status == 0, err
        plans = json.loads(out)[OPERATOR]
        seen: set[str] = set()
        for i, plan in enumerate(plans):
            groups = compute_key_group_range_for_operator_index(MAX_PARALLELISM, parallelism, i)
            assert plan["key_group_range"] == groups.to_json()
            # Base sources: the old P=2 subtasks whose ranges intersect; records: every
            # batch's subtasks at its own parallelism whose ranges intersect.
            expected_base = {
                old
                for old in range(2)
                if compute_key_group_range_for_operator_index(MAX_PARALLELISM, 2, old).intersection(
                    groups
                )
            }
            assert {s["old_subtask"] for s in plan["keyed_sources"]} == expected_base
            expected_records = {
                (b, old)
                for b, p in ((3, 2), (4, 2), (5, 3))
                for old in range(p)
                if compute_key_group_range_for_operator_index(MAX_PARALLELISM, p, old).intersection(
                    groups
                )
            }
            assert {(s["batch_id"], s["old_subtask"]) for s in plan["changelog_sources"]} == (
                expected_records
            )
            # A rebuild of this subtask holds exactly the model's keys of its range.
            (backend,) = [
                b
                for j, b in enumerate(
                    rebuild(
                        "heap",
                        job.changelog,
                        job.changelog.load_manifest(5),
                        parallelism,
                        tmp_path / f"plan-{parallelism}",
                    )
                )
                if j == i
            ]
            keys = set(read_keyed(backend))
            assert all(subtask_of(k, parallelism) == i for k in keys) and not keys & seen
            seen |= keys
        assert seen == set(job.states[5])
    status, out, _ = cli(capsys, job.storage, "plan", job.manifest(5), "-p", "2", "--json")
    reads = [p["keyed_bytes"] + p["changelog_bytes"] for p in json.loads(out)[OPERATOR]]
    imbalance = max(reads) / (sum(reads) / len(reads))
    status, out, _ = cli(capsys, job.storage, "plan", job.manifest(5), "-p", "2")
    assert status == 0 and "changelog:" in out and "batches 3, 4, 5" in out
    assert f"keyed imbalance {imbalance:.2f} (max/mean)" in out
    # Manifest 3 has no base: each subtask's state is in the changelog alone.
    status, out, _ = cli(capsys, job.storage, "plan", job.manifest(3), "-p", "2")
    assert status == 0 and "no keyed state" not in out, out
    assert out.count("no base state (its state is in the changelog)") == 2, out


def test_savepoint_folds_a_manifest_and_restores_at_any_parallelism(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob, tmp_path: Path
) -> None:
    target = (tmp_path / "savepoints" / "from-manifest-5").as_uri()
    status, out, err = cli(
        capsys, job.storage, "savepoint", "create", "--from", job.manifest(5), "--to", target,
        "-p", "2",
    )  # fmt: skip
    assert status == 0, err
    assert out.strip() == target and "not signed" in err
    # Self-contained: the job's directory (base, changelog, manifests) is gone.
    job.checkpoints.fs.delete(job.job_dir, recursive=True)
    savepoint = CheckpointStorage(target, "job")
    metadata = load_metadata(savepoint.fs, target)
    assert metadata.is_savepoint and metadata.operators[OPERATOR].parallelism == 2
    assert metadata.properties["batch_id"] == 5
    assert cli(capsys, job.storage, "verify", target)[0] == 0
    status, out, _ = cli(capsys, job.storage, "inspect", target)
    assert status == 0
    assert out.startswith(
        f"savepoint of job job folded from its batch manifest 5 (the state at the end of "
        f"batch 5): {target}"
    ), out
    for parallelism in (1, 3, 4):
        found: dict[str, Any] = {}
        for i in range(parallelism):
            kind = "rocksdb" if parallelism == 3 else "heap"
            backend = make_backend(kind, tmp_path / f"sp-{parallelism}-{i}", parallelism, i)
            try:
                restore_keyed_state(backend, savepoint.fs, target, metadata, OPERATOR)
                mine = read_keyed(backend)
            finally:
                backend.dispose()
            assert all(subtask_of(k, parallelism) == i for k in mine)
            assert not set(mine) & set(found)
            found.update(mine)
        assert found == job.states[5]
    assert read_records(capsys, job, target, "total") == expected_values(job, 5, "total")
    assert_copy_onto_itself_refused(capsys, job.storage, target)


def test_folding_a_manifest_at_parallelism_zero_is_refused(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob, tmp_path: Path
) -> None:
    target = tmp_path / "savepoints" / "zero"
    status, _, err = cli(
        capsys, job.storage, "savepoint", "create", "--from", job.manifest(5), "--to",
        target.as_uri(), "-p", "0",
    )  # fmt: skip
    assert (status, err) == (
        1,
        "statebackend: error: parallelism 0 is invalid: it must be an integer >= 1\n",
    )
    assert not target.exists()


def test_gc_keeps_what_retained_manifests_need_and_deletes_other_records(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob
) -> None:
    fs, layout, changelog = job.checkpoints.fs, job.changelog.layout, job.changelog
    # A rejected attempt of committed batch 5, and a record of batch 6 not yet committed.
    backend = job.backends[0]
    count: Any = backend.get_state(descriptors()["count"])
    backend.set_current_key(next(k for k in job.states[5] if subtask_of(k, 3) == 0))
    count.update(1)
    rejected_path = changelog.record_path(
        changelog.write_record(5, OPERATOR, 0, "rejected", backend.drain_changelog())
    )
    count.update(2)
    in_flight_path = changelog.record_path(
        changelog.write_record(6, OPERATOR, 0, "next", backend.drain_changelog())
    )
    assert rejected_path is not None and in_flight_path is not None
    needed = {
        path
        for b in (3, 4, 5)
        for h in changelog.load_manifest(b).handles()
        if (path := changelog.record_path(h)) is not None
    }

    def listed(*more: str) -> set[str]:
        status, out, err = cli(capsys, job.storage, "gc", job.job_dir, "--grace", "0", *more)
        assert status == 0, err
        return {line.split()[1] for line in out.splitlines()[:-1]}

    assert listed() == {rejected_path}
    # Files younger than the grace period are never garbage.
    status, out, _ = cli(capsys, job.storage, "gc", job.job_dir)
    assert out.strip() == f"0 unreferenced files, 0 B, in {job.job_dir}"
    # Manifest 3 retired (as the job's retention does): records 1-2 are below every base.
    fs.delete(layout.manifest_path(3))
    old = {
        changelog.record_path(h)
        for h in changelog.load_manifest(3).handles()
        if h.batch_id < 3 and h.path is not None
    }
    assert len(old) == 4
    assert not old & {changelog.record_path(h) for h in changelog.load_manifest(5).handles()}
    assert listed() == old | {rejected_path}
    assert listed("--apply") == old | {rejected_path}
    assert listed() == set()
    assert fs.exists(in_flight_path)
    assert all(fs.exists(p) for p in needed - old)
    assert fs.list_dir(layout.changelog_dir) == ["3", "4", "5", "6"]
    assert cli(capsys, job.storage, "verify", job.manifest(5))[0] == 0
    assert read_records(capsys, job, job.manifest(5), "events") == expected_values(job, 5, "events")


def test_manifest_names_and_refusals_are_one_error_line(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob, tmp_path: Path
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("0123456789abcdef0123")
    for argv in (
        ("inspect", job.manifest(9)),
        ("inspect", job.manifest(5), "--signing-key-file", str(key_file)),
        ("read", job.manifest(5), "--operator", "nope", "--state", "count"),
        ("read", job.manifest(5), "--operator", OPERATOR, "--state", "nope"),
        ("plan", job.manifest(5), "-p", "2", "--operator", "nope"),
        ("plan", job.manifest(5), "-p", str(MAX_PARALLELISM + 1)),
        ("inspect", join(job.checkpoints.layout.checkpoint_dir, "nojob", "latest")),
    ):
        status, _, err = cli(capsys, job.storage, *argv)
        assert status == 1, argv
        assert_one_error_line(err)
    job.checkpoints.fs.delete(job.checkpoints.layout.checkpoint_path(1), recursive=True)
    status, _, err = cli(capsys, job.storage, "inspect", job.manifest(5))
    assert status == 1 and "chk-1 of manifest 5 is gone" in err
    assert cli(capsys, job.storage, "inspect", job.manifest(3))[0] == 0


def test_read_of_a_missing_operator_names_the_manifest_given(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob
) -> None:
    for name in (job.manifest(5), join(job.job_dir, "latest")):
        for what in (("--state", "count"), ("--timers",)):
            status, _, err = cli(capsys, job.storage, "read", name, "--operator", "nope", *what)
            assert status == 1
            assert_one_error_line(err)
            assert f"{name} has no operator 'nope'; it has {OPERATOR}" in err
            assert "statebackend-read-" not in err


def test_transform_of_a_manifest_says_to_fold_it_first(
    capsys: pytest.CaptureFixture[str], job: ChangelogJob, tmp_path: Path
) -> None:
    for source in (job.manifest(5), join(job.job_dir, "latest")):
        status, _, err = cli(
            capsys, job.storage, "savepoint", "transform", "--from", source, "--to", "x"
        )
        assert status == 1
        assert_one_error_line(err)
        assert f"savepoint create --from {source} --to DIR`, then transform DIR" in err
    folded = (tmp_path / "folded").as_uri()
    argv = ("savepoint", "create", "--from", job.manifest(5), "--to", folded)
    assert cli(capsys, job.storage, *argv)[0] == 0
    argv = ("savepoint", "transform", "--from", folded, "--to", (tmp_path / "new").as_uri())
    status, _, err = cli(capsys, job.storage, *argv, "--drop-state", f"{OPERATOR}/count")
    assert status == 0, err


@pytest.mark.s3
def test_list_verify_read_a_manifest_on_s3(
    capsys: pytest.CaptureFixture[str], s3_storage: Storage, tmp_path: Path
) -> None:
    with changelog_job(s3_storage, tmp_path) as job:
        status, out, err = cli(capsys, job.storage, "list", job.job_dir, "--json")
        assert status == 0, err
        [listed] = json.loads(out)
        assert [m["batch_id"] for m in listed["manifests"]] == [3, 4, 5]
        assert listed["checkpoints"][0]["materializes"] == 2
        status, out, err = cli(capsys, job.storage, "verify", job.manifest(5))
        assert status == 0 and out.startswith("OK s3://"), err
        for state in ("attrs", "average"):
            assert read_records(capsys, job, join(job.job_dir, "latest"), state) == (
                expected_values(job, 5, state)
            )


def test_read_timers_of_a_manifest(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    storage = Storage(tmp_path.as_uri())
    changelog = ChangelogStorage(open_storage(storage))
    backend = enabled(make_backend("heap", tmp_path, 1, 0))
    timers = backend.timer_service
    model: set[tuple[int, str]] = set()
    rng = random.Random(3)
    try:
        for batch_id in (1, 2, 3):
            for _ in range(40):
                key, timestamp = f"user-{rng.randrange(30)}", rng.randrange(100)
                backend.set_current_key(key)
                if rng.random() < 0.7:
                    timers.register_event_time_timer(timestamp)
                    model.add((timestamp, key))
                elif model:
                    timestamp, key = sorted(model)[rng.randrange(len(model))]
                    backend.set_current_key(key)
                    timers.delete_event_time_timer(timestamp)
                    model.discard((timestamp, key))
            record = changelog.write_record(batch_id, OPERATOR, 0, "a", backend.drain_changelog())
            changelog.commit(batch_id, {OPERATOR: [record]}, max_parallelism=MAX_PARALLELISM)
    finally:
        backend.dispose()
    name = changelog.layout.manifest_path(3)
    status, out, err = cli(capsys, storage, "read", name, "--operator", OPERATOR, "--timers")
    assert status == 0, err
    found = [(r["timestamp"], r["key"]) for r in jsonl(out)]
    assert {r["domain"] for r in jsonl(out)} == {"event"}
    assert sorted(found) == sorted(model) and len(found) == len(model)
    key = sorted(model)[0][1]
    status, out, _ = cli(
        capsys, storage, "read", name, "--operator", OPERATOR, "--timers", "--key", key
    )
    assert sorted((r["timestamp"], r["key"]) for r in jsonl(out)) == sorted(
        t for t in model if t[1] == key
    )


def test_a_rebuild_that_would_unpickle_needs_allow_pickle(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    storage = Storage(tmp_path.as_uri())
    changelog = ChangelogStorage(open_storage(storage))

    def record(batch_id: int, serializer: Any, value: Any) -> Any:
        """Subtask 0 of 1 of batch B, which set state "v" of key "k" with ``serializer``."""
        backend = enabled(make_backend("heap", tmp_path, 1, 0))
        try:
            backend.set_current_key("k")
            backend.get_state(ValueStateDescriptor("v", serializer)).update(value)  # type: ignore[attr-defined]
            return changelog.write_record(batch_id, OPERATOR, 0, "a", backend.drain_changelog())
        finally:
            backend.dispose()

    def read(batch_id: int, *more: str) -> tuple[int, str, str]:
        name = changelog.layout.manifest_path(batch_id)
        return cli(capsys, storage, "read", name, "--operator", OPERATOR, "--state", "v", *more)

    # json -> pickle: the migration decodes JSON and encodes pickle; nothing is unpickled.
    for batch_id, serializer, value in ((1, JsonSerializer(), [1]), (2, PickleSerializer(), {2})):
        handle = record(batch_id, serializer, value)
        changelog.commit(batch_id, {OPERATOR: [handle]}, max_parallelism=MAX_PARALLELISM)
    status, out, err = read(2)
    assert status == 0, err
    [line] = jsonl(out)
    assert line["value"]["serializer"] == "pickle"  # shown, not unpickled
    status, out, _ = read(2, "--allow-pickle")
    assert status == 0 and jsonl(out) == [{"key": "k", "value": repr({2})}]
    # pickle -> json: migrating would unpickle the stored values.
    handle = record(3, JsonSerializer(), 3)
    changelog.commit(3, {OPERATOR: [handle]}, max_parallelism=MAX_PARALLELISM)
    status, _, err = read(3)
    assert status == 1 and "--allow-pickle" in err
    assert_one_error_line(err)


def test_a_signed_manifest_is_read_with_its_key_and_a_changed_record_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("0123456789abcdef0123")
    key = load_signing_key(key_file=str(key_file))
    with changelog_job(Storage((tmp_path / "signed").as_uri()), tmp_path, key) as job:
        signed = ("--signing-key-file", str(key_file))
        assert cli(capsys, job.storage, "inspect", job.manifest(5), *signed)[0] == 0
        assert cli(capsys, job.storage, "verify", job.manifest(5), *signed)[0] == 0
        read = read_records(capsys, job, job.manifest(5), "events", *signed)
        assert read == expected_values(job, 5, "events")

        record = next(h for h in job.changelog.load_manifest(5).handles() if h.path)
        path = job.changelog.record_path(record)
        assert path is not None
        data = bytearray(job.checkpoints.fs.read_file(path))
        data[-1] ^= 0xFF
        job.checkpoints.fs.write_atomic(path, bytes(data))
        status, _, err = cli(
            capsys,
            job.storage,
            "read",
            job.manifest(5),
            "--operator",
            OPERATOR,
            "--state",
            "events",
            *signed,
        )
        assert status == 1 and path in err
        assert_one_error_line(err)
