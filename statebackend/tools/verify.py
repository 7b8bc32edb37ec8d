"""``statebackend verify``: every file a checkpoint references is there and intact."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from statebackend.checkpoint.layout import metadata_path
from statebackend.checkpoint.savepoints import Progress
from statebackend.checksums import checksum
from statebackend.errors import CheckpointError
from statebackend.snapshot.handles import resolve_path
from statebackend.snapshot.incremental import IncrementalKeyedStateHandle
from statebackend.snapshot.operator_format import OperatorStateHandle, Span
from statebackend.tools.location import CheckpointRef


@dataclass(frozen=True)
class Problem:
    """A file (or inline blob) that fails verification, and why."""

    path: str
    message: str


def referenced_bytes(ref: CheckpointRef) -> int:
    """The bytes of all files the checkpoint references (what ``verify`` reads)."""
    return sum(size for _, size, _ in ref.metadata.files())


def _inline_problems(where: str, blob: bytes, handle: OperatorStateHandle) -> list[Problem]:
    """The blob's and each element's checksum (``_metadata`` was checked on load: every
    span lies inside the blob)."""
    spans: list[tuple[str, Span]] = [
        (name, span) for name, info in handle.states.items() for span in info.elements
    ]
    spans += [("raw state", span) for span in handle.raw]
    problems = []
    if checksum(blob) != handle.checksum:
        problems.append(Problem(where, f"{where}: checksum mismatch"))
    for name, (offset, length, crc) in spans:
        if zlib.crc32(blob[offset : offset + length]) != crc:
            problems.append(Problem(where, f"{where}: checksum mismatch in an element of {name!r}"))
    return problems


def verify_checkpoint(ref: CheckpointRef, progress: Progress | None = None) -> list[Problem]:
    """The problems of the checkpoint: missing, truncated or corrupted files, shared ones
    included (checked by size and checksum, reading each file whole), and inline operator
    state and native checkpoint files failing their checksums. Empty if all is well.
    (Handles pointing beyond their files were refused when ``_metadata`` was loaded.)"""
    problems: list[Problem] = []
    for relative, size, expected in ref.metadata.files():
        path = resolve_path(ref.directory, relative)
        try:
            ref.fs.verify(path, size, expected)
        except CheckpointError as exc:
            problems.append(Problem(path, str(exc)))
        if progress is not None:
            progress(size)
    for operator_id, snapshot in sorted(ref.metadata.operators.items()):
        for ack in snapshot.subtasks:
            handle = ack.operator_state
            if handle is not None and handle.inline is not None:
                where = (
                    f"{metadata_path(ref.directory)} (inline operator state of "
                    f"{operator_id} subtask {ack.subtask})"
                )
                problems += _inline_problems(where, handle.inline, handle)
            keyed = ack.keyed
            native = keyed.private if isinstance(keyed, IncrementalKeyedStateHandle) else ()
            for file in native:
                if not file.inline_intact():
                    where = (
                        f"{metadata_path(ref.directory)} (inline file {file.name} of "
                        f"{operator_id} subtask {ack.subtask})"
                    )
                    problems.append(Problem(where, f"{where}: checksum mismatch"))
    return problems
