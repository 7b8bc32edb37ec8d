"""A keyed subtask's operator state in its changelog records (issue 9 part 3).

Each record may carry a full copy of the subtask's operator state after the key groups'
changes; the newest record of each old subtask wins, and ``rebuild_operator_state``
redistributes the copies by mode to a new parallelism. Expected shares are computed in
plain Python from the elements the test put in.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.checkpoint.changelog_restore import rebuild_operator_state
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import open_filesystem
from statebackend.checkpoint.restore import restore_operator_state
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata
from statebackend.errors import CheckpointCorruptedError
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
)
from statebackend.serializers import IntSerializer, StrSerializer
from statebackend.snapshot.changelog_format import (
    ChangelogHandle,
    read_changes,
    read_operator_state,
)
from statebackend.snapshot.operator_format import OperatorStateReader
from statebackend.state.descriptors import ValueStateDescriptor
from statebackend.state.interfaces import ValueState
from statebackend.tools.listing import inspect_checkpoint
from statebackend.tools.location import ManifestRef, open_checkpoint, open_state
from statebackend.tools.manifests import fold_manifest, inspect_manifest, plan_manifest

OPERATOR = "op"
MAX_PARALLELISM = 16


def operator_state(subtask: int, batch: int) -> OperatorStateBackend:
    """Subtask ``subtask``'s state after ``batch``: distinct split elements, one union
    element, the same broadcast rules everywhere, one raw partition."""
    state = OperatorStateBackend()
    state.get_list_state("late", IntSerializer()).add_all(
        [subtask * 1000 + batch * 100 + n for n in range(subtask + 3)]
    )
    state.get_union_list_state("seen", StrSerializer()).add(f"s{subtask}-b{batch}")
    rules = state.get_broadcast_state("rules", StrSerializer(), IntSerializer())
    rules.put_all({"red": batch, "blue": 2 * batch})
    state.set_raw_state([f"raw-{subtask}-{batch}".encode()])
    return state


def keyed_backend(parallelism: int, subtask: int) -> HeapKeyedStateBackend:
    backend = HeapKeyedStateBackend(
        max_parallelism=MAX_PARALLELISM,
        key_group_range=compute_key_group_range_for_operator_index(
            MAX_PARALLELISM, parallelism, subtask
        ),
        key_serializer=StrSerializer(),
    )
    backend.enable_changelog()
    return backend


def owned_key(backend: HeapKeyedStateBackend) -> str:
    """The first ``key-<n>`` in the backend's key groups."""
    serialize = StrSerializer().serialize
    return next(
        key
        for key in (f"key-{n}" for n in range(1000))
        if assign_to_key_group(serialize(key), MAX_PARALLELISM) in backend.key_group_range
    )


def write_batch(
    changelog: ChangelogStorage, batch: int, parallelism: int, with_state: bool = True
) -> list[ChangelogHandle]:
    """One record per subtask with a keyed change and (``with_state``) operator state."""
    handles = []
    for subtask in range(parallelism):
        backend = keyed_backend(parallelism, subtask)
        total = backend.get_state(ValueStateDescriptor("total", IntSerializer()))
        assert isinstance(total, ValueState)
        backend.set_current_key(owned_key(backend))
        total.update(batch)
        cut = operator_state(subtask, batch).sync_cut() if with_state else None
        handles.append(
            changelog.write_record(batch, OPERATOR, subtask, "a", backend.drain_changelog(), cut)
        )
        backend.dispose()
    return handles


@pytest.fixture
def changelog(tmp_path: Path) -> ChangelogStorage:
    return ChangelogStorage(CheckpointStorage(tmp_path.as_uri(), "job", compression="zstd"))


def test_a_record_round_trips_its_operator_state_beside_its_changes(
    changelog: ChangelogStorage,
) -> None:
    (handle,) = write_batch(changelog, 1, 1)
    loaded = ChangelogHandle.from_json(handle.to_json())
    assert loaded == handle
    info = loaded.operator_state
    assert info is not None and info.raw == 1
    assert {n: (s.mode.value, s.length) for n, s in info.states.items()} == {
        "late": ("split", 3),
        "seen": ("union", 1),
        "rules": ("broadcast", 2),
    }
    path = changelog.record_path(loaded)
    assert path is not None
    stored = read_operator_state(changelog.fs.read_range, path, loaded)
    restored = OperatorStateReader([stored], "unused", changelog.fs.read_range).restore_cut(0, 1)
    assert restored == operator_state(0, 1).sync_cut()
    changes = list(read_changes(changelog.fs.read_range, path, loaded, loaded.key_group_range))
    assert [(name, change.key) for name, _, change in changes] == [
        ("total", StrSerializer().serialize(owned_key(keyed_backend(1, 0))))
    ]


def test_operator_state_alone_writes_a_record_and_old_handles_have_none(
    changelog: ChangelogStorage,
) -> None:
    backend = keyed_backend(1, 0)
    cut = operator_state(0, 1).sync_cut()
    handle = changelog.write_record(1, OPERATOR, 0, "a", backend.drain_changelog(), cut)
    assert handle.changes == 0 and handle.key_groups == () and handle.path is not None
    old = handle.to_json()
    del old["operator_state"]  # a record written before operator state existed
    assert ChangelogHandle.from_json(old).operator_state is None
    empty = changelog.write_record(2, OPERATOR, 0, "a", backend.drain_changelog())
    assert empty.path is None and empty.operator_state is None
    backend.dispose()


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (1, 2), (2, 2)])
def test_the_newest_records_are_redistributed_by_mode(
    changelog: ChangelogStorage, old: int, new: int
) -> None:
    changelog.commit(1, {OPERATOR: write_batch(changelog, 1, old)}, max_parallelism=16)
    manifest = changelog.commit(2, {OPERATOR: write_batch(changelog, 2, old)}, max_parallelism=16)
    shares = [rebuild_operator_state(changelog, manifest, OPERATOR, i, new) for i in range(new)]
    assert all(share.is_restored for share in shares)
    expected = [operator_state(i, 2) for i in range(old)]
    late = [s.get_list_state("late", IntSerializer()).get() for s in shares]
    every_late = [x for e in expected for x in e.get_list_state("late", IntSerializer()).get()]
    assert Counter(x for share in late for x in share) == Counter(every_late)
    sizes = sorted(len(share) for share in late)
    assert sizes[-1] - sizes[0] <= 1
    if old == new:
        assert late == [e.get_list_state("late", IntSerializer()).get() for e in expected]
    union = {f"s{i}-b2" for i in range(old)}
    for share in shares:
        assert sorted(share.get_union_list_state("seen", StrSerializer()).get()) == sorted(union)
        rules = share.get_broadcast_state("rules", StrSerializer(), IntSerializer())
        assert dict(rules.items()) == {"red": 2, "blue": 4}
    raw = Counter(p for share in shares for p in share.get_raw_state())
    assert raw == Counter(f"raw-{i}-2".encode() for i in range(old))


def test_records_without_operator_state_restore_an_empty_restored_state(
    changelog: ChangelogStorage,
) -> None:
    manifest = changelog.commit(
        1, {OPERATOR: write_batch(changelog, 1, 2, with_state=False)}, max_parallelism=16
    )
    state = rebuild_operator_state(changelog, manifest, OPERATOR, 0, 3)
    assert state.is_restored and state.sync_cut().states == {}


def test_a_damaged_operator_state_is_reported_with_its_path(changelog: ChangelogStorage) -> None:
    (handle,) = write_batch(changelog, 1, 1)
    manifest = changelog.commit(1, {OPERATOR: [handle]}, max_parallelism=16)
    path = changelog.record_path(handle)
    assert path is not None and handle.operator_state is not None
    data = bytearray(changelog.fs.read_file(path))
    data[handle.operator_state.offset + 20] ^= 0xFF
    changelog.fs.write_atomic(path, bytes(data))
    with pytest.raises(CheckpointCorruptedError, match=f"{path} \\(operator state\\)"):
        rebuild_operator_state(changelog, manifest, OPERATOR, 0, 1)


def test_inspect_plan_and_fold_of_a_manifest_keep_the_operator_state(
    changelog: ChangelogStorage, tmp_path: Path
) -> None:
    changelog.commit(1, {OPERATOR: write_batch(changelog, 1, 2)}, max_parallelism=16)
    manifest = changelog.commit(2, {OPERATOR: write_batch(changelog, 2, 2)}, max_parallelism=16)
    ref = open_state(changelog.layout.manifest_path(2))
    assert isinstance(ref, ManifestRef)
    expected = [operator_state(i, 2) for i in range(2)]
    every_late = [x for e in expected for x in e.get_list_state("late", IntSerializer()).get()]
    shown = inspect_manifest(ref)["operators"][OPERATOR]["operator_states"]
    assert {n: (s["mode"], s["elements"]) for n, s in shown.items()} == {
        "late": ("split", len(every_late)),
        "seen": ("union", 2),
        "rules": ("broadcast", 4),  # a copy of two rules per subtask
    }
    plans = plan_manifest(ref, 3)[OPERATOR]
    assert sum(plan["operator_state"]["late"]["elements"] for plan in plans) == len(every_late)

    folded = fold_manifest(ref, str(tmp_path / "folded"), parallelism=3)
    fs = open_filesystem(folded)
    metadata = load_metadata(fs, folded)
    # The manifest's serializers are those of a checkpoint of the same state.
    of_checkpoint = inspect_checkpoint(open_checkpoint(folded))["operators"][OPERATOR]
    assert {n: s["serializer"] for n, s in shown.items()} == {
        "late": "value: int",
        "seen": "value: str",
        "rules": "user_key: str, value: int",
    }
    assert {n: (s["serializers"], s["serializer"]) for n, s in shown.items()} == {
        n: (s["serializers"], s["serializer"]) for n, s in of_checkpoint["operator_states"].items()
    }
    shares = [restore_operator_state(fs, folded, metadata, OPERATOR, i, 3) for i in range(3)]
    late = [x for s in shares for x in s.get_list_state("late", IntSerializer()).get()]
    assert Counter(late) == Counter(every_late)
    for share in shares:
        rules = share.get_broadcast_state("rules", StrSerializer(), IntSerializer())
        assert dict(rules.items()) == {"red": 2, "blue": 4}
    # Same parallelism: each folded subtask gets back its own split list, as rebuilt.
    rebuilt = [rebuild_operator_state(changelog, manifest, OPERATOR, i, 3) for i in range(3)]
    assert [s.sync_cut().states["late"] for s in shares] == [
        s.sync_cut().states["late"] for s in rebuilt
    ]
