"""The ``"checksum"`` field of ``_metadata`` and of a batch manifest cannot be switched off
by damage to its name.

A document without the field is an older release's and loads unchecked; a bit flip in
the field's name made a current document one "without a checksum", so any other edit
in it (a digit of a time or an index) loaded too. Every single-bit flip of the name, with
and without another edit, must be refused or load the values written. A document of an
older release (no checksum field) still loads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.checkpoint import manifest as manifest_module
from statebackend.checkpoint import metadata as metadata_module
from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointCorruptedError, IncompatibleStateError
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import IntSerializer
from statebackend.state.descriptors import ValueStateDescriptor

M = 8
COUNT = ValueStateDescriptor("count", IntSerializer())


def _backend() -> HeapKeyedStateBackend:
    backend = HeapKeyedStateBackend(
        max_parallelism=M, key_group_range=KeyGroupRange(0, M - 1), key_serializer=IntSerializer()
    )
    return backend


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, bytes]]]:
    """A real ``_metadata`` (a checkpoint of keyed state and a timer) and a real batch
    manifest (a record and properties): their paths and bytes."""
    root = tmp_path_factory.mktemp("documents")
    storage = CheckpointStorage(root.as_uri(), "job")
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    backend = _backend()
    backend.enable_changelog()
    for key in range(20):
        backend.set_current_key(key)
        backend.get_state(COUNT).update(key * 7)  # type: ignore[attr-defined]
    backend.timer_service.register_event_time_timer(1234)
    changelog = ChangelogStorage(storage)
    record = changelog.write_record(0, "op", 0, "a", backend.drain_changelog())
    changelog.commit(0, {"op": [record]}, max_parallelism=M, properties={"offsets": [[1, 513]]})
    n = coordinator.trigger({"op": 1})
    handle = backend.snapshot(n, storage.snapshot_target(n, "op", 0)).result()
    assert coordinator.acknowledge(n, SubtaskAck("op", 0, 1, handle, None, coordinator.run_id))
    backend.dispose()
    metadata = f"{storage.resolve(n)}/_metadata"
    manifest = changelog.layout.manifest_path(0)
    yield {
        "metadata": (metadata, storage.fs.read_file(metadata)),
        "manifest": (manifest, storage.fs.read_file(manifest)),
    }
    storage.close()


def load(kind: str, data: bytes, where: str) -> Any:
    if kind == "metadata":
        return CheckpointMetadata.from_bytes(data, where)
    return BatchManifest.from_bytes(data, where)


def flips_of_the_checksum_name(data: bytes) -> Iterator[bytes]:
    """``data`` with one bit of the word ``checksum`` in the top-level field's name
    flipped, for every bit (the top-level field is the first: its keys are sorted, and
    the handles holding file checksums come after it, under "operators")."""
    start = data.index(b'"checksum":') + 1
    for at in range(start, start + len("checksum")):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[at] ^= 1 << bit
            yield bytes(flipped)


def edit(data: bytes, kind: str) -> bytes:
    """Another change that leaves a valid document: the seconds of the time ``_metadata``
    was triggered at, or a source offset in the manifest's properties."""
    if kind == "manifest":
        assert data.count(b"[[1,513]]") == 1
        return data.replace(b"[[1,513]]", b"[[1,514]]")
    (match,) = re.finditer(rb'"triggered_at": [0-9]+', data)  # a whole second
    edited = bytearray(data)
    edited[match.end() - 1] = ord("0") + (edited[match.end() - 1] - ord("0") + 1) % 10
    return bytes(edited)


@pytest.mark.parametrize("edited", [False, True], ids=["flip-only", "flip-and-edit"])
@pytest.mark.parametrize("kind", ["metadata", "manifest"])
def test_every_bit_flip_in_the_checksum_name_is_refused_or_loads_the_original(
    written: dict[str, tuple[str, bytes]], kind: str, edited: bool
) -> None:
    where, data = written[kind]
    original = load(kind, data, where)
    with pytest.raises(CheckpointCorruptedError, match="checksum"):  # the edit alone
        load(kind, edit(data, kind), where)
    outcomes = []
    for flipped in flips_of_the_checksum_name(data):
        damaged = edit(flipped, kind) if edited else flipped
        try:
            got = load(kind, damaged, where)
        except (CheckpointCorruptedError, IncompatibleStateError) as exc:
            message = str(exc)
            assert where in message and "\n" not in message, message
            outcomes.append("refused")
            continue
        assert got == original, damaged.decode("utf-8", "replace")[:200]
        outcomes.append("loaded")
    assert len(outcomes) == 64


@pytest.mark.parametrize("kind", ["metadata", "manifest"])
def test_a_renamed_checksum_field_is_named_in_the_error(
    written: dict[str, tuple[str, bytes]], kind: str
) -> None:
    where, data = written[kind]
    damaged = data.replace(b'"checksum":', b'"checksuo":', 1)
    with pytest.raises(CheckpointCorruptedError, match=f"{re.escape(where)} .*'checksuo'"):
        load(kind, damaged, where)


@pytest.mark.parametrize("kind", ["metadata", "manifest"])
def test_an_older_release_document_without_a_checksum_still_loads(
    written: dict[str, tuple[str, bytes]], kind: str
) -> None:
    where, data = written[kind]
    document = json.loads(data)
    del document["checksum"]
    # What an older release wrote: the same encoding, without the field.
    encode = metadata_module._canonical if kind == "metadata" else manifest_module._compact
    older = encode(document)
    assert load(kind, older, where) == load(kind, data, where)
    # Unchecked, as before: an older release wrote nothing to check it against.
    assert load(kind, edit(older, kind), where) != load(kind, data, where)
