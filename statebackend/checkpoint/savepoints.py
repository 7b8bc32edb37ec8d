"""Savepoints: self-contained, relocatable copies of completed checkpoints."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.layout import join, metadata_path
from statebackend.checkpoint.storage import load_metadata
from statebackend.errors import CheckpointError

_COPY_CHUNK = 4 << 20

Progress = Callable[[int], None]
"""Called with the number of bytes just copied."""


def _chunks(fs: CheckpointFileSystem, path: str) -> Iterator[bytes]:
    stream = fs.open_read(path)
    try:
        while chunk := stream.read(_COPY_CHUNK):
            yield chunk
    finally:
        stream.close()


def copy_checkpoint(
    source_fs: CheckpointFileSystem,
    source_dir: str,
    target_fs: CheckpointFileSystem,
    target_dir: str,
    progress: Progress | None = None,
) -> str:
    """Copy the completed checkpoint (or savepoint) in ``source_dir`` to a savepoint.

    Every referenced file is copied and checked against its recorded size and checksum,
    then ``_metadata`` (marked as a savepoint) is written last, so an interrupted copy is
    never mistaken for a savepoint. The result restores from wherever it is moved to.
    Returns ``target_dir``; raises CheckpointError if it already holds a savepoint.
    """
    metadata = load_metadata(source_fs, source_dir)
    if target_fs.exists(metadata_path(target_dir)):
        raise CheckpointError(
            f"{target_dir} already holds a checkpoint or savepoint: choose an empty directory"
        )
    for relative, size, checksum in metadata.files():
        source, target = join(source_dir, relative), join(target_dir, relative)
        if source_fs is target_fs:
            source_fs.copy(source, target)
        else:
            target_fs.write_file(target, _chunks(source_fs, source))
        target_fs.verify(target, size, checksum)
        if progress is not None:
            progress(size)
    savepoint = dataclasses.replace(metadata, is_savepoint=True)
    target_fs.write_atomic(metadata_path(target_dir), savepoint.to_bytes())
    return target_dir
