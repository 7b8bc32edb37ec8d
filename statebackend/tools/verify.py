"""``statebackend verify``: every file a checkpoint references is there and intact."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from statebackend.checkpoint.layout import join, metadata_path
from statebackend.checkpoint.savepoints import Progress
from statebackend.checksums import checksum
from statebackend.errors import CheckpointError
from statebackend.snapshot.handles import resolve_path
from statebackend.snapshot.keyed_format import KeyedStateHandle
from statebackend.snapshot.operator_format import OperatorStateHandle, Span
from statebackend.snapshot.raw_keyed_format import RawKeyedStateHandle
from statebackend.tools.location import CheckpointRef


@dataclass(frozen=True)
class Problem:
    """A file (or inline blob) that fails verification, and why."""

    path: str
    message: str


def referenced_bytes(ref: CheckpointRef) -> int:
    """The bytes of all files the checkpoint references (what ``verify`` reads)."""
    return sum(size for _, size, _ in ref.metadata.files())


def _keyed_index_problems(
    where: str, handle: KeyedStateHandle | RawKeyedStateHandle
) -> list[Problem]:
    return [
        Problem(where, f"{where}: key group {group} lies beyond the end of the file")
        for group, offset, length in handle.key_groups
        if offset + length > handle.size
    ]


def _span_problems(where: str, handle: OperatorStateHandle) -> list[Problem]:
    """Spans beyond the blob; for inline blobs also each element's and the blob's crc."""
    spans: list[tuple[str, Span]] = [
        (name, span) for name, info in handle.states.items() for span in info.elements
    ]
    spans += [("raw state", span) for span in handle.raw]
    problems = []
    blob = handle.inline
    if blob is not None and (len(blob) != handle.size or checksum(blob) != handle.checksum):
        problems.append(Problem(where, f"{where}: size or checksum mismatch"))
    for name, (offset, length, crc) in spans:
        if offset + length > handle.size:
            problems.append(Problem(where, f"{where}: an element of {name!r} lies beyond the end"))
        elif blob is not None and zlib.crc32(blob[offset : offset + length]) != crc:
            problems.append(Problem(where, f"{where}: checksum mismatch in an element of {name!r}"))
    return problems


def verify_checkpoint(ref: CheckpointRef, progress: Progress | None = None) -> list[Problem]:
    """The problems of the checkpoint: missing, truncated or corrupted files, shared ones
    included (checked by size and checksum, reading each file whole), state-handle
    indexes (keyed and raw keyed) pointing beyond their files, and inline operator state
    failing its checksums. Empty if all is well."""
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
            if isinstance(ack.keyed, KeyedStateHandle):
                where = join(ref.directory, ack.keyed.path)
                problems += _keyed_index_problems(where, ack.keyed)
            if ack.raw_keyed is not None:
                where = join(ref.directory, ack.raw_keyed.path)
                problems += _keyed_index_problems(where, ack.raw_keyed)
            handle = ack.operator_state
            if handle is not None:
                where = (
                    join(ref.directory, handle.path)
                    if handle.path is not None
                    else f"{metadata_path(ref.directory)} (inline operator state of "
                    f"{operator_id} subtask {ack.subtask})"
                )
                problems += _span_problems(where, handle)
    return problems
