"""Savepoints: self-contained, relocatable copies of completed checkpoints."""

from __future__ import annotations

import dataclasses
import json
import posixpath
from collections.abc import Callable, Iterator
from contextlib import suppress

from statebackend.checkpoint.filesystem import CheckpointFileSystem, normalize_url
from statebackend.checkpoint.layout import join, metadata_path
from statebackend.checkpoint.signing import SigningKey
from statebackend.checkpoint.storage import load_metadata
from statebackend.errors import (
    MALFORMED_DOCUMENT,
    CheckpointCorruptedError,
    CheckpointError,
)
from statebackend.snapshot.handles import resolve_path

_COPY_CHUNK = 4 << 20
COPYING_FILE = "_copying"
"""Written into a savepoint directory before a copy's first file, removed after its
``_metadata``: the files the copy writes, so that the next copy there removes them if the
process copying was killed."""

Progress = Callable[[int], None]
"""Called with the number of bytes just copied."""


def _chunks(fs: CheckpointFileSystem, path: str) -> Iterator[bytes]:
    stream = fs.open_read(path)
    try:
        while chunk := stream.read(_COPY_CHUNK):
            yield chunk
    finally:
        stream.close()


def _inside(relative: str) -> str:
    """Where a referenced file goes in a savepoint: where it was, except that files outside
    the checkpoint directory move in (``../shared/x`` becomes ``shared/x``)."""
    parts = posixpath.normpath(relative).split("/")
    while parts[0] == "..":
        parts.pop(0)
    return "/".join(parts)


def copy_checkpoint(
    source_fs: CheckpointFileSystem,
    source_dir: str,
    target_fs: CheckpointFileSystem,
    target_dir: str,
    progress: Progress | None = None,
    signing_key: SigningKey | None = None,
) -> str:
    """Copy the completed checkpoint (or savepoint) in ``source_dir`` to a savepoint.

    Every referenced file is copied and checked against its recorded size and checksum
    (an incremental checkpoint's shared files into the savepoint's own ``shared/``, the
    handles rewritten to match), then ``_metadata`` (marked as a savepoint) is written
    last, so an interrupted copy is never mistaken for a savepoint; a copy that fails or is
    interrupted (KeyboardInterrupt) deletes what it wrote (``target_dir`` itself if it was
    empty), so that it can be run again into the same directory; what a copy whose process
    was killed wrote (``COPYING_FILE`` lists it) is deleted before copying. The result restores
    from wherever it is moved to. With ``signing_key`` the source must be signed with
    it and the savepoint is signed with it too; without, the savepoint is not signed.
    Returns ``target_dir`` (normalized); raises CheckpointError if it already holds a
    savepoint, or if a copied file would land on the file it is copied from (``target_dir``
    is the job directory of an incremental checkpoint, whose ``../shared/x`` goes to
    ``shared/x``).
    """
    target_dir = normalize_url(target_dir)
    metadata = load_metadata(source_fs, source_dir, signing_key)
    if target_fs.exists(metadata_path(target_dir)):
        raise CheckpointError(
            f"{target_dir} already holds a checkpoint or savepoint: choose an empty directory"
        )
    copies = [
        (resolve_path(source_dir, relative), join(target_dir, _inside(relative)), size, checksum)
        for relative, size, checksum in metadata.files()
    ]
    if source_fs.fsspec.protocol == target_fs.fsspec.protocol:
        for source, target, _, _ in copies:
            if target_fs.same_path(source, target):  # writing it would truncate what it reads
                raise CheckpointError(
                    f"copying {source_dir} to {target_dir} would overwrite its own file "
                    f"{source}: choose another directory, e.g. <job dir>/savepoints/<name>"
                )
    # on one storage (also opened twice, as the command does) a copy is server-side: the
    # bytes pass through this process only between storages
    same_storage = source_fs.same_storage(target_fs)
    remove_killed_copy(target_fs, target_dir)
    was_empty = not target_fs.list_dir(target_dir)
    written: list[str] = []
    try:
        names = [_inside(relative) for relative, _, _ in metadata.files()]
        plan = {"was_empty": was_empty, "files": names}
        target_fs.write_atomic(join(target_dir, COPYING_FILE), json.dumps(plan).encode())
        for source, target, size, checksum in copies:
            written.append(target)
            if same_storage:
                source_fs.copy(source, target)
            else:
                target_fs.write_file(target, _chunks(source_fs, source))
            target_fs.verify(target, size, checksum)
            if progress is not None:
                progress(size)
        savepoint = dataclasses.replace(metadata.with_keyed_paths(_inside), is_savepoint=True)
        target_fs.write_atomic(metadata_path(target_dir), savepoint.to_bytes(signing_key))
    except BaseException:  # an error, Ctrl-C: what was copied is no savepoint
        _remove_copied(target_fs, target_dir, written, was_empty)
        raise
    with suppress(Exception):  # the savepoint is complete: a marker left is only a file
        target_fs.delete(join(target_dir, COPYING_FILE))
    return target_dir


def remove_killed_copy(fs: CheckpointFileSystem, target_dir: str) -> None:
    """Delete what a copy into ``target_dir`` that was killed midway (its process ended
    before it completed or cleaned up: ``COPYING_FILE`` and no ``_metadata``) wrote there,
    file by file, its marker last: ``target_dir`` itself if it was empty before."""
    marker = join(target_dir, COPYING_FILE)
    if not fs.exists(marker):
        return
    try:
        plan = json.loads(fs.read_file(marker))
        files, was_empty = [str(f) for f in plan["files"]], bool(plan["was_empty"])
    except MALFORMED_DOCUMENT as exc:
        raise CheckpointCorruptedError(
            f"{marker} (left by a savepoint copy or write that did not complete) is unreadable: "
            f"{exc}; delete what that copy wrote into {target_dir}, then the marker"
        ) from exc
    for name in files:
        if name == _inside(name) and not posixpath.isabs(name) and name != ".":
            fs.delete(join(target_dir, name))  # a name a copy writes: inside target_dir
    fs.delete(marker)
    if was_empty:
        fs.delete(target_dir, recursive=True)


def _remove_copied(
    fs: CheckpointFileSystem, target_dir: str, written: list[str], was_empty: bool
) -> None:
    """Delete what a copy that did not complete wrote: ``target_dir`` itself if it was
    empty before (unless another copy completed a savepoint there meanwhile), else the
    files it wrote. Failures to delete are left unsaid: the copy's own error is raised."""
    with suppress(Exception):
        if fs.exists(metadata_path(target_dir)):
            return
        if was_empty:
            fs.delete(target_dir, recursive=True)
            return
        for path in written:
            fs.delete(path)
        fs.delete(join(target_dir, COPYING_FILE))
