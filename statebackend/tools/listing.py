"""``statebackend list`` and ``inspect``: what is in a checkpoint directory, and in one
checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statebackend.backends.timers import TIME_DOMAINS
from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.layout import SAVEPOINTS_DIR, checkpoint_ids, join
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.storage import load_metadata
from statebackend.errors import CheckpointError, CheckpointNotFoundError
from statebackend.serializers import SerializerConfig
from statebackend.snapshot.keyed_format import KeyedStateHandle
from statebackend.state.timers import is_timer_state
from statebackend.tools.location import CheckpointRef

COMPLETED = "completed"
PENDING = "pending or aborted"


@dataclass(frozen=True)
class CheckpointSummary:
    """One checkpoint or savepoint directory: completed, pending/aborted or unreadable."""

    path: str
    status: str
    checkpoint_id: int | None = None
    metadata: CheckpointMetadata | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of what ``list`` shows."""
        md = self.metadata
        return {
            "path": self.path,
            "status": self.status,
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
class JobSummary:
    """One job directory: its checkpoints (ascending ids) and savepoints."""

    job_dir: str
    checkpoints: tuple[CheckpointSummary, ...]
    savepoints: tuple[CheckpointSummary, ...]

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of what ``list`` shows."""
        return {
            "job_dir": self.job_dir,
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "savepoints": [s.to_json() for s in self.savepoints],
        }


def _is_job(names: list[str]) -> bool:
    return bool(checkpoint_ids(names)) or SAVEPOINTS_DIR in names


def find_job_dirs(fs: CheckpointFileSystem, directory: str) -> list[str]:
    """The job directories in ``directory``: itself if it is one, else its subdirectories
    that hold ``chk-<N>`` directories or savepoints.

    Raises CheckpointNotFoundError if there are none.
    """
    directory = directory.rstrip("/")
    names = fs.list_dir(directory)
    if _is_job(names):
        return [directory]
    jobs = [join(directory, n) for n in names if _is_job(fs.list_dir(join(directory, n)))]
    if not jobs:
        raise CheckpointNotFoundError(
            f"no job checkpoints under {directory}: give the checkpoint directory "
            f"(holding <job id>/chk-<N>) or a job's directory"
        )
    return jobs


def summarize(fs: CheckpointFileSystem, path: str, checkpoint_id: int | None) -> CheckpointSummary:
    """The summary of the checkpoint or savepoint directory ``path``."""
    try:
        return CheckpointSummary(path, COMPLETED, checkpoint_id, load_metadata(fs, path))
    except CheckpointNotFoundError:
        return CheckpointSummary(path, PENDING, checkpoint_id)
    except CheckpointError as exc:
        return CheckpointSummary(path, f"unreadable: {exc}", checkpoint_id)


def list_job(fs: CheckpointFileSystem, job_dir: str) -> JobSummary:
    """The checkpoints and savepoints (in its ``savepoints/`` directory) of one job."""
    checkpoints = tuple(
        summarize(fs, join(job_dir, f"chk-{n}"), n) for n in checkpoint_ids(fs.list_dir(job_dir))
    )
    savepoints_dir = join(job_dir, SAVEPOINTS_DIR)
    savepoints = tuple(
        summarize(fs, join(savepoints_dir, name), None) for name in fs.list_dir(savepoints_dir)
    )
    return JobSummary(job_dir, checkpoints, savepoints)


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


def _describe_roles(serializers: dict[str, SerializerConfig]) -> str:
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
    a stream, bytes and file.
    """
    md = ref.metadata
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
                            "serializer": _describe_roles(meta.serializers),
                            "key_serializer": describe_serializer(ack.keyed.key_serializer),
                        },
                    )
                row["key_group_range"] = ack.keyed.key_group_range.to_json()
                row["keyed_bytes"] = ack.keyed.size
                if isinstance(ack.keyed, KeyedStateHandle):
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
                            "serializer": _describe_roles(info.serializers),
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
        "files": len(md.files()),
        "properties": dict(md.properties),
        "operators": operators,
    }
