"""``statebackend list`` and ``inspect``: what is in a checkpoint directory, and in one
checkpoint.

A job's listing has its checkpoints, savepoints and batch manifests; a checkpoint that a
manifest builds on is a materialization (``materializes``: the batch whose state it
holds)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from statebackend.backends.timers import TIME_DOMAINS
from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.layout import (
    MANIFESTS_DIR,
    SAVEPOINTS_DIR,
    checkpoint_ids,
    join,
)
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.storage import load_metadata_files
from statebackend.errors import CheckpointNotFoundError
from statebackend.serializers import SerializerConfig
from statebackend.snapshot.keyed_format import FullKeyedStateHandle
from statebackend.state.timers import is_timer_state
from statebackend.tools.location import CheckpointRef, job_changelog

COMPLETED = "completed"
COMMITTED = "committed"
PENDING = "pending or aborted"


@dataclass(frozen=True)
class CheckpointSummary:
    """One checkpoint or savepoint directory: completed, pending/aborted or unreadable."""

    path: str
    status: str
    checkpoint_id: int | None = None
    metadata: CheckpointMetadata | None = None
    materializes: int | None = None
    """The batch whose state it holds, if a batch manifest builds on it."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of what ``list`` shows."""
        md = self.metadata
        return {
            "path": self.path,
            "status": self.status,
            "materializes": self.materializes,
            "checkpoint_id": self.checkpoint_id if md is None else md.checkpoint_id,
            "kind": None if md is None else ("savepoint" if md.is_savepoint else "checkpoint"),
            "completed_at": None if md is None else md.completed_at,
            "state_bytes": None if md is None else md.state_bytes(),
            "max_parallelism": None if md is None else md.max_parallelism,
            "operators": (
                {}
                if md is None
                else {op: snap.parallelism for op, snap in sorted(md.operators.items())}
            ),
        }


@dataclass(frozen=True)
class ManifestSummary:
    """One batch manifest (``manifest`` None if it cannot be read: ``status`` says why)."""

    path: str
    batch_id: int
    status: str
    manifest: BatchManifest | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of what ``list`` shows: the base checkpoint, and the records
        (those with changes), their bytes and changes."""
        m = self.manifest
        handles = [] if m is None else list(m.handles())
        return {
            "path": self.path,
            "batch_id": self.batch_id,
            "status": self.status,
            "committed_at": None if m is None else m.committed_at,
            "base": None if m is None or m.base is None else m.base.to_json(),
            "records": sum(1 for h in handles if h.path is not None),
            "record_bytes": sum(h.size for h in handles),
            "changes": sum(h.changes for h in handles),
            "max_parallelism": None if m is None else m.max_parallelism,
            "operators": (
                {} if m is None else {op: m.parallelism(op) for op in sorted(m.operators)}
            ),
        }


@dataclass(frozen=True)
class JobSummary:
    """One job directory: its checkpoints (ascending ids), savepoints and batch
    manifests (ascending batches)."""

    job_dir: str
    checkpoints: tuple[CheckpointSummary, ...]
    savepoints: tuple[CheckpointSummary, ...]
    manifests: tuple[ManifestSummary, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of what ``list`` shows."""
        return {
            "job_dir": self.job_dir,
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "savepoints": [s.to_json() for s in self.savepoints],
            "manifests": [m.to_json() for m in self.manifests],
        }


def _is_job(names: list[str]) -> bool:
    return bool(checkpoint_ids(names)) or SAVEPOINTS_DIR in names or MANIFESTS_DIR in names


def find_job_dirs(fs: CheckpointFileSystem, directory: str) -> list[str]:
    """The job directories in ``directory``: itself if it is one, else its subdirectories
    that hold ``chk-<N>`` directories, savepoints or batch manifests.

    Raises CheckpointNotFoundError if there are none.
    """
    directory = directory.rstrip("/")
    names = fs.list_dir(directory)
    if _is_job(names):
        return [directory]
    if names and fs.is_file(directory):
        raise CheckpointNotFoundError(
            f"{directory} is a file: give the checkpoint directory (holding "
            f"<job id>/chk-<N>) or a job's directory"
        )
    jobs = [join(directory, n) for n in names if _is_job(fs.list_dir(join(directory, n)))]
    if not jobs:
        raise CheckpointNotFoundError(
            f"no job checkpoints under {directory}: give the checkpoint directory "
            f"(holding <job id>/chk-<N>) or a job's directory"
        )
    return jobs


def summarize(fs: CheckpointFileSystem, path: str, checkpoint_id: int | None) -> CheckpointSummary:
    """The summary of the checkpoint or savepoint directory ``path``."""
    (summary,) = _summaries(fs, [(path, checkpoint_id)])
    return summary


def _summaries(
    fs: CheckpointFileSystem, directories: list[tuple[str, int | None]]
) -> tuple[CheckpointSummary, ...]:
    """``summarize`` of each (directory, checkpoint id), their ``_metadata`` read with
    several requests in flight."""
    loaded = load_metadata_files(fs, [directory for directory, _ in directories])
    return tuple(
        CheckpointSummary(directory, COMPLETED, checkpoint_id, metadata)
        if isinstance(metadata, CheckpointMetadata)
        else CheckpointSummary(directory, PENDING, checkpoint_id)
        if isinstance(metadata, CheckpointNotFoundError)
        else CheckpointSummary(directory, f"unreadable: {metadata}", checkpoint_id)
        for (directory, checkpoint_id), metadata in zip(directories, loaded, strict=True)
    )


def summarize_manifests(fs: CheckpointFileSystem, job_dir: str) -> tuple[ManifestSummary, ...]:
    """The batch manifests of the job in ``job_dir``, ascending; an unreadable one with
    its error as its status."""
    changelog = job_changelog(fs, job_dir)
    ids = changelog.manifest_ids()
    return tuple(
        ManifestSummary(path, batch_id, COMMITTED, loaded)
        if isinstance(loaded, BatchManifest)
        else ManifestSummary(path, batch_id, f"unreadable: {loaded}")
        for batch_id, loaded in zip(ids, changelog.load_manifests(ids), strict=True)
        for path in [changelog.layout.manifest_path(batch_id)]
    )


def list_job(fs: CheckpointFileSystem, job_dir: str) -> JobSummary:
    """The checkpoints, savepoints (in its ``savepoints/`` directory) and batch
    manifests of one job, checkpoints marked with the batch they materialize."""
    manifests = summarize_manifests(fs, job_dir)
    materialized = {  # the job's own checkpoints (a base may be a savepoint elsewhere)
        m.manifest.base.checkpoint_id: m.manifest.base.batch_id
        for m in manifests
        if m.manifest is not None
        and m.manifest.base is not None
        and m.manifest.base.path == f"../chk-{m.manifest.base.checkpoint_id}"
    }
    ids = checkpoint_ids(fs.list_dir(job_dir))
    checkpoints = tuple(
        dataclasses.replace(summary, materializes=materialized.get(n))
        for n, summary in zip(
            ids, _summaries(fs, [(join(job_dir, f"chk-{n}"), n) for n in ids]), strict=True
        )
    )
    savepoints_dir = join(job_dir, SAVEPOINTS_DIR)
    savepoints = _summaries(
        fs, [(join(savepoints_dir, name), None) for name in fs.list_dir(savepoints_dir)]
    )
    return JobSummary(job_dir, checkpoints, savepoints, manifests)


def list_jobs(fs: CheckpointFileSystem, directory: str) -> list[JobSummary]:
    """Every job under ``directory`` (see ``find_job_dirs``) with its checkpoints."""
    return [list_job(fs, job_dir) for job_dir in find_job_dirs(fs, directory)]


def describe_serializer(config: SerializerConfig) -> str:
    """A short name for a serializer config: ``int``, ``tuple(str, int)``, ``ttl(json)``."""
    identity = str(config.get("identity"))
    if "fields" in config:
        return f"{identity}({', '.join(describe_serializer(f) for f in config['fields'])})"
    if "inner" in config:
        return f"{identity}({describe_serializer(config['inner'])})"
    return identity


def describe_roles(serializers: dict[str, SerializerConfig]) -> str:
    """``value: int`` or ``user_key: str, value: int``."""
    return ", ".join(f"{role}: {describe_serializer(c)}" for role, c in sorted(serializers.items()))


def inspect_checkpoint(ref: CheckpointRef) -> dict[str, Any]:
    """Everything ``inspect`` shows of a checkpoint, as a JSON-able dict.

    With the job's ``properties`` (e.g. the example job's source directory). Per
    operator: its keyed states (kind, serializers), its operator states (mode,
    serializers, element count), its raw keyed bytes, its timers (per time domain the count
    and earliest timestamp, and the earliest watermark and processing time of its subtasks;
    None when its snapshots predate timers), and per subtask its key-group range, keyed
    bytes, keyed file (``keyed_files`` for an incremental snapshot), operator-state
    elements and, when it has raw keyed state, its ``raw_keyed_*`` range, key groups with
    a stream, bytes and file. ``inline_bytes``: the state kept inside ``_metadata``.
    """
    md = ref.metadata
    files = md.files()
    operators: dict[str, Any] = {}
    for operator_id, snapshot in sorted(md.operators.items()):
        keyed: dict[str, dict[str, Any]] = {}
        operator_states: dict[str, dict[str, Any]] = {}
        subtasks = []
        timer_infos = [
            ack.keyed.timers
            for ack in snapshot.subtasks
            if ack.keyed is not None and ack.keyed.timers is not None
        ]
        timers: dict[str, Any] | None = None
        if timer_infos:
            timers = {
                domain: {
                    "count": sum(info.counts[domain] for info in timer_infos),
                    "earliest": min(
                        (e for info in timer_infos if (e := info.earliest[domain]) is not None),
                        default=None,
                    ),
                }
                for domain in TIME_DOMAINS
            }
            timers["watermark"] = min(info.clocks.watermark for info in timer_infos)
            timers["processing_time"] = min(info.clocks.processing_time for info in timer_infos)
        for ack in snapshot.subtasks:
            row: dict[str, Any] = {"subtask": ack.subtask, "key_group_range": None}
            if ack.keyed is not None:
                for meta in ack.keyed.states:
                    if is_timer_state(meta.name):
                        continue
                    keyed.setdefault(
                        meta.name,
                        {
                            "kind": meta.kind.value,
                            "serializers": meta.serializers,
                            "serializer": describe_roles(meta.serializers),
                            "key_serializer": describe_serializer(ack.keyed.key_serializer),
                        },
                    )
                row["key_group_range"] = ack.keyed.key_group_range.to_json()
                row["keyed_bytes"] = ack.keyed.size
                if isinstance(ack.keyed, FullKeyedStateHandle):
                    row["key_groups_with_state"] = len(ack.keyed.key_groups)
                    row["keyed_file"] = ack.keyed.path
                else:
                    row["keyed_files"] = [f.path for f in ack.keyed.files()]
            raw = ack.raw_keyed
            if raw is not None:
                row["raw_keyed_key_group_range"] = raw.key_group_range.to_json()
                row["raw_keyed_key_groups"] = len(raw.key_groups)
                row["raw_keyed_bytes"] = raw.size
                row["raw_keyed_file"] = raw.path
            handle = ack.operator_state
            row["operator_state_elements"] = (
                {} if handle is None else {n: len(i.elements) for n, i in handle.states.items()}
            )
            row["operator_state_bytes"] = 0 if handle is None else handle.size
            row["operator_state_inline"] = handle is not None and handle.inline is not None
            if handle is not None:
                for name, info in handle.states.items():
                    entry = operator_states.setdefault(
                        name,
                        {
                            "mode": info.mode.value,
                            "serializers": info.serializers,
                            "serializer": describe_roles(info.serializers),
                            "elements": 0,
                        },
                    )
                    entry["elements"] += len(info.elements)
            subtasks.append(row)
        operators[operator_id] = {
            "parallelism": snapshot.parallelism,
            "state_bytes": snapshot.state_bytes(),
            "keyed_states": dict(sorted(keyed.items())),
            "operator_states": dict(sorted(operator_states.items())),
            "raw_keyed_bytes": sum(h.size for h in snapshot.raw_keyed_handles()),
            "timers": timers,
            "subtasks": subtasks,
        }
    return {
        "path": ref.directory,
        "job_id": md.job_id,
        "checkpoint_id": md.checkpoint_id,
        "kind": "savepoint" if md.is_savepoint else "checkpoint",
        "triggered_at": md.triggered_at,
        "completed_at": md.completed_at,
        "max_parallelism": md.max_parallelism,
        "state_bytes": md.state_bytes(),
        "files": len(files),
        "inline_bytes": md.state_bytes() - sum(f.size for f in files),
        "properties": dict(md.properties),
        "operators": operators,
    }
