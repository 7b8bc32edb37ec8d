"""``statebackend gc``: files of a job that no completed checkpoint or savepoint uses.

Garbage is: files in a completed ``chk-<N>`` that its ``_metadata`` does not reference
(crashed or retried uploads, temp files, a left-over ``acks/``); every file of a
``chk-<N>`` without ``_metadata`` older than the newest completed checkpoint (aborted
attempts, late uploads); files in ``shared/`` that no completed checkpoint or savepoint
of the job references. A ``chk-<N>`` newer than the newest completed one may be pending
and is never touched; while one exists ``shared/`` is left alone too, since a pending
checkpoint may have uploaded shared files it does not reference yet. Savepoints and
savepoint requests are never garbage.
"""

from __future__ import annotations

import posixpath
from contextlib import suppress
from dataclasses import dataclass

from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.layout import (
    ACKS_DIR,
    METADATA_FILE,
    SAVEPOINTS_DIR,
    SHARED_DIR,
    checkpoint_ids,
    join,
)
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.storage import load_metadata
from statebackend.errors import CheckpointNotFoundError
from statebackend.snapshot.handles import normalize_path, resolve_path


@dataclass(frozen=True)
class Garbage:
    """An unreferenced file: its path, size in bytes, and why it is garbage."""

    path: str
    size: int
    reason: str


def _references(directory: str, metadata: CheckpointMetadata) -> set[str]:
    return {resolve_path(directory, relative) for relative, _, _ in metadata.files()}


def _files(fs: CheckpointFileSystem, directory: str) -> list[str]:
    """The files of a checkpoint directory: its entries, and those of its ``acks/``."""
    paths = []
    for name in fs.list_dir(directory):
        path = join(directory, name)
        paths += [join(path, a) for a in fs.list_dir(path)] if name == ACKS_DIR else [path]
    return paths


def find_garbage(fs: CheckpointFileSystem, job_dir: str) -> list[Garbage]:
    """The garbage files of the job in ``job_dir`` (see the module docstring)."""
    job_dir = job_dir.rstrip("/")
    ids = checkpoint_ids(fs.list_dir(job_dir))
    completed: dict[int, CheckpointMetadata] = {}
    for checkpoint_id in ids:
        with suppress(CheckpointNotFoundError):
            completed[checkpoint_id] = load_metadata(fs, join(job_dir, f"chk-{checkpoint_id}"))
    newest = max(completed, default=0)
    referenced: set[str] = set()
    for checkpoint_id, metadata in completed.items():
        referenced |= _references(join(job_dir, f"chk-{checkpoint_id}"), metadata)
    savepoints_dir = join(job_dir, SAVEPOINTS_DIR)
    for name in fs.list_dir(savepoints_dir):
        savepoint = join(savepoints_dir, name)
        with suppress(CheckpointNotFoundError):
            referenced |= _references(savepoint, load_metadata(fs, savepoint))
    candidates: list[tuple[str, str]] = []
    for checkpoint_id in ids:
        directory = join(job_dir, f"chk-{checkpoint_id}")
        if checkpoint_id in completed:
            keep = referenced | {join(directory, METADATA_FILE)}
            candidates += [
                (path, f"not referenced by chk-{checkpoint_id}/{METADATA_FILE}")
                for path in _files(fs, directory)
                if normalize_path(path) not in keep
            ]
        elif checkpoint_id < newest:
            candidates += [
                (path, f"chk-{checkpoint_id} never completed and chk-{newest} is newer")
                for path in _files(fs, directory)
            ]
    if not any(checkpoint_id > newest for checkpoint_id in ids):
        shared = join(job_dir, SHARED_DIR)
        candidates += [
            (join(shared, name), "shared file no completed checkpoint or savepoint uses")
            for name in fs.list_dir(shared)
            if normalize_path(join(shared, name)) not in referenced
        ]
    return [Garbage(path, fs.size(path), reason) for path, reason in candidates]


def delete_garbage(fs: CheckpointFileSystem, garbage: list[Garbage]) -> None:
    """Delete the given files, and the directories of never-completed checkpoints that
    are left empty."""
    directories = set()
    for item in garbage:
        fs.delete(item.path)
        directory = posixpath.dirname(item.path)
        directories.add(directory)
        if posixpath.basename(directory) == ACKS_DIR:
            directories.add(posixpath.dirname(directory))
    for directory in sorted(directories, reverse=True):
        if not fs.list_dir(directory):
            fs.delete(directory, recursive=True)
