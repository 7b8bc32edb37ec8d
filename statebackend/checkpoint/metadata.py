"""``_metadata``: the versioned JSON that makes a checkpoint or savepoint complete.

It names the job, the checkpoint, the max parallelism and, per operator, its parallelism
and each subtask's state handles. Every file it references has a size and a checksum;
paths are relative to the directory that holds ``_metadata``, so a savepoint can move
(incremental checkpoints reference the job's shared files as ``../shared/...``; a
savepoint holds copies of them).

``_metadata`` is checked whenever it is loaded, before anything it references is read:
per operator the subtasks are exactly 0..P-1, each once, their key-group ranges cover
0..M-1 exactly, and every handle is well formed (paths inside the job's directory, sizes,
checksums, indexes within their files). A violation is a CheckpointCorruptedError naming
the file and what is wrong. Its ``"checksum"`` field, the CRC-32 of the rest of the
document, is checked first: damage that leaves valid JSON (a digit of an index, an
offset in the properties) would otherwise go unnoticed (a file without the field, from an
older release, is read as before if it has only the fields those wrote: a damaged name
of the field is no way around it). A signed ``_metadata`` (format version 2,
``signing.py``) carries ``"signature": {"algorithm": "hmac-sha256", "value": <hex>}``
over the same document without that field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from statebackend.backends.keyed import StateMetaInfo
from statebackend.checkpoint.layout import ACKS_DIR, METADATA_FILE, PENDING_FILE, is_plain_name
from statebackend.checkpoint.signing import (
    SigningKey,
    check_document,
    check_signable,
    check_signed_files,
    document_bytes,
)
from statebackend.checksums import algorithm_of
from statebackend.errors import (
    MALFORMED_DOCUMENT,
    CheckpointCorruptedError,
    IncompatibleStateError,
)
from statebackend.keygroups import UPPER_BOUND_MAX_PARALLELISM
from statebackend.snapshot.handles import KeyGroupIndexedFile, StoredFile
from statebackend.snapshot.incremental import IncrementalKeyedStateHandle
from statebackend.snapshot.keyed_format import FullKeyedStateHandle
from statebackend.snapshot.keyed_handles import KeyedHandle, keyed_handle_from_json
from statebackend.snapshot.operator_format import OperatorStateHandle, Span
from statebackend.snapshot.raw_keyed_format import RawKeyedStateHandle

FORMAT_VERSION = 2
"""The newest format this release writes: 2 when signed, else 1 (which older releases read)."""
_UNSIGNED_VERSION = 1
_FIELDS = frozenset(
    {
        "format_version",
        "job_id",
        "checkpoint_id",
        "kind",
        "triggered_at",
        "completed_at",
        "max_parallelism",
        "properties",
        "operators",
    }
)
"""The top-level fields of ``_metadata`` besides its checksum and signature: all that a
release writing no checksum wrote (the same versions 1 and 2)."""


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
    raw_keyed: RawKeyedStateHandle | None = None

    def files(self) -> list[StoredFile]:
        """Every file the subtask's handles reference."""
        found = [] if self.keyed is None else self.keyed.files()
        handle = self.operator_state
        if handle is not None and handle.path is not None:
            found.append(StoredFile(handle.path, handle.size, handle.checksum))
        if self.raw_keyed is not None:
            found += self.raw_keyed.files()
        return found

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (an ack file's content and part of ``_metadata``); ``raw_keyed``,
        ``run`` and ``attempt`` only when set, so older readers load the rest."""
        document: dict[str, Any] = {
            "operator": self.operator_id,
            "subtask": self.subtask,
            "parallelism": self.parallelism,
            "keyed": None if self.keyed is None else self.keyed.to_json(),
            "operator_state": (
                None if self.operator_state is None else self.operator_state.to_json()
            ),
        }
        if self.raw_keyed is not None:
            document["raw_keyed"] = self.raw_keyed.to_json()
        identity = {"run": self.run, "attempt": self.attempt}
        return document | {name: value for name, value in identity.items() if value is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SubtaskAck:
        """The inverse of ``to_json``."""
        keyed, operator_state = data.get("keyed"), data.get("operator_state")
        raw_keyed = data.get("raw_keyed")
        return cls(
            operator_id=data["operator"],
            subtask=int(data["subtask"]),
            parallelism=int(data["parallelism"]),
            keyed=None if keyed is None else keyed_handle_from_json(keyed),
            operator_state=(
                None if operator_state is None else OperatorStateHandle.from_json(operator_state)
            ),
            raw_keyed=None if raw_keyed is None else RawKeyedStateHandle.from_json(raw_keyed),
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

    def keyed_states(self) -> dict[str, StateMetaInfo]:
        """The keyed states its handles hold, by name (one subtask's meta info each)."""
        return {meta.name: meta for handle in self.keyed_handles() for meta in handle.states}

    def operator_handles(self) -> list[OperatorStateHandle | None]:
        """Each subtask's operator-state handle, by subtask index."""
        return [ack.operator_state for ack in self.subtasks]

    def raw_keyed_handles(self) -> list[RawKeyedStateHandle]:
        """The raw keyed handles of all subtasks that have raw keyed state."""
        return [ack.raw_keyed for ack in self.subtasks if ack.raw_keyed is not None]

    def state_bytes(self) -> int:
        """Bytes of all files of this operator."""
        return (
            sum(ack.keyed.size for ack in self.subtasks if ack.keyed is not None)
            + sum(
                ack.operator_state.stored_size()
                for ack in self.subtasks
                if ack.operator_state is not None
            )
            + sum(handle.size for handle in self.raw_keyed_handles())
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
        """The same metadata with the keyed and raw keyed handles' file paths mapped by
        ``relocate``."""
        operators = {
            operator_id: dataclasses.replace(
                op,
                subtasks=tuple(
                    dataclasses.replace(
                        ack,
                        keyed=None if ack.keyed is None else ack.keyed.with_paths(relocate),
                        raw_keyed=(
                            None if ack.raw_keyed is None else ack.raw_keyed.with_paths(relocate)
                        ),
                    )
                    for ack in op.subtasks
                ),
            )
            for operator_id, op in self.operators.items()
        }
        return dataclasses.replace(self, operators=operators)

    def state_bytes(self) -> int:
        """Bytes of state over all operators."""
        return sum(op.state_bytes() for op in self.operators.values())

    def to_bytes(self, signing_key: SigningKey | None = None) -> bytes:
        """The ``_metadata`` file's bytes; signed (format version 2) with ``signing_key``.

        Raises CheckpointError if signing was asked for but a referenced file has no
        SHA-256 checksum (it was written by a file system opened without signing).
        """
        document = {
            "format_version": _UNSIGNED_VERSION if signing_key is None else FORMAT_VERSION,
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
        if signing_key is not None:
            check_signable(
                self.files(),
                f"checkpoint {self.checkpoint_id}",
                "write checkpoints with the signing key set",
            )
        return document_bytes(document, _canonical, signing_key)

    @classmethod
    def from_bytes(
        cls, data: bytes, where: str, signing_key: SigningKey | None = None
    ) -> CheckpointMetadata:
        """Parse and check ``_metadata`` read from ``where`` (see the module docstring).

        With ``signing_key`` the signature is checked first, and an unsigned file, or one
        referencing a file without a SHA-256 checksum, is refused. Raises
        IncompatibleStateError for a format version this release cannot read and
        CheckpointCorruptedError naming ``where`` for anything malformed or not signed.
        """
        try:
            document = json.loads(data)
            version = document["format_version"]
        except Exception as exc:
            raise CheckpointCorruptedError(f"{where}: not a checkpoint metadata file") from exc
        check_document(document, _canonical, signing_key, where, "checkpoint", _FIELDS)
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
            metadata = cls(
                job_id=document["job_id"],
                checkpoint_id=int(document["checkpoint_id"]),
                max_parallelism=int(document["max_parallelism"]),
                operators=operators,
                triggered_at=float(document["triggered_at"]),
                completed_at=float(document["completed_at"]),
                is_savepoint=document.get("kind") == "savepoint",
                properties=dict(document.get("properties", {})),
            )
            problem = metadata.problem()
        except MALFORMED_DOCUMENT as exc:
            raise CheckpointCorruptedError(
                f"{where}: malformed checkpoint metadata: {exc!r}"
            ) from exc
        if problem is not None:
            raise CheckpointCorruptedError(f"{where} is invalid: {problem}")
        if signing_key is not None:
            check_signed_files(metadata.files(), where)
        return metadata

    def problem(self) -> str | None:
        """What is wrong with this metadata (see the module docstring), or None."""
        if self.checkpoint_id < 0:
            return f"checkpoint id {self.checkpoint_id} is negative"
        for name, value in (
            ("triggered_at", self.triggered_at),
            ("completed_at", self.completed_at),
        ):
            if not math.isfinite(value):
                return f"{name} {value!r} is not a time"
        m = self.max_parallelism
        if not 1 <= m <= UPPER_BOUND_MAX_PARALLELISM:
            return f"max parallelism {m} is not in 1..{UPPER_BOUND_MAX_PARALLELISM}"
        for operator_id, op in sorted(self.operators.items()):
            problem = _operator_problem(op, m)
            if problem is not None:
                return f"operator {operator_id!r}: {problem}"
        return None


def _canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, indent=1, sort_keys=True).encode("utf-8")


def _operator_problem(op: OperatorSnapshot, max_parallelism: int) -> str | None:
    p = op.parallelism
    if not 1 <= p <= max_parallelism:
        return f"parallelism {p} is not in 1..{max_parallelism} (the max parallelism)"
    indexes = [ack.subtask for ack in op.subtasks]
    if indexes != list(range(p)):
        return f"has subtasks {indexes}, but parallelism {p} needs each of 0..{p - 1} once"
    for ack in op.subtasks:
        if ack.operator_id != op.operator_id or ack.parallelism != p:
            return (
                f"subtask {ack.subtask} belongs to {ack.operator_id!r} at parallelism "
                f"{ack.parallelism}"
            )
    keyed = [ack.keyed for ack in op.subtasks]
    if any(handle is not None for handle in keyed):
        ranges = sorted(
            (h.key_group_range.start, h.key_group_range.end, i)
            for i, h in enumerate(keyed)
            if h is not None
        )
        expected_start = 0
        for start, end, subtask in ranges:
            if start != expected_start or end < start:
                return (
                    f"the key-group ranges do not cover 0..{max_parallelism - 1} exactly "
                    f"(subtask {subtask} has {start}..{end}, expected to start at "
                    f"{expected_start})"
                )
            expected_start = max(expected_start, end + 1)
        if expected_start != max_parallelism:
            return f"the key-group ranges end at {expected_start - 1}, not at {max_parallelism - 1}"
    raw = sorted(
        (h.key_group_range.start, h.key_group_range.end, ack.subtask)
        for ack in op.subtasks
        if (h := ack.raw_keyed) is not None and h.key_group_range
    )
    for n, (start, end, subtask) in enumerate(raw):
        if start < 0 or end >= max_parallelism:
            return (
                f"the raw keyed key-group ranges go beyond 0..{max_parallelism - 1} "
                f"(subtask {subtask} has {start}..{end})"
            )
        if n and start <= raw[n - 1][1]:
            previous = raw[n - 1][2]
            return f"the raw keyed key-group ranges of subtasks {previous} and {subtask} overlap"
    for ack in op.subtasks:
        problem = ack_problem(ack)
        if problem is not None:
            return f"subtask {ack.subtask}: {problem}"
    return None


def _path_problem(path: str) -> str | None:
    """Why ``path`` is no file of a checkpoint: a relative path in its directory, or in
    the job's shared directory (``../shared/<name>``)."""
    if not isinstance(path, str) or not path or "://" in path or path.startswith("/"):
        return f"file path {path!r} is not relative to the checkpoint directory"
    parts = posixpath.normpath(path).split("/")
    if parts[:2] == ["..", "shared"] and len(parts) == 3:
        parts = parts[2:]
    if not all(map(is_plain_name, parts)):
        return f"file path {path!r} leads outside the checkpoint"
    if parts[0] in (METADATA_FILE, PENDING_FILE, ACKS_DIR):
        return f"file path {path!r} names the checkpoint's own {parts[0]}"
    return None


def _file_problem(file: StoredFile) -> str | None:
    problem = _path_problem(file.path)
    if problem is not None:
        return problem
    if file.size < 0:
        return f"file {file.path} has a negative size {file.size}"
    if algorithm_of(file.checksum) is None:
        return f"file {file.path} has a malformed checksum {file.checksum!r}"
    return None


def _spans_problem(spans: tuple[Span, ...], size: int, what: str) -> str | None:
    for offset, length, _ in spans:
        if offset < 0 or length < 0 or offset + length > size:
            return f"{what}: an element at {offset}+{length} lies outside its {size} bytes"
    return None


def index_problem(handle: KeyGroupIndexedFile) -> str | None:
    """What is wrong with a key-group index: a group outside the handle's range, entries
    out of order, overlapping or beyond the end of the file."""
    previous_end = -1
    for group, offset, length in handle.key_groups:
        if group not in handle.key_group_range:
            return f"{handle.path}: key group {group} is outside its range"
        if offset < previous_end or length <= 0 or offset + length > handle.size:
            return f"{handle.path}: the index entry of key group {group} is out of order"
        previous_end = offset + length
    return None


def ack_problem(ack: SubtaskAck) -> str | None:
    """What is malformed in the subtask's handles (e.g. a file path leading outside its
    checkpoint), or None."""
    for file in ack.files():
        problem = _file_problem(file)
        if problem is not None:
            return problem
    keyed = ack.keyed
    for indexed in (keyed, ack.raw_keyed):
        if isinstance(indexed, (FullKeyedStateHandle, RawKeyedStateHandle)):
            problem = index_problem(indexed)
            if problem is not None:
                return problem
    if isinstance(keyed, IncrementalKeyedStateHandle):
        names = [f.name for f in (*keyed.shared, *keyed.private)]
        bad = [n for n in names if not is_plain_name(n)]
        if bad or len(set(names)) != len(names):
            return f"incremental handle has invalid or repeated file names {bad or names}"
        for native in (*keyed.shared, *keyed.private):
            if native.inline is None:
                continue
            if len(native.inline) != native.size:
                return (
                    f"inline file {native.name} has {len(native.inline)} bytes, not {native.size}"
                )
            if algorithm_of(native.checksum) is None:
                return f"inline file {native.name} has a malformed checksum {native.checksum!r}"
    handle = ack.operator_state
    if handle is not None:
        if handle.inline is None and handle.path is None:
            return "operator state has neither a file nor inline bytes"
        if handle.inline is not None and len(handle.inline) != handle.size:
            return f"inline operator state has {len(handle.inline)} bytes, not {handle.size}"
        if handle.size < 0 or algorithm_of(handle.checksum) is None:
            return "operator state has a negative size or a malformed checksum"
        for name, info in handle.states.items():
            problem = _spans_problem(info.elements, handle.size, f"operator state {name!r}")
            if problem is not None:
                return problem
        return _spans_problem(handle.raw, handle.size, "raw operator state")
    return None
