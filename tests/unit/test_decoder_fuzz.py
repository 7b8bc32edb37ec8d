"""Every decoder of what statebackend reads back from storage, fuzzed: valid bytes built
with the real encoders, then damaged (bit flips, truncation, inserted and deleted bytes,
length fields set to huge values, JSON values of the wrong type, missing keys, deep
nesting). Each read must give back exactly what was written or raise the error class
its module documents for damage (CheckpointCorruptedError, or SerializationError for a
value's bytes), with a one-line message naming the file; never another exception type,
never an allocation sized by a damaged length field."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import json
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statebackend.backends.changelog import ChangeSet, MapKeyChanges, StateChanges
from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import StateMetaInfo
from statebackend.backends.keyed_states import decode_list, encode_list
from statebackend.backends.operator import OperatorStateBackend
from statebackend.backends.stores import CurrentKey
from statebackend.backends.timers import TimerClocks, TimerSnapshotInfo
from statebackend.checkpoint import manifest as manifest_module
from statebackend.checkpoint import metadata as metadata_module
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.filesystem import open_filesystem
from statebackend.checkpoint.manifest import BatchManifest, BatchRecords
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.metrics import (
    BatchMetrics,
    CheckpointMetrics,
    FailureMetrics,
    MetricsHistory,
    RestoreMetrics,
    SubtaskState,
    list_segments,
    read_history,
    record_from_json,
    record_to_json,
)
from statebackend.checkpoint.signing import document_bytes
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import (
    MALFORMED_DOCUMENT,
    CheckpointCorruptedError,
    ConfigurationError,
    IncompatibleStateError,
    SerializationError,
)
from statebackend.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
)
from statebackend.serializers import (
    BoolSerializer,
    BytesSerializer,
    FloatSerializer,
    IntSerializer,
    JsonSerializer,
    RowTupleSerializer,
    StrSerializer,
    TupleSerializer,
    reading_serializer,
)
from statebackend.snapshot.changelog_format import (
    ChangelogHandle,
    encode_changes,
    encode_operator_state,
    read_changes,
    read_operator_state,
)
from statebackend.snapshot.frames import CODECS, FRAME_HEADER, decode_frames, encode_frame
from statebackend.snapshot.keyed_format import (
    FullKeyedStateHandle,
    encode_keyed_cut,
    read_composite_runs,
    read_keyed_entries,
)
from statebackend.snapshot.operator_format import (
    OperatorStateHandle,
    OperatorStateReader,
    encode_operator_cut,
)
from statebackend.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateKind,
    ValueStateDescriptor,
)
from statebackend.state.timers import is_timer_state
from statebackend.state.ttl import TtlSerializer, TtlValue
from statebackend.tools.listing import describe_roles

FUZZ = settings(
    max_examples=600,
    deadline=None,
    derandomize=True,  # the same examples in every CI run: a red run is a regression
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MEMORY_LIMIT = 64 << 20
"""Peak bytes a decoder may allocate for a small input whatever its length fields say."""
HUGE_LENGTHS = (0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 0x10000000)


# -- damage ------------------------------------------------------------------------------


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with one to three kinds of damage done to it."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "length"]))
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind == "flip" and out:
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del out[at:]
        elif kind == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del out[at : at + draw(st.integers(1, 8))]
        elif kind == "length" and len(out) >= 4:
            at = min(at, len(out) - 4)
            struct.pack_into(">I", out, at, draw(st.sampled_from(HUGE_LENGTHS)))
    return bytes(out)


def check_error(error: BaseException, where: str) -> None:
    """The damage error is one line and names the file it was found in."""
    message = str(error)
    assert "\n" not in message, message
    assert where in message, message


def read_back(
    read: Callable[[], Any], expected: Any, where: str, errors: tuple[type[Exception], ...]
) -> None:
    """``read()`` gives ``expected`` or raises one of ``errors`` naming ``where``."""
    try:
        got = read()
    except errors as exc:
        check_error(exc, where)
        return
    assert got == expected


def peak_allocation(call: Callable[[], Any]) -> int:
    """The peak bytes Python allocated while ``call`` ran (its exception ignored)."""
    tracemalloc.start()
    try:
        call()
    except Exception:  # noqa: S110 - only the allocation is measured here
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# -- frames ------------------------------------------------------------------------------

_PAYLOADS = st.lists(
    st.one_of(st.binary(max_size=200), st.builds(lambda n: b"ab" * n, st.integers(0, 3000))),
    min_size=1,
    max_size=3,
)


@FUZZ
@given(_PAYLOADS, st.integers(0, 2), st.data())
def test_damaged_frames_read_back_or_are_corruption(
    payloads: list[bytes], codec: int, data: st.DataObject
) -> None:
    frames = [encode_frame(p, codec) for p in payloads]
    broken = data.draw(damaged(b"".join(frames)))
    try:
        got = list(decode_frames(broken, "chk-1/f"))
    except CheckpointCorruptedError as exc:
        check_error(exc, "chk-1/f")
        return
    # Frames cut off after a whole frame are whole frames: the readers check the length
    # of what they read against the file's index, not decode_frames.
    assert got == payloads[: len(got)]
    assert broken == b"".join(frames[: len(got)])


@pytest.mark.parametrize("codec", [0, 1, 2])
def test_every_truncation_of_frames_is_corruption(codec: int) -> None:
    payloads = [b"abc" * 300, bytes(range(256))]
    encoded = b"".join(encode_frame(p, codec) for p in payloads)
    ends = {len(encode_frame(payloads[0], codec))}
    for cut in set(range(1, len(encoded))) - ends:
        with pytest.raises(CheckpointCorruptedError, match="chk-1/f"):
            list(decode_frames(encoded[:cut], "chk-1/f"))


def _zstd_frame_without_content_size(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(write_content_size=False).compress(data)


@pytest.mark.parametrize("raw_length", HUGE_LENGTHS)
@pytest.mark.parametrize(
    "codec, payload",
    [
        (1, encode_frame(b"hello world " * 100, 1)[FRAME_HEADER.size :]),
        (1, b"\x00" * 64),  # a stored frame whose codec byte says lz4
        (2, encode_frame(b"hello world " * 100, 2)[FRAME_HEADER.size :]),
        (2, _zstd_frame_without_content_size(b"hello world " * 100)),
    ],
    ids=["lz4", "none-as-lz4", "zstd", "zstd-without-size"],
)
def test_a_huge_raw_length_allocates_nothing_of_its_size(
    codec: int, payload: bytes, raw_length: int
) -> None:
    frame = FRAME_HEADER.pack(codec, raw_length, len(payload), zlib.crc32(payload)) + payload
    with pytest.raises(CheckpointCorruptedError, match="chk-1/f"):
        list(decode_frames(frame, "chk-1/f"))
    assert peak_allocation(lambda: list(decode_frames(frame, "chk-1/f"))) < MEMORY_LIMIT


# -- the full keyed format ---------------------------------------------------------------


def _keyed_file(codec: int) -> tuple[bytes, FullKeyedStateHandle, list[Any], list[Any]]:
    """A real backend's cut of value, map and list state over a few key groups, encoded:
    the file, its handle, and what ``read_keyed_entries`` and ``read_composite_runs``
    read of it."""
    backend = HeapKeyedStateBackend(
        max_parallelism=8, key_group_range=KeyGroupRange(0, 7), key_serializer=StrSerializer()
    )
    count = backend.get_state(ValueStateDescriptor("count", IntSerializer()))
    tags = backend.get_state(MapStateDescriptor("tags", StrSerializer(), StrSerializer()))
    seen = backend.get_state(ListStateDescriptor("seen", IntSerializer()))
    for n in range(12):
        backend.set_current_key(f"user-{n}")
        count.update(n * 1000)
        tags.put(f"t{n}", "x" * n)
        seen.add(n)
        seen.add(-n)
    cut = backend.sync_cut()
    index: list[tuple[int, int, int]] = []
    data = b"".join(encode_keyed_cut(cut, codec, index))
    handle = FullKeyedStateHandle(
        path="f",
        size=len(data),
        checksum="",
        key_group_range=cut.key_group_range,
        key_groups=tuple(index),
        compression="none",
        states=tuple(cut.states),
        key_serializer=cut.key_serializer,
    )
    cut.release()
    backend.dispose()

    def read_range(path: str, start: int, length: int) -> bytes:
        return data[start : start + length]

    everything = KeyGroupRange(0, 7)
    entries = list(read_keyed_entries(read_range, "f", handle, everything))
    runs = list(read_composite_runs(read_range, "f", handle, everything))
    assert len(entries) == 36
    return data, handle, entries, runs


_KEYED = {codec: _keyed_file(codec) for codec in (0, 1)}


@FUZZ
@given(st.sampled_from([0, 1]), st.data())
def test_damaged_keyed_files_read_back_or_are_corruption(codec: int, data: st.DataObject) -> None:
    file, handle, entries, runs = _KEYED[codec]
    broken = data.draw(damaged(file))

    def read_range(path: str, start: int, length: int) -> bytes:
        return broken[start : start + length]

    everything = KeyGroupRange(0, 7)
    errors = (CheckpointCorruptedError,)
    read_back(
        lambda: list(read_keyed_entries(read_range, "f", handle, everything)), entries, "f", errors
    )
    read_back(
        lambda: list(read_composite_runs(read_range, "f", handle, everything)), runs, "f", errors
    )


def _damaged_group(file: bytes, key_groups: Any, data: st.DataObject) -> tuple[int, int, bytes]:
    """A key group of ``file`` drawn from its ``key_groups`` (group, offset, length): the
    group, its offset, and its entries damaged in one uncompressed frame whose crc32
    matches (what a decoder behind the checksum sees)."""
    group, offset, length = data.draw(st.sampled_from(key_groups))
    payload = b"".join(decode_frames(file[offset : offset + length], "damaged"))
    return group, offset, encode_frame(data.draw(damaged(payload)), 0)


@FUZZ
@given(st.sampled_from([0, 1]), st.data())
def test_damaged_entries_in_whole_frames_decode_or_are_corruption(
    codec: int, data: st.DataObject
) -> None:
    file, handle, _, _ = _KEYED[codec]
    group, offset, frame = _damaged_group(file, handle.key_groups, data)
    broken = file[:offset] + frame
    one = FullKeyedStateHandle(
        **{
            **handle.__dict__,
            "key_groups": ((group, offset, len(frame)),),
            "size": len(broken),
        }
    )
    read_range = _ranges(broken)
    for reader in (read_keyed_entries, read_composite_runs):
        try:
            list(reader(read_range, "f", one, KeyGroupRange(group, group)))  # type: ignore[operator]
        except CheckpointCorruptedError as exc:
            check_error(exc, "f")


# -- the operator-state format -----------------------------------------------------------


def _operator_blob() -> tuple[OperatorStateHandle, dict[str, list[Any]], list[bytes]]:
    backend = OperatorStateBackend()
    backend.get_list_state("offsets", IntSerializer()).update([1, 2, 3])
    backend.get_union_list_state("seen", StrSerializer()).update(["a", "bc"])
    broadcast = backend.get_broadcast_state("rules", StrSerializer(), IntSerializer())
    broadcast.put("r1", 10)
    broadcast.put("", 0)
    backend.set_raw_state([b"raw-0", b""])
    cut = backend.sync_cut()
    blob, states, raw = encode_operator_cut(cut)
    handle = OperatorStateHandle(None, len(blob), "crc32:0", states, raw, blob)
    expected = {name: list(state.entries) for name, state in cut.states.items()}
    return handle, expected, list(cut.raw)


_OPERATOR = _operator_blob()


def _operator_read(handle: OperatorStateHandle) -> tuple[dict[str, list[Any]], list[bytes]]:
    reader = OperatorStateReader([handle], "chk-1", lambda path, start, length: b"")
    cut = reader.restore_cut(0, 1)
    return {name: list(state.entries) for name, state in cut.states.items()}, list(cut.raw)


@FUZZ
@given(st.data())
def test_damaged_operator_state_reads_back_or_is_corruption(data: st.DataObject) -> None:
    handle, expected, raw = _OPERATOR
    assert handle.inline is not None
    broken = OperatorStateHandle(
        None,
        handle.size,
        handle.checksum,
        handle.states,
        handle.raw,
        data.draw(damaged(handle.inline)),
    )
    read_back(
        lambda: _operator_read(broken),
        (expected, raw),
        "inline operator state of subtask 0",
        (CheckpointCorruptedError,),
    )


def _with_crcs(handle: OperatorStateHandle, blob: bytes) -> OperatorStateHandle:
    """``handle`` over ``blob``, every element's span and crc32 made to match it."""
    states = {}
    for name, info in handle.states.items():
        spans = tuple(
            (offset, length, zlib.crc32(blob[offset : offset + length]))
            for offset, length, _ in info.elements
        )
        states[name] = type(info)(info.mode, info.serializers, spans)
    return OperatorStateHandle(None, len(blob), handle.checksum, states, handle.raw, blob)


@FUZZ
@given(st.data())
def test_damaged_operator_elements_with_matching_crcs_decode_or_are_corruption(
    data: st.DataObject,
) -> None:
    """A broadcast element whose crc32 matches but whose key length runs past it."""
    handle, _, _ = _OPERATOR
    assert handle.inline is not None
    (offset, length, _), *_ = handle.states["rules"].elements
    element = handle.inline[offset : offset + length]
    broken = data.draw(damaged(element))
    blob = handle.inline[:offset] + broken + handle.inline[offset + length :]
    spans = tuple(
        (o + (len(broken) - length if o > offset else 0), len(broken) if o == offset else n, 0)
        for o, n, _ in handle.states["rules"].elements
    )
    info = handle.states["rules"]
    moved = OperatorStateHandle(
        None,
        len(blob),
        handle.checksum,
        {"rules": type(info)(info.mode, info.serializers, spans)},
        (),
        blob,
    )
    try:
        entries, _ = _operator_read(_with_crcs(moved, blob))
    except CheckpointCorruptedError as exc:
        check_error(exc, "operator state")
        return
    (key, value), *_ = entries["rules"]  # the entry is what the element's bytes hold
    assert struct.pack(">I", len(key)) + key + value == broken


# -- JSON documents ----------------------------------------------------------------------

_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.just([]),
    st.just({}),
    st.just([[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]),
    st.just(["a", 1, None]),
)


def _paths(document: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every value in a JSON document, the document's own first."""
    yield path
    if isinstance(document, dict):
        for key, value in document.items():
            yield from _paths(value, (*path, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            yield from _paths(value, (*path, index))


@st.composite
def damaged_json(draw: st.DrawFn, document: Any, keep: frozenset[str] = frozenset()) -> Any:
    """A deep copy of ``document`` with one to three values replaced by a value of
    another type or removed (a key of a dict or an item of a list); the top-level keys in
    ``keep`` are left alone."""
    document = json.loads(json.dumps(document))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(document) if p and p[0] not in keep]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        if draw(st.booleans()):
            parent[path[-1]] = json.loads(json.dumps(draw(_JSON_VALUES)))
        else:
            del parent[path[-1]]
    return document


# -- the metrics history -----------------------------------------------------------------


def _metrics_records() -> list[Any]:
    return [
        BatchMetrics(3, 100, 90, 12, source_seconds=0.5, changelog_bytes=4096, at=1.5),
        CheckpointMetrics(
            7, 3, 1000, 20, 30, 0.1, 0.2, 0.5, (SubtaskState("op", 0, 1000, 12),), at=2.5
        ),
        CheckpointMetrics(8, None, 0, 0, 0, 0.0, 0.0, 0.0, (), at=3),
        RestoreMetrics("file:///c/job/chk-7", 1050, 1.25, 2, at=4.5),
        FailureMetrics(None, "boom", "retry", at=5.5),
    ]


def _use(record: Any) -> None:
    """What the report and the log do with a record."""
    record.describe()
    if isinstance(record, CheckpointMetrics):
        assert isinstance(record.uploaded_bytes, int)
        sum(s.state_bytes for s in record.subtasks)
    json.dumps(record_to_json(record))


@FUZZ
@given(st.sampled_from(_metrics_records()), st.data())
def test_damaged_metrics_lines_read_back_or_are_skipped(record: Any, data: st.DataObject) -> None:
    document = data.draw(damaged_json(record_to_json(record), keep=frozenset({"kind"})))
    try:
        read = record_from_json(document)
    except MALFORMED_DOCUMENT:
        return  # read_history skips the line with a warning
    assert read is not None
    as_read = record_to_json(read)  # the document's values, defaults for those it lacks
    given_values = {name: value for name, value in document.items() if name != "subtasks"}
    assert json.dumps({**as_read, **given_values}, sort_keys=True) == json.dumps(
        as_read, sort_keys=True
    )
    _use(read)


def test_a_metrics_history_with_damaged_lines_reads_the_others(tmp_path: Path) -> None:
    fs = open_filesystem(tmp_path.as_uri())
    job_dir = (tmp_path / "job").as_uri()
    history = MetricsHistory(fs, job_dir, "run")
    for record in _metrics_records():
        history.record(record)
    ((_, segment),) = list_segments(fs, f"{job_dir}/metrics")
    lines = fs.read_file(segment).splitlines()
    damaged_lines = [
        lines[0].replace(b'"records_in":100', b'"records_in":"100"'),
        lines[1].replace(b'"full_bytes":1000', b'"full_bytes":null'),
        lines[2].replace(b'"batch_id":null', b'"batch_id":1.5'),
        lines[3].replace(b'"seconds":1.25', b'"seconds":"1.25"'),
        b"[1, 2]",
        b"\xff\xfe",
        b"{" * 100_000,
        lines[4],
    ]
    assert damaged_lines[:4] != lines[:4]
    fs.write_file(segment, [b"\n".join(damaged_lines)])
    (entry,) = read_history(fs, job_dir)
    assert entry.record == _metrics_records()[4]


# -- _metadata ---------------------------------------------------------------------------


def _write_checkpoint(root: Path) -> tuple[CheckpointStorage, str]:
    """A real two-subtask checkpoint of keyed state (full format, lz4) and operator state
    (inline for subtask 0, in a file for subtask 1) under ``root``."""
    storage = CheckpointStorage(root.as_uri(), "job", compression="lz4")
    coordinator = CheckpointCoordinator(storage, max_parallelism=8)
    n = coordinator.trigger({"op": 2})
    checkpoint = ""
    for subtask in range(2):
        backend = HeapKeyedStateBackend(
            max_parallelism=8,
            key_group_range=compute_key_group_range_for_operator_index(8, 2, subtask),
            key_serializer=IntSerializer(),
        )
        count = backend.get_state(ValueStateDescriptor("count", IntSerializer()))
        for key in range(40):
            if assign_to_key_group(IntSerializer().serialize(key), 8) in backend.key_group_range:
                backend.set_current_key(key)
                count.update(key)
        backend.timer_service.register_event_time_timer(1000 + subtask)
        operator = OperatorStateBackend()
        operator.get_list_state("offsets", StrSerializer()).update(["x" * 30_000] * subtask)
        operator.get_broadcast_state("rules", StrSerializer(), IntSerializer()).put("r", 1)
        target = storage.snapshot_target(n, "op", subtask)
        keyed = backend.snapshot(n, target).result()
        operator_state = target.write_operator_snapshot(n, operator.sync_cut()).result()
        ack = SubtaskAck("op", subtask, 2, keyed, operator_state, coordinator.run_id)
        checkpoint = coordinator.acknowledge(n, ack) or checkpoint
        backend.dispose()
    return storage, checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Any]]:
    storage, path = _write_checkpoint(tmp_path_factory.mktemp("fuzz"))
    document = json.loads(storage.fs.read_file(f"{path}/_metadata"))
    yield storage, path, document
    storage.close()


_METADATA = "file:///c/job/chk-1/_metadata"


def _metadata_bytes(document: Any) -> bytes:
    """``document`` as a ``_metadata`` file whose checksum matches it (one that anyone
    who edits the file can compute)."""
    document = dict(document) if isinstance(document, dict) else document
    if isinstance(document, dict):
        document.pop("checksum", None)
        return document_bytes(document, metadata_module._canonical, None)
    return json.dumps(document).encode()


@settings(FUZZ, max_examples=1000)
@given(st.data())
def test_damaged_metadata_loads_as_written_or_is_corruption(
    checkpoint: tuple[Any, str, Any], data: st.DataObject
) -> None:
    _, _, document = checkpoint
    broken = data.draw(damaged_json(document, keep=frozenset({"checksum"})))
    try:
        metadata = CheckpointMetadata.from_bytes(_metadata_bytes(broken), _METADATA)
    except (CheckpointCorruptedError, IncompatibleStateError) as exc:
        check_error(exc, _METADATA)
        return
    # What loaded is what the document says: it writes back to the same document.
    again = CheckpointMetadata.from_bytes(metadata.to_bytes(), _METADATA)
    assert again == metadata
    metadata.files()
    metadata.state_bytes()
    _use_serializers(metadata)


def _use_serializers(metadata: CheckpointMetadata) -> None:
    """What ``inspect`` and ``read`` do with the loaded serializer configs: describe them
    and build the serializers of each state's roles (a config of an unknown serializer
    is an error of ours, naming it)."""
    configs = []
    for op in metadata.operators.values():
        for ack in op.subtasks:
            if ack.keyed is not None:
                configs.append({"key": ack.keyed.key_serializer})
                configs += [
                    meta.serializers for meta in ack.keyed.states if not is_timer_state(meta.name)
                ]
            if ack.operator_state is not None:
                configs += [info.serializers for info in ack.operator_state.states.values()]
    for serializers in configs:
        describe_roles(serializers)
        for config in serializers.values():
            with contextlib.suppress(IncompatibleStateError, ConfigurationError):
                reading_serializer(config, allow_pickle=False)


@FUZZ
@given(st.data())
def test_damaged_metadata_bytes_are_corruption(
    checkpoint: tuple[Any, str, Any], data: st.DataObject
) -> None:
    storage, path, _ = checkpoint
    raw = storage.fs.read_file(f"{path}/_metadata")
    broken = data.draw(damaged(raw))
    read_back(
        lambda: CheckpointMetadata.from_bytes(broken, _METADATA),
        CheckpointMetadata.from_bytes(raw, _METADATA),
        _METADATA,
        (CheckpointCorruptedError, IncompatibleStateError),
    )


# -- batch manifests ---------------------------------------------------------------------


def _manifest() -> BatchManifest:
    """Manifest 2 of a job whose operator ran batches 1 and 2 at parallelism 2, a state
    added in batch 2 (so its handles have two kinds of meta info)."""
    batches = []
    for batch in (1, 2):
        states = [StateMetaInfo("count", StateKind.VALUE, {"value": IntSerializer().config()})]
        if batch == 2:
            tags = {"user_key": StrSerializer().config(), "value": IntSerializer().config()}
            states.append(StateMetaInfo("tags", StateKind.MAP, tags))
        handles = []
        for subtask in range(2):
            key_groups = compute_key_group_range_for_operator_index(8, 2, subtask)
            changes = {
                "count": StateChanges(
                    {CurrentKey.of(key_groups.start, b"k").prefix: b"v" * batch}, {}
                )
            }
            change_set = ChangeSet(
                {}, 8, key_groups, states, changes, TimerSnapshotInfo.empty(TimerClocks())
            )
            data, index = encode_changes(change_set, 0)
            handles.append(
                ChangelogHandle(
                    path=f"../changelog/{batch}/op-{subtask}",
                    size=len(data),
                    checksum=f"crc32:{zlib.crc32(data):08x}",
                    key_group_range=key_groups,
                    key_groups=tuple(index),
                    compression="none",
                    batch_id=batch,
                    operator_id="op",
                    subtask=subtask,
                    attempt="a",
                    changes=1,
                    states=tuple(states),
                    key_serializer=IntSerializer().config(),
                )
            )
        batches.append(BatchRecords(batch, 2, tuple(handles)))
    return BatchManifest("job", 2, 8, None, {"op": tuple(batches)}, {}, 12.5)


_MANIFEST = _manifest()
_MANIFEST_FILE = "file:///c/job/manifests/2"


@settings(FUZZ, max_examples=1000)
@given(st.data())
def test_damaged_manifests_load_as_written_or_are_corruption(data: st.DataObject) -> None:
    document = json.loads(_MANIFEST.to_bytes())
    document.pop("checksum")
    broken = data.draw(damaged_json(document, keep=frozenset({"kind"})))
    try:
        manifest = BatchManifest.from_bytes(
            document_bytes(broken, manifest_module._compact, None), _MANIFEST_FILE
        )
    except (CheckpointCorruptedError, IncompatibleStateError) as exc:
        check_error(exc, _MANIFEST_FILE)
        return
    assert BatchManifest.from_bytes(manifest.to_bytes(), _MANIFEST_FILE) == manifest
    # Each record has the meta info its "meta" index names in the document's table.
    metas = broken["state_meta"]
    for operator_id, operator in broken["operators"].items():
        batches = zip(operator["batches"], manifest.operators[operator_id], strict=True)
        for batch, records in batches:
            for written, handle in zip(batch["subtasks"], records.subtasks, strict=True):
                assert 0 <= written["meta"] < len(metas)
                meta = metas[written["meta"]]
                assert handle.states == tuple(StateMetaInfo.from_json(m) for m in meta["states"])


@pytest.mark.parametrize("meta", [-1, -2, 2, 1.0, "1", None])
def test_a_manifest_record_naming_no_meta_info_entry_is_corruption(meta: Any) -> None:
    """A record's ``meta`` index outside the table (a negative one indexes from its end:
    another state list) is damage, not another entry."""
    document = json.loads(_MANIFEST.to_bytes())
    document.pop("checksum")
    document["operators"]["op"]["batches"][1]["subtasks"][0]["meta"] = meta
    data = document_bytes(document, manifest_module._compact, None)
    with pytest.raises(CheckpointCorruptedError, match=f"{_MANIFEST_FILE}: malformed"):
        BatchManifest.from_bytes(data, _MANIFEST_FILE)


# -- values: serializers and list state ------------------------------------------------

_ROW_SCHEMA = json.dumps(
    {
        "type": "struct",
        "fields": [
            {"name": name, "type": kind, "nullable": True, "metadata": {}}
            for name, kind in [
                ("i", "integer"),
                ("s", "string"),
                ("d", "double"),
                ("b", "binary"),
                ("day", "date"),
                ("t", "timestamp"),
                ("n", "timestamp_ntz"),
                ("m", "decimal(10,2)"),
                ("a", {"type": "array", "elementType": "long", "containsNull": True}),
                (
                    "kv",
                    {
                        "type": "map",
                        "keyType": "string",
                        "valueType": "boolean",
                        "valueContainsNull": True,
                    },
                ),
                (
                    "st",
                    {
                        "type": "struct",
                        "fields": [{"name": "x", "type": "short", "nullable": False}],
                    },
                ),
            ]
        ],
    }
)
_SERIALIZERS = [
    (IntSerializer(), 7),
    (FloatSerializer(), 2.5),
    (BoolSerializer(), True),
    (StrSerializer(), "héllo"),
    (BytesSerializer(), b"\x00\xff"),
    (JsonSerializer(), {"a": [1, 2.5, None, "x"]}),
    (TupleSerializer(StrSerializer(), IntSerializer()), ("k", 3)),
    (TtlSerializer(StrSerializer()), TtlValue("v", 1_000)),
    (
        RowTupleSerializer(_ROW_SCHEMA),
        (
            1,
            "s",
            1.5,
            b"b",
            datetime.date(2024, 1, 2),
            datetime.datetime(2024, 1, 2, 3, 4, 5),
            datetime.datetime(2024, 1, 2, 3, 4, 5),
            decimal.Decimal("12.34"),
            [1, None, 3],
            {"k": True, "n": None},
            (5,),
        ),
    ),
    (RowTupleSerializer(json.dumps({"type": "struct", "fields": []})), ()),
    (
        RowTupleSerializer(
            json.dumps(
                {"type": "struct", "fields": [{"name": "k", "type": "string", "nullable": True}]}
            )
        ),
        ("key",),
    ),
]


@FUZZ
@given(st.sampled_from(_SERIALIZERS), st.data())
def test_damaged_values_decode_or_are_serialization_errors(
    case: tuple[Any, Any], data: st.DataObject
) -> None:
    """Value bytes have no checksum of their own (their frame has): damage decodes to
    some value or is the serializers' SerializationError, never another exception."""
    serializer, value = case
    encoded = serializer.serialize(value)
    assert serializer.deserialize(encoded) == value
    broken = data.draw(st.one_of(damaged(encoded), st.binary(max_size=64)))
    with contextlib.suppress(SerializationError):
        serializer.deserialize(broken)
    assert peak_allocation(lambda: serializer.deserialize(broken)) < MEMORY_LIMIT


@FUZZ
@given(st.lists(st.binary(max_size=20), max_size=5), st.data())
def test_damaged_list_values_decode_exactly_or_are_serialization_errors(
    elements: list[bytes], data: st.DataObject
) -> None:
    encoded = encode_list(elements)
    assert decode_list(encoded) == elements
    broken = data.draw(damaged(encoded))
    try:
        decoded = decode_list(broken)
    except SerializationError as exc:
        check_error(exc, "list state")
        return
    assert encode_list(decoded) == broken  # every byte is in an element, none made up


# -- changelog records -------------------------------------------------------------------


def _changelog_record(codec: int) -> tuple[bytes, ChangelogHandle, list[Any], Any]:
    """A record of value and map changes (puts, deletes, a cleared map key) over a few key
    groups with the subtask's operator state after them: the file, its handle, what
    ``read_changes`` reads and the operator state ``read_operator_state`` gives."""
    value_state = StateMetaInfo("count", StateKind.VALUE, {"value": IntSerializer().config()})
    map_state = StateMetaInfo(
        "tags",
        StateKind.MAP,
        {"user_key": StrSerializer().config(), "value": IntSerializer().config()},
    )
    values: dict[bytes, bytes | None] = {
        CurrentKey.of(group, f"k{group}".encode()).prefix: (None if group == 3 else b"v" * group)
        for group in range(6)
    }
    maps = {
        CurrentKey.of(1, b"m").prefix: MapKeyChanges(True, {b"a": b"1", b"b": None}),
        CurrentKey.of(4, b"m").prefix: MapKeyChanges(False, {b"c": b"22"}),
    }
    key_groups = KeyGroupRange(0, 7)
    change_set = ChangeSet(
        {},
        8,
        key_groups,
        [value_state, map_state],
        {"count": StateChanges(values, {}), "tags": StateChanges({}, maps)},
        TimerSnapshotInfo.empty(TimerClocks()),
    )
    data, index = encode_changes(change_set, codec)
    operator = OperatorStateBackend()
    operator.get_list_state("offsets", IntSerializer()).update([1, 2])
    operator.get_broadcast_state("rules", StrSerializer(), IntSerializer()).put("r", 1)
    frame, info = encode_operator_state(operator.sync_cut(), len(data), codec)
    data += frame
    handle = ChangelogHandle(
        path="../changelog/1/op-0",
        size=len(data),
        checksum="crc32:0",
        key_group_range=key_groups,
        key_groups=tuple(index),
        compression=CODECS[codec],
        batch_id=1,
        operator_id="op",
        subtask=0,
        attempt="a",
        changes=len(values) + 3,
        states=(value_state, map_state),
        key_serializer=StrSerializer().config(),
        operator_state=info,
    )
    read_range = _ranges(data)
    changes = list(read_changes(read_range, "r", handle, key_groups))
    assert len(changes) == 10
    operator_state = read_operator_state(read_range, "r", handle)
    return data, handle, changes, operator_state


def _ranges(data: bytes) -> Callable[[str, int, int], bytes]:
    def read_range(path: str, start: int, length: int) -> bytes:
        return data[start : start + length]

    return read_range


_RECORDS = {codec: _changelog_record(codec) for codec in (0, 1, 2)}


@FUZZ
@given(st.sampled_from([0, 1, 2]), st.data())
def test_damaged_changelog_records_read_back_or_are_corruption(
    codec: int, data: st.DataObject
) -> None:
    file, handle, changes, operator_state = _RECORDS[codec]
    read_range = _ranges(data.draw(damaged(file)))
    errors = (CheckpointCorruptedError,)
    everything = KeyGroupRange(0, 7)
    read_back(lambda: list(read_changes(read_range, "r", handle, everything)), changes, "r", errors)
    read_back(lambda: read_operator_state(read_range, "r", handle), operator_state, "r", errors)


@FUZZ
@given(st.sampled_from([0, 1, 2]), st.data())
def test_damaged_changes_in_whole_frames_decode_or_are_corruption(
    codec: int, data: st.DataObject
) -> None:
    file, handle, _, _ = _RECORDS[codec]
    group, offset, frame = _damaged_group(file, handle.key_groups, data)
    one = replace(handle, key_groups=((group, offset, len(frame)),), operator_state=None)
    read_range = _ranges(file[:offset] + frame)
    try:
        read = list(read_changes(read_range, "r", one, KeyGroupRange(group, group)))
    except CheckpointCorruptedError as exc:
        check_error(exc, "r")
        return
    names = [meta.name for meta in handle.states]
    again = b"".join(  # the changes read are exactly the payload's bytes
        struct.pack(">BHI", change.op, names.index(name), len(change.key))
        + change.key
        + struct.pack(">I", len(change.user_key))
        + change.user_key
        + struct.pack(">I", len(change.value))
        + change.value
        for name, _, change in read
    )
    assert again == frame[FRAME_HEADER.size :]


@FUZZ
@given(st.sampled_from([0, 1, 2]), st.data())
def test_damaged_operator_state_of_a_record_is_corruption(codec: int, data: st.DataObject) -> None:
    """The record's operator-state frame's payload (its JSON header and blob) damaged and
    framed again."""
    file, handle, _, _ = _RECORDS[codec]
    info = handle.operator_state
    assert info is not None
    payload = b"".join(decode_frames(file[info.offset :], "r"))
    frame = encode_frame(data.draw(damaged(payload)), 0)
    broken = replace(handle, operator_state=replace(info, length=len(frame)))
    try:
        stored = read_operator_state(_ranges(file[: info.offset] + frame), "r", broken)
        assert stored is not None
        _operator_read(stored)
    except CheckpointCorruptedError as exc:
        check_error(exc, "r")
