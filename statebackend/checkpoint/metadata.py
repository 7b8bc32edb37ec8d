"""``_metadata``: the versioned JSON that makes a checkpoint or savepoint complete.

It names the job, the checkpoint, the max parallelism and, per operator, its parallelism
and each subtask's state handles. Every file it references has a size and a checksum;
paths are relative to the directory that holds ``_metadata``, so a savepoint can move
(incremental checkpoints reference the job's shared files as ``../shared/...``; a
savepoint holds copies of them).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from statebackend.errors import CheckpointCorruptedError, IncompatibleStateError
from statebackend.snapshot.handles import StoredFile
from statebackend.snapshot.keyed_handles import KeyedHandle, keyed_handle_from_json
from statebackend.snapshot.operator_format import OperatorStateHandle

FORMAT_VERSION = 1


@dataclass(frozen=True)
class SubtaskAck:
    """One subtask's acknowledgement of a checkpoint: its handles (None = no such state),
    the coordinator run that triggered the checkpoint (``run``; the coordinator ignores
    acks of other runs) and the task attempt that wrote the handles (``attempt``; None for
    a single attempt and in checkpoints written before these fields existed)."""

    operator_id: str
    subtask: int
    parallelism: int
    keyed: KeyedHandle | None
    operator_state: OperatorStateHandle | None
    run: str | None = None
    attempt: str | None = None

    def files(self) -> list[StoredFile]:
        """Every file the subtask's handles reference."""
        found = [] if self.keyed is None else self.keyed.files()
        handle = self.operator_state
        if handle is not None and handle.path is not None:
            found.append(StoredFile(handle.path, handle.size, handle.checksum))
        return found

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (an ack file's content and part of ``_metadata``)."""
        document = {
            "operator": self.operator_id,
            "subtask": self.subtask,
            "parallelism": self.parallelism,
            "keyed": None if self.keyed is None else self.keyed.to_json(),
            "operator_state": (
                None if self.operator_state is None else self.operator_state.to_json()
            ),
        }
        identity = {"run": self.run, "attempt": self.attempt}
        return document | {name: value for name, value in identity.items() if value is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SubtaskAck:
        """The inverse of ``to_json``."""
        keyed, operator_state = data.get("keyed"), data.get("operator_state")
        return cls(
            operator_id=data["operator"],
            subtask=int(data["subtask"]),
            parallelism=int(data["parallelism"]),
            keyed=None if keyed is None else keyed_handle_from_json(keyed),
            operator_state=(
                None if operator_state is None else OperatorStateHandle.from_json(operator_state)
            ),
            run=data.get("run"),
            attempt=data.get("attempt"),
        )


@dataclass(frozen=True)
class OperatorSnapshot:
    """All subtasks' state of one operator in a checkpoint, indexed by subtask."""

    operator_id: str
    parallelism: int
    subtasks: tuple[SubtaskAck, ...]

    def keyed_handles(self) -> list[KeyedHandle]:
        """The keyed handles of all subtasks that have keyed state."""
        return [ack.keyed for ack in self.subtasks if ack.keyed is not None]

    def operator_handles(self) -> list[OperatorStateHandle | None]:
        """Each subtask's operator-state handle, by subtask index."""
        return [ack.operator_state for ack in self.subtasks]

    def state_bytes(self) -> int:
        """Bytes of all files of this operator."""
        return sum(ack.keyed.size for ack in self.subtasks if ack.keyed is not None) + sum(
            ack.operator_state.stored_size()
            for ack in self.subtasks
            if ack.operator_state is not None
        )


@dataclass(frozen=True)
class CheckpointMetadata:
    """The content of ``_metadata``."""

    job_id: str
    checkpoint_id: int
    max_parallelism: int
    operators: dict[str, OperatorSnapshot]
    triggered_at: float
    completed_at: float
    is_savepoint: bool = False
    properties: dict[str, Any] = field(default_factory=dict)

    def files(self) -> list[StoredFile]:
        """(relative path, size, checksum) of every file the checkpoint references,
        shared ones (``../shared/...``) included."""
        return [f for op in self.operators.values() for ack in op.subtasks for f in ack.files()]

    def with_keyed_paths(self, relocate: Callable[[str], str]) -> CheckpointMetadata:
        """The same metadata with the keyed handles' file paths mapped by ``relocate``."""
        operators = {
            operator_id: dataclasses.replace(
                op,
                subtasks=tuple(
                    ack
                    if ack.keyed is None
                    else dataclasses.replace(ack, keyed=ack.keyed.with_paths(relocate))
                    for ack in op.subtasks
                ),
            )
            for operator_id, op in self.operators.items()
        }
        return dataclasses.replace(self, operators=operators)

    def state_bytes(self) -> int:
        """Bytes of state over all operators."""
        return sum(op.state_bytes() for op in self.operators.values())

    def to_bytes(self) -> bytes:
        """The ``_metadata`` file's bytes."""
        document = {
            "format_version": FORMAT_VERSION,
            "job_id": self.job_id,
            "checkpoint_id": self.checkpoint_id,
            "kind": "savepoint" if self.is_savepoint else "checkpoint",
            "triggered_at": self.triggered_at,
            "completed_at": self.completed_at,
            "max_parallelism": self.max_parallelism,
            "properties": self.properties,
            "operators": {
                operator_id: {
                    "parallelism": op.parallelism,
                    "subtasks": [ack.to_json() for ack in op.subtasks],
                }
                for operator_id, op in sorted(self.operators.items())
            },
        }
        return json.dumps(document, indent=1, sort_keys=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> CheckpointMetadata:
        """Parse ``_metadata`` read from ``where``.

        Raises IncompatibleStateError for a format version this release cannot read and
        CheckpointCorruptedError naming ``where`` for anything malformed.
        """
        try:
            document = json.loads(data)
            version = document["format_version"]
        except Exception as exc:
            raise CheckpointCorruptedError(f"{where}: not a checkpoint metadata file") from exc
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise IncompatibleStateError(
                f"{where} has metadata format version {version!r}; this statebackend reads "
                f"up to version {FORMAT_VERSION}: upgrade statebackend to restore it"
            )
        try:
            operators = {}
            for operator_id, op in document["operators"].items():
                subtasks = tuple(SubtaskAck.from_json(ack) for ack in op["subtasks"])
                operators[operator_id] = OperatorSnapshot(
                    operator_id, int(op["parallelism"]), subtasks
                )
            return cls(
                job_id=document["job_id"],
                checkpoint_id=int(document["checkpoint_id"]),
                max_parallelism=int(document["max_parallelism"]),
                operators=operators,
                triggered_at=float(document["triggered_at"]),
                completed_at=float(document["completed_at"]),
                is_savepoint=document.get("kind") == "savepoint",
                properties=dict(document.get("properties", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptedError(
                f"{where}: malformed checkpoint metadata: {exc}"
            ) from exc
