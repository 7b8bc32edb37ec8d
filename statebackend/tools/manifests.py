"""``inspect``, ``verify``, ``plan``, ``read`` and ``savepoint create`` on a batch manifest.

A manifest's state is its base checkpoint plus the changelog records of the batches
after it (``checkpoint/changelog_restore.py``). ``inspect`` shows both, ``verify``
checks the base as a checkpoint and every record by size and checksum, and ``plan``
adds to a checkpoint's plan the records each new subtask replays. ``fold_manifest``
writes the state at the manifest's batch as a self-contained full savepoint: each
subtask is rebuilt from base + records in a temporary heap backend and snapshotted in
the full format, so the savepoint restores at any parallelism without the changelog;
``read`` reads such a fold written to a temporary local directory, with the checkpoint
reader.

The changelog carries keyed state (timers included) and, in the records of a keyed
function that keeps operator state, that operator state (else the base's is current).
The operator state of an operator without keyed state is held by the driver (the source
offsets), which commits it in the manifest's properties: the fold leaves the base's
(older) copy out and the savepoint carries the properties. A base with raw keyed state
cannot be folded, since that state is the base's, not the batch's. Replaying never
unpickles, except to migrate pickled values to a serializer that changed between records,
which needs ``allow_pickle``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import StateMetaInfo
from statebackend.checkpoint.changelog_restore import rebuild_keyed_state, rebuild_operator_state
from statebackend.checkpoint.filesystem import FAIL_FAST_RETRY
from statebackend.checkpoint.manifest import (
    FOLDED_FROM_PROPERTY,
    SOURCE_OFFSETS_STATE,
    SOURCE_OPERATOR,
    source_offsets,
)
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import plan_restore
from statebackend.checkpoint.savepoints import Progress
from statebackend.checkpoint.signing import verified_reads
from statebackend.checkpoint.writer import SavepointWriter, Written
from statebackend.errors import CheckpointError, ConfigurationError
from statebackend.keygroups import (
    KeyGroupRange,
    check_parallelism,
    compute_key_group_range_for_operator_index,
)
from statebackend.redistribution import StatePlan, plan_operator_state
from statebackend.serializers import SerializerConfig, serializer_from_config
from statebackend.serializers.opaque import holds_pickle
from statebackend.snapshot.changelog_format import ChangelogHandle, read_operator_state
from statebackend.snapshot.frames import DEFAULT_CODEC
from statebackend.snapshot.target import SnapshotDirectory
from statebackend.state.timers import is_timer_state
from statebackend.tools.listing import describe_roles, describe_serializer
from statebackend.tools.location import ManifestRef, checkpoint_directory
from statebackend.tools.plan import keyed_sources_json
from statebackend.tools.reader import Record
from statebackend.tools.report import KeyGroupBytes, key_group_bytes, split_key_groups
from statebackend.tools.verify import Problem, referenced_bytes, verify_checkpoint


def operator_ids(ref: ManifestRef) -> list[str]:
    """The operators with keyed state at the manifest's batch: those with records, and
    those with keyed state in the base."""
    ids = set(ref.manifest.operators)
    if ref.base is not None:
        ids |= {op for op, s in ref.base.metadata.operators.items() if s.keyed_handles()}
    return sorted(ids)


def _check_operator(ref: ManifestRef, operator_id: str) -> None:
    known = operator_ids(ref)
    if operator_id not in known:
        raise ConfigurationError(
            f"{ref.path} has no keyed state of operator {operator_id!r}; "
            f"it has {', '.join(known) or 'none'}"
        )


def parallelism_of(ref: ManifestRef, operator_id: str) -> int:
    """The operator's parallelism at the manifest's batch."""
    if operator_id in ref.manifest.operators:
        return ref.manifest.parallelism(operator_id)
    assert ref.base is not None
    return ref.base.metadata.operators[operator_id].parallelism


def records(ref: ManifestRef, operator_id: str) -> list[ChangelogHandle]:
    """The operator's accepted records, batch by batch, subtask by subtask."""
    return [h for batch in ref.manifest.operators.get(operator_id, ()) for h in batch.subtasks]


def state_metas(ref: ManifestRef, operator_id: str) -> tuple[list[StateMetaInfo], SerializerConfig]:
    """The operator's keyed states (timers' too) at the manifest's batch, and its key
    serializer: the newest record's, else the base's."""
    handles = records(ref, operator_id)
    if handles:
        return list(handles[-1].states), handles[-1].key_serializer
    assert ref.base is not None
    handle = ref.base.metadata.operators[operator_id].keyed_handles()[0]
    return list(handle.states), handle.key_serializer


def check_replay_without_pickle(ref: ManifestRef, operator_id: str, allow_pickle: bool) -> None:
    """ConfigurationError if rebuilding the operator would unpickle, unless
    ``allow_pickle``: a state whose serializers change between the base and the records
    is migrated by decoding its values with the serializers it had before, and one of
    those is (or holds) pickle."""
    if allow_pickle:
        return
    metas: list[StateMetaInfo] = []
    if ref.base is not None and operator_id in ref.base.metadata.operators:
        for keyed in ref.base.metadata.operators[operator_id].keyed_handles():
            metas += keyed.states
    for record in records(ref, operator_id):
        metas += record.states
    previous: dict[str, dict[str, Any]] = {}
    for meta in metas:
        before = previous.get(meta.name)
        if before is not None and before != meta.serializers and holds_pickle(before):
            raise ConfigurationError(
                f"rebuilding state {meta.name!r} of operator {operator_id!r} from {ref.path} "
                f"migrates pickled values (its serializer changed between batches), which "
                f"unpickles them: pass --allow-pickle only if nobody else can write the job's "
                f"storage"
            )
        previous[meta.name] = dict(meta.serializers)


def records_operator_state(ref: ManifestRef, operator_id: str) -> bool:
    """Whether the operator's records of the manifest's batch carry its operator state
    (then they, not the base, hold it at the batch)."""
    batches = ref.manifest.operators.get(operator_id, ())
    return bool(batches) and any(h.operator_state is not None for h in batches[-1].subtasks)


def check_foldable(ref: ManifestRef) -> None:
    """ConfigurationError if the base holds raw keyed state: the changelog does not carry
    it, so its state at the manifest's batch is unknown. (A keyed function's operator
    state is in its records, or else the base's is current; the operator state of an
    operator without keyed state is the driver's, committed in the manifest's
    properties.)"""
    if ref.base is None:
        return
    for operator_id, snapshot in sorted(ref.base.metadata.operators.items()):
        if snapshot.raw_keyed_handles():
            raise ConfigurationError(
                f"the base {ref.base.directory} of {ref.path} holds raw keyed state of "
                f"operator {operator_id!r}, which the changelog does not carry: take the "
                f"savepoint from a checkpoint (chk-<N>) or from the running job instead"
            )


def rebuild_subtask(
    ref: ManifestRef, operator_id: str, key_groups: KeyGroupRange, scratch_dir: Path | None = None
) -> HeapKeyedStateBackend:
    """A heap backend holding ``key_groups`` of the operator's state at the manifest's
    batch (base + records), an incremental base downloaded into ``scratch_dir`` (default:
    the system's temp directory). The caller disposes of it."""
    _, key_serializer = state_metas(ref, operator_id)
    backend = HeapKeyedStateBackend(
        scratch_dir=scratch_dir,
        max_parallelism=ref.manifest.max_parallelism,
        key_group_range=key_groups,
        key_serializer=serializer_from_config(key_serializer),
    )
    try:
        rebuild_keyed_state(backend, ref.changelog, ref.manifest, operator_id)
    except BaseException:
        backend.dispose()
        raise
    return backend


# -- inspect ----------------------------------------------------------------------------


def _record_json(handle: ChangelogHandle, ref: ManifestRef) -> dict[str, Any]:
    return {
        "subtask": handle.subtask,
        "attempt": handle.attempt,
        "key_group_range": handle.key_group_range.to_json(),
        "key_groups_with_changes": len(handle.key_groups),
        "changes": handle.changes,
        "bytes": handle.size,
        "path": ref.changelog.record_path(handle),
    }


def _record_serializers(
    ref: ManifestRef, handles: Sequence[ChangelogHandle], names: set[str]
) -> dict[str, dict[str, SerializerConfig]]:
    """The serializers of operator states ``names``, from the operator-state headers of
    the first of ``handles`` (one batch's records) that hold them: one ranged read per
    record read, usually one."""
    found: dict[str, dict[str, SerializerConfig]] = {}
    key = ref.changelog.storage.signing_key
    with verified_reads(
        ref.fs, ref.changelog.layout.manifests_dir, ref.manifest.files(), key
    ) as reads:
        for handle in handles:
            path = ref.changelog.record_path(handle)
            info = handle.operator_state
            if path is None or info is None or not (names - found.keys()) & info.states.keys():
                continue
            stored = read_operator_state(reads.read_range, path, handle)
            for name, state in ({} if stored is None else stored.states).items():
                found.setdefault(name, state.serializers)
            if names <= found.keys():
                break
    return found


def _operator_states(ref: ManifestRef, operator_id: str) -> dict[str, dict[str, Any]]:
    """The operator's operator states at the manifest's batch (a keyed function's
    ``CheckpointedFunction`` state), as ``inspect`` of a checkpoint shows them: per name
    its mode, serializers and elements over all subtasks, from the newest batch's records
    (serializers ``-`` if no record could say), else from the base checkpoint."""
    batches = ref.manifest.operators.get(operator_id, ())
    newest = [h.operator_state for h in batches[-1].subtasks] if batches else []
    states: dict[str, dict[str, Any]] = {}
    if any(info is not None for info in newest):
        for info in newest:
            for name, layout in ({} if info is None else info.states).items():
                entry = states.setdefault(name, {"mode": layout.mode.value, "elements": 0})
                entry["elements"] += layout.length
        serializers = _record_serializers(ref, batches[-1].subtasks, set(states))
        for name, entry in states.items():
            entry["serializer"] = "-"
            if name in serializers:
                entry["serializers"] = serializers[name]
                entry["serializer"] = describe_roles(serializers[name])
        return dict(sorted(states.items()))
    if ref.base is None or operator_id not in ref.base.metadata.operators:
        return {}
    for handle in ref.base.metadata.operators[operator_id].operator_handles():
        for name, stored in ({} if handle is None else handle.states).items():
            entry = states.setdefault(
                name,
                {
                    "mode": stored.mode.value,
                    "serializers": stored.serializers,
                    "serializer": describe_roles(stored.serializers),
                    "elements": 0,
                },
            )
            entry["elements"] += len(stored.elements)
    return dict(sorted(states.items()))


def inspect_manifest(ref: ManifestRef) -> dict[str, Any]:
    """Everything ``inspect`` shows of a manifest, as a JSON-able dict: the manifest
    (batch, commit time, properties), its base checkpoint (None before the first
    materialization), and per operator its parallelism, its keyed states and operator
    states (as at the batch), the base's keyed bytes and, batch by batch, every accepted
    record (subtask,
    attempt, key-group range, key groups with changes, changes, bytes, path)."""
    manifest = ref.manifest
    operators: dict[str, Any] = {}
    for operator_id in operator_ids(ref):
        metas, key_serializer = state_metas(ref, operator_id)
        base_snapshot = None if ref.base is None else ref.base.metadata.operators.get(operator_id)
        batches = [
            {
                "batch_id": batch.batch_id,
                "parallelism": batch.parallelism,
                "changes": sum(h.changes for h in batch.subtasks),
                "bytes": sum(h.size for h in batch.subtasks),
                "subtasks": [_record_json(h, ref) for h in batch.subtasks],
            }
            for batch in manifest.operators.get(operator_id, ())
        ]
        operators[operator_id] = {
            "parallelism": parallelism_of(ref, operator_id),
            "keyed_states": {
                meta.name: {
                    "kind": meta.kind.value,
                    "serializers": meta.serializers,
                    "serializer": describe_roles(meta.serializers),
                    "key_serializer": describe_serializer(key_serializer),
                }
                for meta in sorted(metas, key=lambda m: m.name)
                if not is_timer_state(meta.name)
            },
            "operator_states": _operator_states(ref, operator_id),
            "base_bytes": 0 if base_snapshot is None else base_snapshot.state_bytes(),
            "record_bytes": sum(b["bytes"] for b in batches),
            "batches": batches,
        }
    base = None
    if ref.base is not None:
        assert manifest.base is not None
        base = {
            "checkpoint_id": manifest.base.checkpoint_id,
            "batch_id": manifest.base.batch_id,
            "path": ref.base.directory,
            "state_bytes": ref.base.metadata.state_bytes(),
            "files": len(ref.base.metadata.files()),
        }
    handles = list(manifest.handles())
    return {
        "path": ref.path,
        "kind": "manifest",
        "job_id": manifest.job_id,
        "batch_id": manifest.batch_id,
        "committed_at": manifest.committed_at,
        "max_parallelism": manifest.max_parallelism,
        "properties": dict(manifest.properties),
        "base": base,
        "records": sum(1 for h in handles if h.path is not None),
        "record_bytes": sum(h.size for h in handles),
        "changes": sum(h.changes for h in handles),
        "operators": operators,
    }


# -- verify -----------------------------------------------------------------------------


def manifest_bytes(ref: ManifestRef) -> int:
    """The bytes ``verify_manifest`` reads: the base's files and every record."""
    base = 0 if ref.base is None else referenced_bytes(ref.base)
    return base + sum(f.size for f in ref.manifest.files())


def verify_manifest(ref: ManifestRef, progress: Progress | None = None) -> list[Problem]:
    """The problems of the manifest's state: those of its base checkpoint
    (``verify_checkpoint``) and every missing, truncated or corrupted record (size and
    checksum, each read whole). Empty if all is well."""
    problems = [] if ref.base is None else verify_checkpoint(ref.base, progress)
    for handle in ref.manifest.handles():
        path = ref.changelog.record_path(handle)
        if path is None:
            continue
        try:
            ref.fs.verify(path, handle.size, handle.checksum)
        except CheckpointError as exc:
            problems.append(Problem(path, str(exc)))
        if progress is not None:
            progress(handle.size)
    return problems


def verified_files(ref: ManifestRef) -> int:
    """How many files ``verify_manifest`` checks."""
    base = 0 if ref.base is None else len(ref.base.metadata.files())
    return base + len(ref.manifest.files())


# -- plan -------------------------------------------------------------------------------


def plan_manifest_operator(
    ref: ManifestRef, operator_id: str, parallelism: int
) -> list[dict[str, Any]]:
    """Per new subtask of ``operator_id`` at ``parallelism``: what a rebuild reads, as
    ``tools.plan.plan_operator`` shows for a checkpoint (``keyed_sources`` from the base,
    ``operator_state`` elements and slices of the newest records' operator state, without
    values; empty when they carry none), plus ``changelog_sources``:
    per batch, the old subtasks whose records it replays, their key groups and bytes."""
    _check_operator(ref, operator_id)
    check_parallelism(parallelism, ref.manifest.max_parallelism)
    base_plans = None
    if ref.base is not None and operator_id in ref.base.metadata.operators:
        base_plans = plan_restore(ref.base.metadata, operator_id, parallelism)
    operator_shares: list[dict[str, StatePlan]] = [{} for _ in range(parallelism)]
    if records_operator_state(ref, operator_id):
        newest = ref.manifest.operators[operator_id][-1].subtasks
        layouts = [{} if h.operator_state is None else h.operator_state.states for h in newest]
        operator_shares = plan_operator_state(layouts, parallelism)
    plans = []
    for subtask in range(parallelism):
        key_groups = compute_key_group_range_for_operator_index(
            ref.manifest.max_parallelism, parallelism, subtask
        )
        base_plan = None if base_plans is None else base_plans[subtask]
        changelog_sources: list[dict[str, Any]] = []
        for handle in records(ref, operator_id):
            wanted = handle.key_group_range.intersection(key_groups)
            if wanted:
                changelog_sources.append(
                    {
                        "batch_id": handle.batch_id,
                        "old_subtask": handle.subtask,
                        "key_groups": wanted.to_json(),
                        "bytes": sum(n for g, _, n in handle.key_groups if g in wanted),
                    }
                )
        plans.append(
            {
                "subtask": subtask,
                "key_group_range": key_groups.to_json(),
                "keyed_bytes": 0 if base_plan is None else base_plan.keyed_bytes,
                "keyed_sources": [] if base_plan is None else keyed_sources_json(base_plan),
                "changelog_bytes": sum(s["bytes"] for s in changelog_sources),
                "changelog_sources": changelog_sources,
                "operator_state": {
                    name: {
                        "elements": sum(end - begin for _, begin, end in share.slices),
                        "slices": [list(piece) for piece in share.slices],
                    }
                    for name, share in sorted(operator_shares[subtask].items())
                },
            }
        )
    return plans


def manifest_key_group_bytes(ref: ManifestRef, operator_id: str) -> KeyGroupBytes | None:
    """The bytes per key group a rebuild of ``operator_id`` reads at the manifest's
    batch: the base's (as ``statebackend report`` counts them) plus every record's; None
    if there are neither."""
    base = None
    if ref.base is not None and operator_id in ref.base.metadata.operators:
        snapshot = ref.base.metadata.operators[operator_id]
        base = key_group_bytes(snapshot, ref.manifest.max_parallelism)
    found = list(base.bytes) if base is not None else [0] * ref.manifest.max_parallelism
    handles = records(ref, operator_id)
    for handle in handles:
        for group, _, length in handle.key_groups:
            found[group] += length
    if base is None and not handles:
        return None
    return KeyGroupBytes(tuple(found), base is not None and base.estimated)


def plan_manifest_imbalance(ref: ManifestRef, operator_id: str, parallelism: int) -> float | None:
    """max/mean of the bytes (base + changelog) the new subtasks of ``operator_id`` would
    read at ``parallelism``; None without keyed state."""
    groups = manifest_key_group_bytes(ref, operator_id)
    return None if groups is None else split_key_groups(groups.bytes, parallelism).imbalance


def plan_manifest(
    ref: ManifestRef, parallelism: int, operator_id: str | None = None
) -> dict[str, list[dict[str, Any]]]:
    """``plan_manifest_operator`` for one operator, or for every operator."""
    operators = operator_ids(ref) if operator_id is None else [operator_id]
    return {op: plan_manifest_operator(ref, op, parallelism) for op in operators}


# -- fold -------------------------------------------------------------------------------


def fold_manifest(
    ref: ManifestRef,
    target: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    parallelism: int | None = None,
    compression: str = DEFAULT_CODEC,
    allow_pickle: bool = False,
    written: Written | None = None,
    scratch_dir: Path | None = None,
) -> str:
    """Write the state at the manifest's batch to ``target`` as a self-contained full
    savepoint, ``_metadata`` last; returns the target directory.

    Each operator is written at ``parallelism`` (default: its parallelism at the batch),
    each subtask rebuilt from base + records. The savepoint's properties are the
    manifest's, plus ``batch_id`` (unless the manifest has one) and
    ``folded_from_manifest``. An incremental base is downloaded into ``scratch_dir``
    (default: the system's temp directory). Raises ConfigurationError if the base holds state the
    changelog does not carry (``check_foldable``) or the rebuild would unpickle without
    ``allow_pickle``, CheckpointError if ``target`` already holds a savepoint.
    """
    check_foldable(ref)
    manifest = ref.manifest
    for operator_id in operator_ids(ref):
        check_replay_without_pickle(ref, operator_id, allow_pickle)
    writer = SavepointWriter(
        checkpoint_directory(target),
        manifest.max_parallelism,
        storage_options=storage_options,
        compression=compression,
        retry=FAIL_FAST_RETRY,
    )
    with writer.writing():
        fs = writer.filesystem(writer.target)
        acks = []
        with ThreadPoolExecutor(1, thread_name_prefix="statebackend-fold") as pool:
            for operator_id in operator_ids(ref):
                p = parallelism_of(ref, operator_id) if parallelism is None else parallelism
                check_parallelism(p, manifest.max_parallelism)
                for subtask in range(p):
                    key_groups = compute_key_group_range_for_operator_index(
                        manifest.max_parallelism, p, subtask
                    )
                    directory = SnapshotDirectory(
                        fs, writer.target, f"{operator_id}-{subtask}", pool, compression
                    )
                    backend = rebuild_subtask(ref, operator_id, key_groups, scratch_dir)
                    try:
                        handle = directory.write_keyed_snapshot(0, backend.sync_cut()).result()
                    finally:
                        backend.dispose()
                    operator_handle = None
                    cut = rebuild_operator_state(
                        ref.changelog, manifest, operator_id, subtask, p
                    ).sync_cut()
                    if cut.states or cut.raw:
                        operator_handle = directory.write_operator_snapshot(0, cut).result()
                    acks.append(SubtaskAck(operator_id, subtask, p, handle, operator_handle))
                    if written is not None:
                        written(operator_id, subtask)
        properties = {"batch_id": manifest.batch_id, **manifest.properties}
        properties[FOLDED_FROM_PROPERTY] = manifest.batch_id
        return writer.complete(
            acks,
            job_id=manifest.job_id,
            checkpoint_id=0 if manifest.base is None else manifest.base.checkpoint_id,
            properties=properties,
        )


def committed_source_offsets(
    properties: dict[str, Any], operator_id: str, state_name: str | None, where: str
) -> list[Record] | None:
    """The source offsets a job's driver committed in a manifest's properties (which a
    savepoint folded from it carries), as ``read`` shows the source's ``offsets`` state in
    a checkpoint: ``{"value": [partition, offset]}`` per partition. None unless
    ``operator_id``/``state_name`` name that state and the properties hold offsets;
    CheckpointCorruptedError naming ``where`` if they are malformed."""
    if (operator_id, state_name) != (SOURCE_OPERATOR, SOURCE_OFFSETS_STATE):
        return None
    offsets = source_offsets(properties, where)
    if offsets is None:
        return None
    return [{"value": list(pair)} for share in offsets for pair in share]
