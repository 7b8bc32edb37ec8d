"""The per-batch changelog in checkpoint storage: records, manifests, rebuild, truncation.

The rescale matrix runs one operator (the five keyed state kinds of
``test_checkpoint_matrix``) for batches 1-4 at parallelism P, with a materialized
checkpoint taken at the end of batch 2 and completed during batch 3 (it becomes the base);
then its subtasks are rebuilt from manifest 4 at another parallelism and run batches 5-6;
finally each new subtask of every P' in {1, 2, 3, 4, 7} is rebuilt from manifest 6 (base +
records written at two parallelisms). Every key's state must come back exactly once and
equal a plain-Python model of all operations. On ``file://`` with both backends, on the
local S3 with one backend per P.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.manifest import (
    SOURCE_OFFSETS_PROPERTY,
    SOURCE_OFFSETS_STATE,
    SOURCE_OPERATOR,
    BatchManifest,
    source_offsets,
)
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.signing import SigningKey
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.checksums import DOCUMENT_CHECKSUM
from statebackend.cli import main
from statebackend.errors import CheckpointCorruptedError, CheckpointError, IncompatibleStateError
from statebackend.keygroups import KeyGroupRange
from statebackend.snapshot.changelog_format import ChangelogHandle
from statebackend.spark.streaming_restore import restore_location
from statebackend.tools.gc import find_garbage
from tests.conftest import Storage
from tests.s3.changelog_jobs import (
    JOB,
    checkpoint,
    enabled,
    live_states,
    open_storage,
    rebuild,
    run_batch,
)
from tests.s3.test_checkpoint_matrix import (
    KEYS,
    MAX_PARALLELISM,
    OPERATOR,
    PARALLELISMS,
    KeyModel,
    descriptors,
    make_backend,
    read_keyed,
    restore_kind,
    subtask_of,
)


@dataclass
class History:
    """A job's changelog history and the model of the state at its newest manifest."""

    storage: Storage
    expected: dict[str, dict[str, Any]]
    middle: int


_CACHE: dict[tuple[str, str, int], History] = {}


def build_history(kind: str, storage: Storage, parallelism: int, local_root: Path) -> History:
    rng = random.Random(parallelism * 17 + len(kind))
    checkpoints = open_storage(storage, ("none", "lz4", "zstd")[parallelism % 3])
    changelog = ChangelogStorage(checkpoints, retained=1)
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=MAX_PARALLELISM)
    models: dict[str, KeyModel] = {}
    backends = [
        enabled(make_backend(kind, local_root / f"{kind}-{parallelism}-first-{i}", parallelism, i))
        for i in range(parallelism)
    ]
    try:
        run_batch(changelog, backends, 1, rng, models)
        run_batch(changelog, backends, 2, rng, models)
        # Batch 2's materialization: the cut now, the upload in the background while
        # batch 3 runs; it becomes the base once complete.
        checkpoint_id = coordinator.trigger({OPERATOR: parallelism}, properties={"batch_id": 2})
        futures = [
            b.snapshot(checkpoint_id, checkpoints.snapshot_target(checkpoint_id, OPERATOR, i))
            for i, b in enumerate(backends)
        ]
        run_batch(changelog, backends, 3, rng, models)
        for i, future in enumerate(futures):
            ack = SubtaskAck(OPERATOR, i, parallelism, future.result(), None, coordinator.run_id)
            coordinator.acknowledge(checkpoint_id, ack)
        changelog.materialized(checkpoint_id, 2)
        manifest = run_batch(changelog, backends, 4, rng, models)
        assert manifest.base is not None and manifest.base.checkpoint_id == checkpoint_id
        assert [b.batch_id for b in manifest.operators[OPERATOR]] == [3, 4]
        # Records at or below the base that no retained manifest references are gone.
        assert changelog.fs.list_dir(changelog.layout.changelog_dir) == ["3", "4"]
    finally:
        for backend in backends:
            backend.dispose()
    middle = PARALLELISMS[(PARALLELISMS.index(parallelism) + 1) % len(PARALLELISMS)]
    backends = [
        enabled(b)
        for b in rebuild(kind, changelog, manifest, middle, local_root / f"middle-{parallelism}")
    ]
    try:
        run_batch(changelog, backends, 5, rng, models)
        run_batch(changelog, backends, 6, rng, models)
    finally:
        for backend in backends:
            backend.dispose()
        checkpoints.close()
    return History(storage, live_states(models), middle)


@pytest.fixture(scope="module")
def local_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("changelog-local")


@pytest.mark.parametrize("new_parallelism", PARALLELISMS)
@pytest.mark.parametrize("parallelism", PARALLELISMS)
@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_rescale_from_a_manifest(
    kind: str, parallelism: int, new_parallelism: int, checkpoint_url: Storage, local_root: Path
) -> None:
    scheme = checkpoint_url.url.split("://", 1)[0]
    if scheme == "s3" and kind != ("rocksdb" if parallelism % 2 else "heap"):
        pytest.skip("on S3 one backend per P keeps the suite fast; file:// runs both")
    cache_key = (kind, scheme, parallelism)
    if cache_key not in _CACHE:
        _CACHE[cache_key] = build_history(kind, checkpoint_url, parallelism, local_root / scheme)
    history = _CACHE[cache_key]
    target_kind = restore_kind(kind, new_parallelism)
    changelog = ChangelogStorage(open_storage(history.storage))
    manifest = changelog.latest_manifest()
    assert manifest is not None and manifest.batch_id == 6
    assert manifest.properties == {"n": 6}
    assert [b.parallelism for b in manifest.operators[OPERATOR]] == [parallelism] * 2 + [
        history.middle
    ] * 2
    root = local_root / f"final-{scheme}-{kind}-{parallelism}-{new_parallelism}"
    backends = rebuild(target_kind, changelog, manifest, new_parallelism, root)
    try:
        found: dict[str, dict[str, Any]] = {}
        for i, backend in enumerate(backends):
            mine = read_keyed(backend)
            assert all(subtask_of(key, new_parallelism) == i for key in mine)
            assert not set(mine) & set(found), "a key was restored by two subtasks"
            found.update(mine)
    finally:
        for backend in backends:
            backend.dispose()
    assert found == history.expected
    assert set(found) <= set(KEYS)


# -- attempts, manifests, truncation ---------------------------------------------------------


def record_of(
    changelog: ChangelogStorage, batch_id: int, attempt: str, key: str, count: int
) -> ChangelogHandle:
    """Subtask 0 (of 1) attempt ``attempt`` of batch B, which set ``key``'s count."""
    backend = enabled(make_backend("heap", Path("unused"), 1, 0))
    state = backend.get_state(descriptors()["count"])
    backend.set_current_key(key)
    state.update(count)
    handle = changelog.write_record(batch_id, OPERATOR, 0, attempt, backend.drain_changelog())
    backend.dispose()
    return handle


def counts_after_rebuild(changelog: ChangelogStorage, manifest: BatchManifest) -> dict[str, Any]:
    (backend,) = rebuild("heap", changelog, manifest, 1, Path("unused"))
    try:
        return {key: state["count"] for key, state in read_keyed(backend).items()}
    finally:
        backend.dispose()


def test_the_accepted_attempt_is_rebuilt_and_the_other_deleted(checkpoint_url: Storage) -> None:
    changelog = ChangelogStorage(open_storage(checkpoint_url))
    first = record_of(changelog, 1, "a", "user-1", 10)
    second = record_of(changelog, 1, "b", "user-1", 20)
    first_path, second_path = changelog.record_path(first), changelog.record_path(second)
    assert first_path is not None and second_path is not None
    assert changelog.fs.exists(first_path) and changelog.fs.exists(second_path)
    manifest = changelog.commit(1, {OPERATOR: [second]}, max_parallelism=MAX_PARALLELISM)
    assert counts_after_rebuild(changelog, manifest) == {"user-1": 20}
    assert not changelog.fs.exists(first_path)
    assert changelog.fs.exists(second_path)
    # A late straggler of a committed batch goes at the next cleanup.
    late = changelog.record_path(record_of(changelog, 1, "c", "user-1", 30))
    assert late is not None and changelog.fs.exists(late)
    changelog.commit(
        2, {OPERATOR: [record_of(changelog, 2, "a", "user-2", 1)]}, max_parallelism=MAX_PARALLELISM
    )
    assert not changelog.fs.exists(late)
    latest = changelog.latest_manifest()
    assert latest is not None
    assert counts_after_rebuild(changelog, latest) == {"user-1": 20, "user-2": 1}


def test_a_manifest_is_written_once(checkpoint_url: Storage) -> None:
    changelog = ChangelogStorage(open_storage(checkpoint_url))
    accepted = record_of(changelog, 1, "a", "user-1", 10)
    other = record_of(changelog, 1, "b", "user-1", 20)
    manifest = changelog.commit(
        1, {OPERATOR: [accepted]}, max_parallelism=MAX_PARALLELISM, properties={"wm": 5}
    )
    path = changelog.layout.manifest_path(1)
    written = changelog.fs.read_file(path)
    again = changelog.commit(
        1, {OPERATOR: [accepted]}, max_parallelism=MAX_PARALLELISM, properties={"wm": 5}
    )
    assert again == manifest
    with pytest.raises(CheckpointError, match="already commits batch 1"):
        changelog.commit(1, {OPERATOR: [other]}, max_parallelism=MAX_PARALLELISM)
    with pytest.raises(CheckpointError, match="already commits batch 1"):
        changelog.commit(
            1, {OPERATOR: [accepted]}, max_parallelism=MAX_PARALLELISM, properties={"wm": 6}
        )
    # What a second driver of the same job meets: the other one committed batch 1.
    with pytest.raises(CheckpointError, match="another query or driver runs this job too"):
        changelog.commit(0, {OPERATOR: [accepted]}, max_parallelism=MAX_PARALLELISM)
    assert changelog.fs.read_file(path) == written
    assert changelog.manifest_ids() == [1]


def test_a_manifest_changed_after_it_was_written_is_refused(checkpoint_url: Storage) -> None:
    """One digit of a source offset changed in a manifest (still valid JSON) made a
    resumed job read a partition again from its start, silently; the manifest's own
    checksum refuses it now. A manifest without one (an older release's) still loads."""
    changelog = ChangelogStorage(open_storage(checkpoint_url))
    handle = record_of(changelog, 1, "a", "user-1", 10)
    offsets = {"offsets": [[1, 513887]]}
    changelog.commit(1, {OPERATOR: [handle]}, max_parallelism=MAX_PARALLELISM, properties=offsets)
    path = changelog.layout.manifest_path(1)
    written = changelog.fs.read_file(path)
    assert changelog.load_manifest(1).properties == offsets
    changelog.fs.write_atomic(path, written.replace(b"[1,513887]", b"[3,513887]"))
    restarted = ChangelogStorage(open_storage(checkpoint_url))  # nothing cached
    with pytest.raises(CheckpointCorruptedError, match=f"{path} is damaged: .* checksum"):
        restarted.load_manifest(1)
    older = json.loads(written)
    del older[DOCUMENT_CHECKSUM]
    changelog.fs.write_atomic(path, json.dumps(older).encode())
    assert ChangelogStorage(open_storage(checkpoint_url)).load_manifest(1).properties == offsets


def test_a_committer_that_another_one_followed_builds_on_its_batches(
    checkpoint_url: Storage,
) -> None:
    """A query restarted on its older ``transform_with_state`` object, after another
    object ran batches of the same job, commits through a ``ChangelogStorage`` that knows
    only its own manifests (and so does one whose manifest write landed though it
    reported failure): its next manifest must still build on every committed batch, or
    a rebuild from it silently loses the batches it did not know of."""
    first = ChangelogStorage(open_storage(checkpoint_url))
    second = ChangelogStorage(open_storage(checkpoint_url))
    expected: dict[str, int] = {}
    for committer, batch_id in [(first, 0), (first, 1), (second, 2), (second, 3), (first, 4)]:
        key, count = f"user-{batch_id}", 10 + batch_id
        handle = record_of(committer, batch_id, "a", key, count)
        committer.commit(batch_id, {OPERATOR: [handle]}, max_parallelism=MAX_PARALLELISM)
        expected[key] = count
    latest = ChangelogStorage(open_storage(checkpoint_url)).latest_manifest()
    assert latest is not None and latest.batch_id == 4
    assert [b.batch_id for b in latest.operators[OPERATOR]] == [0, 1, 2, 3, 4]
    assert counts_after_rebuild(first, latest) == expected


def test_a_manifest_is_validated_on_load(checkpoint_url: Storage) -> None:
    changelog = ChangelogStorage(open_storage(checkpoint_url))
    handle = record_of(changelog, 1, "a", "user-1", 10)
    manifest = changelog.commit(1, {OPERATOR: [handle]}, max_parallelism=MAX_PARALLELISM)
    document = manifest.to_json()
    path = changelog.layout.manifest_path(2)

    def load(data: bytes) -> None:
        changelog.fs.write_atomic(path, data)
        changelog.load_manifest(2)

    with pytest.raises(CheckpointCorruptedError, match=f"{path}: not a batch manifest"):
        load(b"{not json")
    with pytest.raises(IncompatibleStateError, match="format version 99"):
        load(json.dumps({**document, "format_version": 99}).encode())
    with pytest.raises(CheckpointCorruptedError, match="batch 1 of job 'job', not batch 2"):
        load(json.dumps(document).encode())
    wrong_range = json.loads(json.dumps({**document, "batch_id": 2}))
    wrong_range["operators"][OPERATOR]["batches"][0]["subtasks"][0]["key_group_range"] = [0, 5]
    with pytest.raises(CheckpointCorruptedError, match="inconsistent batch manifest"):
        load(json.dumps(wrong_range).encode())
    missing = json.loads(json.dumps({**document, "batch_id": 2}))
    del missing["operators"][OPERATOR]["batches"][0]["subtasks"][0]["checksum"]
    with pytest.raises(CheckpointCorruptedError, match="malformed batch manifest"):
        load(json.dumps(missing).encode())


def _first_record(document: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = document["operators"][OPERATOR]["batches"][0]["subtasks"][0]
    return record


MISSHAPEN_MANIFESTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "huge commit time": lambda d: d.update(committed_at=10**400),
    "NaN commit time": lambda d: d.update(committed_at=float("nan")),
    "infinite batch": lambda d: d.update(batch_id=float("inf")),
    "max parallelism beyond 32768": lambda d: d.update(max_parallelism=40000),
    "infinite subtask": lambda d: _first_record(d).update(subtask=float("inf")),
    "negative base checkpoint": lambda d: d.update(
        base={"checkpoint_id": -1, "batch_id": 0, "path": "../chk-1"}
    ),
}


def edited_manifest(checkpoint_url: Storage, edit: Callable[[dict[str, Any]], None]) -> str:
    """The path of manifest 1 (one record) committed, then rewritten with ``edit`` applied
    to its document, without the document checksum (as a release before it wrote it)."""
    changelog = ChangelogStorage(open_storage(checkpoint_url))
    handle = record_of(changelog, 1, "a", "user-1", 10)
    changelog.commit(1, {OPERATOR: [handle]}, max_parallelism=MAX_PARALLELISM)
    path = changelog.layout.manifest_path(1)
    document = json.loads(changelog.fs.read_file(path))
    del document[DOCUMENT_CHECKSUM]
    edit(document)
    changelog.fs.write_atomic(path, json.dumps(document).encode())
    return path


@pytest.mark.parametrize("fault", sorted(MISSHAPEN_MANIFESTS))
def test_a_misshapen_manifest_is_one_corruption_error_naming_it(
    checkpoint_url: Storage, fault: str
) -> None:
    """A number no int or float holds, NaN, a max parallelism no job can have, a negative
    base checkpoint id: a raw OverflowError, a ConfigurationError not naming the file, or
    a manifest loaded (whose negative base then failed the job's checkpoint retention with
    a ConfigurationError, at every completion)."""
    path = edited_manifest(checkpoint_url, MISSHAPEN_MANIFESTS[fault])
    with pytest.raises(CheckpointCorruptedError, match=re.escape(path)):
        ChangelogStorage(open_storage(checkpoint_url)).load_manifest(1)


RECORD_FAULTS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "path up and out": (
        lambda r: r.update(path="../../../../../../../../etc/passwd"),
        "is not a file of ../changelog/1/",
    ),
    "path of another job": (
        lambda r: r.update(path=r["path"].replace("../changelog", "../../other/changelog")),
        "is not a file of ../changelog/1/",
    ),
    "path of another batch": (
        lambda r: r.update(path=r["path"].replace("/1/", "/0/")),
        "is not a file of ../changelog/1/",
    ),
    "absolute path": (lambda r: r.update(path="/etc/passwd"), "is not a file of"),
    "URL": (lambda r: r.update(path="s3://another-bucket/x"), "is not a file of"),
    "negative index offset": (
        lambda r: r["key_groups"][0].__setitem__(1, -5),
        "index entry of key group",
    ),
    "index beyond the file": (
        lambda r: r["key_groups"][-1].__setitem__(2, r["size"] + 1),
        "index entry of key group",
    ),
    "negative size": (lambda r: r.update(size=-1), "negative size"),
    "operator state beyond the file": (
        lambda r: r.update(operator_state={"offset": r["size"], "length": 5, "states": {}}),
        "operator state at",
    ),
}


@pytest.mark.parametrize("fault", sorted(RECORD_FAULTS))
def test_a_manifest_record_outside_its_place_is_refused_on_load(
    checkpoint_url: Storage, fault: str
) -> None:
    """A record path leading out of the job's changelog (up, to another bucket) was read
    by a rebuild, and an index entry at a negative offset raised a raw ValueError there:
    a manifest's records are checked on load, as ``_metadata``'s handles are."""
    mutate, reason = RECORD_FAULTS[fault]
    path = edited_manifest(checkpoint_url, lambda document: mutate(_first_record(document)))
    with pytest.raises(CheckpointCorruptedError) as caught:
        ChangelogStorage(open_storage(checkpoint_url)).load_manifest(1)
    assert path in str(caught.value) and reason in str(caught.value)


@pytest.mark.parametrize(
    "offsets",
    [5, [[1, 513887]], [[[0, -5]]], [[["p", 3]]], [[[0, 1.5]]], [[[0, 1, 2]]]],
    ids=["number", "pairs without shares", "negative", "text", "fraction", "triple"],
)
def test_misshapen_source_offsets_in_a_manifest_are_one_corruption_error(
    checkpoint_url: Storage, capsys: pytest.CaptureFixture[str], offsets: Any
) -> None:
    """A manifest's source offsets (per source subtask, [partition, byte offset] pairs,
    which a StatefulJob resumes its source from) that are no such pairs: ``read`` of them
    raised a raw TypeError (a traceback), or printed a negative or fractional offset as
    one the job would resume from."""
    changelog = ChangelogStorage(open_storage(checkpoint_url))
    handle = record_of(changelog, 1, "a", "user-1", 10)
    properties = {SOURCE_OFFSETS_PROPERTY: offsets}
    changelog.commit(
        1, {OPERATOR: [handle]}, max_parallelism=MAX_PARALLELISM, properties=properties
    )
    path = changelog.layout.manifest_path(1)
    with pytest.raises(CheckpointCorruptedError, match=re.escape(path)):
        source_offsets(changelog.load_manifest(1).properties, path)
    capsys.readouterr()
    argv = ["read", path, "--operator", SOURCE_OPERATOR, "--state", SOURCE_OFFSETS_STATE]
    options = [f"--storage-option={k}={v}" for k, v in checkpoint_url.storage_options.items()]
    status = main([*argv, *options])
    out, err = capsys.readouterr()
    assert status == 1 and out == "" and err.count("\n") == 1 and path in err, err


def test_source_offsets_of_a_manifest_are_read_back() -> None:
    offsets = [[[0, 10], [2, 0]], [], [[1, 7]]]
    assert source_offsets({SOURCE_OFFSETS_PROPERTY: offsets}, "m") == [
        [(0, 10), (2, 0)],
        [],
        [(1, 7)],
    ]
    assert source_offsets({}, "m") is None


def test_retention_truncation_and_base(checkpoint_url: Storage, tmp_path: Path) -> None:
    checkpoints = open_storage(checkpoint_url)
    changelog = ChangelogStorage(checkpoints, retained=2)
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=MAX_PARALLELISM)
    backend = enabled(make_backend("rocksdb", tmp_path / "db", 1, 0))
    rng = random.Random(5)
    models: dict[str, KeyModel] = {}
    try:
        for batch_id in range(1, 5):
            run_batch(changelog, [backend], batch_id, rng, models)
        assert changelog.manifest_ids() == [3, 4]
        # Without a base every retained manifest needs every record.
        assert changelog.fs.list_dir(changelog.layout.changelog_dir) == ["1", "2", "3", "4"]
        with pytest.raises(CheckpointError, match="commit the batch first"):
            changelog.materialized(1, 5)
        checkpoint_id = coordinator.trigger({OPERATOR: 1})
        target = checkpoints.snapshot_target(checkpoint_id, OPERATOR, 0)
        handle = backend.snapshot(checkpoint_id, target).result()
        with pytest.raises(CheckpointError, match="not a completed checkpoint"):
            changelog.materialized(checkpoint_id, 4)
        coordinator.acknowledge(
            checkpoint_id, SubtaskAck(OPERATOR, 0, 1, handle, None, coordinator.run_id)
        )
        changelog.materialized(checkpoint_id, 4)
        manifest = run_batch(changelog, [backend], 5, rng, models)
        assert manifest.base is not None and manifest.base.batch_id == 4
        assert [b.batch_id for b in manifest.operators[OPERATOR]] == [5]
        assert changelog.referenced_checkpoints() == {checkpoint_id}
        # Manifest 4 is still retained and needs batches 1-4.
        assert changelog.fs.list_dir(changelog.layout.changelog_dir) == [
            str(n) for n in range(1, 6)
        ]
        run_batch(changelog, [backend], 6, rng, models)
        assert changelog.manifest_ids() == [5, 6]
        assert changelog.fs.list_dir(changelog.layout.changelog_dir) == ["5", "6"]
        # gc never touches the changelog or the manifests.
        garbage = find_garbage(checkpoints.fs, checkpoints.layout.job_dir)
        assert not [g for g in garbage if "/changelog/" in g.path or "/manifests/" in g.path]
    finally:
        backend.dispose()
    latest = changelog.latest_manifest()
    assert latest is not None
    (rebuilt,) = rebuild("heap", changelog, latest, 1, tmp_path)
    try:
        found = read_keyed(rebuilt)
    finally:
        rebuilt.dispose()
    assert found == live_states(models)


def test_a_failed_cleanup_does_not_fail_the_committed_batch(
    checkpoint_url: Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting an old manifest fails (the storage refuses once) while batch 4 commits:
    the commit returns its manifest, and the next commit deletes what no retained
    manifest needs; a rebuild equals the model."""
    checkpoints = open_storage(checkpoint_url)
    changelog = ChangelogStorage(checkpoints, retained=2)
    backend = enabled(make_backend("heap", tmp_path / "db", 1, 0))
    rng = random.Random(8)
    models: dict[str, KeyModel] = {}
    real_delete = changelog.fs.delete
    failures = [CheckpointError("could not delete: the storage refused (injected)")]

    def flaky_delete(path: str, recursive: bool = False) -> None:
        if failures:
            raise failures.pop()
        real_delete(path, recursive)

    try:
        for batch_id in range(1, 4):
            run_batch(changelog, [backend], batch_id, rng, models)
        monkeypatch.setattr(changelog.fs, "delete", flaky_delete)
        assert run_batch(changelog, [backend], 4, rng, models).batch_id == 4
        assert not failures  # the delete was tried, and failed
        assert changelog.manifest_ids() == [2, 3, 4]
        run_batch(changelog, [backend], 5, rng, models)
    finally:
        backend.dispose()
    assert changelog.manifest_ids() == [4, 5]
    assert changelog.fs.list_dir(changelog.layout.changelog_dir) == [str(n) for n in range(1, 6)]
    latest = changelog.latest_manifest()
    assert latest is not None
    (rebuilt,) = rebuild("heap", changelog, latest, 1, tmp_path)
    try:
        assert read_keyed(rebuilt) == live_states(models)
    finally:
        rebuilt.dispose()


def test_a_damaged_or_missing_record_or_base_is_reported(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    checkpoints = open_storage(checkpoint_url)
    changelog = ChangelogStorage(checkpoints)
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=MAX_PARALLELISM)
    backend = enabled(make_backend("heap", tmp_path, 1, 0))
    rng = random.Random(9)
    try:
        run_batch(changelog, [backend], 1, rng, {})
        checkpoint_id = coordinator.trigger({OPERATOR: 1})
        handle = backend.snapshot(
            checkpoint_id, checkpoints.snapshot_target(checkpoint_id, OPERATOR, 0)
        ).result()
        coordinator.acknowledge(
            checkpoint_id, SubtaskAck(OPERATOR, 0, 1, handle, None, coordinator.run_id)
        )
        changelog.materialized(checkpoint_id, 1)
        manifest = run_batch(changelog, [backend], 2, rng, {})
    finally:
        backend.dispose()
    (record,) = manifest.operators[OPERATOR][-1].subtasks
    path = changelog.record_path(record)
    assert path is not None
    data = changelog.fs.read_file(path)
    changelog.fs.write_atomic(path, data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptedError, match=path.split("://")[-1]):
        rebuild("heap", changelog, manifest, 1, tmp_path)
    changelog.fs.delete(path)
    with pytest.raises(CheckpointCorruptedError, match=f"{path.split('://')[-1]}.* missing"):
        rebuild("heap", changelog, manifest, 1, tmp_path)
    checkpoints.discard(checkpoint_id)
    with pytest.raises(CheckpointCorruptedError, match=f"chk-{checkpoint_id} of manifest 2"):
        rebuild("heap", changelog, manifest, 1, tmp_path)


def test_rebuild_needs_the_manifests_max_parallelism(checkpoint_url: Storage) -> None:
    changelog = ChangelogStorage(open_storage(checkpoint_url))
    manifest = changelog.commit(
        1,
        {OPERATOR: [record_of(changelog, 1, "a", "user-1", 1)]},
        max_parallelism=MAX_PARALLELISM,
    )
    backend = HeapKeyedStateBackend(max_parallelism=256, key_group_range=KeyGroupRange(0, 255))
    with pytest.raises(IncompatibleStateError, match="max parallelism 128"):
        rebuild_keyed_state(backend, changelog, manifest, OPERATOR)


def test_a_restore_from_the_jobs_own_checkpoint_however_spelled_keeps_it_as_a_base(
    tmp_path: Path,
) -> None:
    """A job in a plain directory restarts from its own chk-N given as a file:// URL:
    the new history's manifests build on chk-N as on the job's own checkpoint, so
    retention keeps it while they do. Before, the base was recorded by the URL, not
    pinned, and the first materialization (retained=1) deleted it: committed batch 0
    could no longer be rebuilt."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    rng, models = random.Random(5), {}
    storage = CheckpointStorage(str(directory), JOB)
    changelog = ChangelogStorage(storage)
    coordinator = CheckpointCoordinator(
        storage,
        max_parallelism=MAX_PARALLELISM,
        retained=1,
        pinned=changelog.referenced_checkpoints,
    )
    backends = [enabled(make_backend("heap", tmp_path, 2, i)) for i in range(2)]
    run_batch(changelog, backends, 1, rng, models)
    restored_id = checkpoint(changelog, coordinator, backends, 1)
    changelog.materialized(restored_id, 1)
    for backend in backends:
        backend.dispose()

    requested = restore_location(storage, (directory / JOB / f"chk-{restored_id}").as_uri())
    changelog = ChangelogStorage(storage)
    changelog.restart(-1, restored_id, requested)
    coordinator = CheckpointCoordinator(
        storage,
        max_parallelism=MAX_PARALLELISM,
        retained=1,
        pinned=changelog.referenced_checkpoints,
    )
    backends = []
    for i in range(2):
        backend = make_backend("heap", tmp_path / "second", 2, i)
        restore_keyed_state(backend, storage.fs, requested, storage.load(requested), OPERATOR)
        backends.append(enabled(backend))
    first = run_batch(changelog, backends, 0, rng, models)
    assert first.base is not None and first.base.path.startswith("../")
    checkpoint(changelog, coordinator, backends, 0)  # completes; retention runs
    for backend in backends:
        backend.dispose()
    assert restored_id in storage.completed_checkpoint_ids()
    rebuilt = rebuild("heap", changelog, first, 2, tmp_path / "rebuilt")
    found = {key: states for backend in rebuilt for key, states in read_keyed(backend).items()}
    assert found == live_states(models)


def test_a_rescaled_rebuild_keeps_the_earliest_clocks_of_a_batch(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """Two subtasks end a batch at watermarks 10 and 100 (processing times 70 and 7);
    rebuilt at parallelism 1 from their records, the clocks are the earliest of each, as
    a restore from their checkpoint gives. Before, the last record replayed won (100, 7):
    the clocks depended on the old subtasks' numbering."""
    changelog = ChangelogStorage(open_storage(checkpoint_url))
    handles = []
    for index, (watermark, processing_time) in enumerate([(10, 70), (100, 7)]):
        backend = enabled(make_backend("heap", tmp_path, 2, index))
        timers = backend.timer_service
        timers.advance_watermark(watermark, lambda key, timestamp: None)
        timers.advance_processing_time(processing_time, lambda key, timestamp: None)
        handles.append(changelog.write_record(1, OPERATOR, index, "a", backend.drain_changelog()))
        backend.dispose()
    manifest = changelog.commit(1, {OPERATOR: handles}, max_parallelism=MAX_PARALLELISM)
    for kind in ("heap", "rocksdb"):
        (rebuilt,) = rebuild(kind, changelog, manifest, 1, tmp_path / "rebuilt")
        try:
            timers = rebuilt.timer_service
            assert (timers.current_watermark, timers.current_processing_time) == (10, 7)
        finally:
            rebuilt.dispose()


def test_a_batch_without_changes_writes_no_file_but_keeps_its_meta(
    checkpoint_url: Storage,
) -> None:
    changelog = ChangelogStorage(open_storage(checkpoint_url))
    first = record_of(changelog, 1, "a", "user-1", 10)
    backend = enabled(make_backend("heap", Path("unused"), 1, 0))
    backend.get_state(descriptors()["events"])  # registered in batch 2, never written
    empty = changelog.write_record(2, OPERATOR, 0, "a", backend.drain_changelog())
    backend.dispose()
    assert empty.path is None and empty.changes == 0 and empty.files() == []
    assert changelog.fs.list_dir(changelog.layout.changelog_dir) == ["1"]
    changelog.commit(1, {OPERATOR: [first]}, max_parallelism=MAX_PARALLELISM)
    manifest = changelog.commit(2, {OPERATOR: [empty]}, max_parallelism=MAX_PARALLELISM)
    (rebuilt,) = rebuild("heap", changelog, manifest, 1, Path("unused"))
    try:
        assert [meta.name for meta in rebuilt.state_meta()] == ["count", "events"]
        assert {k: s["count"] for k, s in read_keyed(rebuilt).items()} == {"user-1": 10}
    finally:
        rebuilt.dispose()


def test_a_signed_changelog_refuses_a_forged_record_or_manifest(tmp_path: Path) -> None:
    """With a signing key, manifests are signed and records carry SHA-256 checksums: a
    record replaced by another well-formed one (which an unsigned job replays as it is),
    an edited manifest, or an unsigned one is refused with the path on rebuild."""
    key = SigningKey(b"0123456789abcdef-test-key")
    url = tmp_path.as_uri()
    plain = ChangelogStorage(CheckpointStorage(url, JOB, compression="none"))
    signed = ChangelogStorage(CheckpointStorage(url, JOB, compression="none", signing_key=key))
    accepted = record_of(signed, 1, "a", "user-1", 10)
    forged = record_of(signed, 1, "b", "user-1", 99)
    accepted_path, forged_path = signed.record_path(accepted), signed.record_path(forged)
    assert accepted_path is not None and forged_path is not None
    forgery = signed.fs.read_file(forged_path)  # the commit deletes the other attempt
    manifest = signed.commit(1, {OPERATOR: [accepted]}, max_parallelism=MAX_PARALLELISM)
    assert counts_after_rebuild(signed, manifest) == {"user-1": 10}

    signed.fs.write_atomic(accepted_path, forgery)
    assert counts_after_rebuild(plain, plain.load_manifest(1)) == {"user-1": 99}
    with pytest.raises(CheckpointCorruptedError, match=f"{accepted_path}.*does not match"):
        counts_after_rebuild(signed, manifest)

    path = signed.layout.manifest_path(1)
    document = json.loads(signed.fs.read_file(path))
    document["properties"] = {"forged": True}
    signed.fs.write_atomic(path, json.dumps(document).encode())
    with pytest.raises(CheckpointCorruptedError, match="signature does not match"):
        ChangelogStorage(signed.storage).load_manifest(1)
    del document["signature"]
    signed.fs.write_atomic(path, json.dumps(document).encode())
    with pytest.raises(CheckpointCorruptedError, match=f"{path} is not signed"):
        ChangelogStorage(signed.storage).load_manifest(1)


def test_a_restart_abandons_later_manifests_and_retention_keeps_the_base(
    checkpoint_url: Storage, tmp_path: Path
) -> None:
    """Continuing from checkpoint N of batch 2 deletes manifests 3-4 and builds manifest 3
    on N; a coordinator retaining one checkpoint keeps N while a retained manifest
    builds on it (``pinned``), and discards it once none does."""
    checkpoints = open_storage(checkpoint_url)
    changelog = ChangelogStorage(checkpoints, retained=2)
    coordinator = CheckpointCoordinator(
        checkpoints,
        max_parallelism=MAX_PARALLELISM,
        retained=1,
        pinned=changelog.referenced_checkpoints,
    )
    backend = enabled(make_backend("rocksdb", tmp_path / "db", 1, 0))
    rng = random.Random(9)
    models: dict[str, KeyModel] = {}

    def checkpoint() -> int:
        checkpoint_id = coordinator.trigger({OPERATOR: 1})
        target = checkpoints.snapshot_target(checkpoint_id, OPERATOR, 0)
        handle = backend.snapshot(checkpoint_id, target).result()
        ack = SubtaskAck(OPERATOR, 0, 1, handle, None, coordinator.run_id)
        assert coordinator.acknowledge(checkpoint_id, ack) is not None
        return checkpoint_id

    try:
        for batch_id in (1, 2):
            run_batch(changelog, [backend], batch_id, rng, models)
        at_two = live_states(models)
        base = checkpoint()
        for batch_id in (3, 4):
            run_batch(changelog, [backend], batch_id, rng, models)
        assert changelog.restart(2, base) == [3, 4]
        assert changelog.manifest_ids() == []
        key = KEYS[0]
        manifest = changelog.commit(
            3, {OPERATOR: [record_of(changelog, 3, "r", key, 77)]}, max_parallelism=MAX_PARALLELISM
        )
        assert manifest.base is not None and manifest.base.checkpoint_id == base
        expected = {k: dict(v) for k, v in at_two.items()}
        expected.setdefault(key, {})["count"] = 77
        (rebuilt,) = rebuild("heap", changelog, manifest, 1, tmp_path)
        try:
            assert read_keyed(rebuilt) == expected
        finally:
            rebuilt.dispose()

        newer = checkpoint()  # retained=1 alone would discard the base now
        assert checkpoints.fs.exists(checkpoints.layout.checkpoint_path(base) + "/_metadata")
        changelog.materialized(newer, 3)
        for batch_id in (4, 5):
            changelog.commit(
                batch_id,
                {OPERATOR: [record_of(changelog, batch_id, "r", key, batch_id)]},
                max_parallelism=MAX_PARALLELISM,
            )
        assert changelog.referenced_checkpoints() == {newer}
        checkpoint()
        assert checkpoints.completed_checkpoint_ids() == sorted({newer, newer + 1})
    finally:
        backend.dispose()
