"""Opening what a command names: a storage location, or a checkpoint or savepoint in it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statebackend.checkpoint.filesystem import (
    CheckpointFileSystem,
    normalize_url,
    open_filesystem,
)
from statebackend.checkpoint.layout import METADATA_FILE
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.signing import SigningKey, VerifiedReads
from statebackend.checkpoint.storage import load_metadata

_LOCAL_PROTOCOLS = ("file", "local")


def open_location(url: str, storage_options: dict[str, Any] | None = None) -> CheckpointFileSystem:
    """The file system of ``url`` (any fsspec URL or a local path).

    ``storage_options`` apply to remote protocols only, so one set of options serves a
    command that reads from s3 and writes to a local directory.
    """
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    return open_filesystem(url, None if protocol in _LOCAL_PROTOCOLS else storage_options)


@dataclass(frozen=True)
class CheckpointRef:
    """A completed checkpoint or savepoint: its file system, directory and metadata, and
    the key it was checked with (then ``fs`` serves only checked bytes of its files)."""

    fs: CheckpointFileSystem
    directory: str
    metadata: CheckpointMetadata
    signing_key: SigningKey | None = None


def checkpoint_directory(url: str) -> str:
    """The directory (normalized) of a checkpoint given by its directory or its
    ``_metadata`` file."""
    path = normalize_url(url)
    if path.endswith("/" + METADATA_FILE):
        path = path[: -len(METADATA_FILE) - 1]
    return path


def open_checkpoint(
    url: str,
    storage_options: dict[str, Any] | None = None,
    signing_key: SigningKey | None = None,
) -> CheckpointRef:
    """The completed checkpoint or savepoint at ``url``, its ``_metadata`` checked.

    With ``signing_key`` it must be signed with that key, and reads of its files return
    only bytes that match their signed digests (``signing.VerifiedReads``). Raises
    CheckpointNotFoundError if it has no ``_metadata``, CheckpointCorruptedError if the
    metadata is invalid or its signature does not match.
    """
    fs = open_location(url, storage_options)
    directory = checkpoint_directory(url)
    metadata = load_metadata(fs, directory, signing_key)
    if signing_key is not None:
        fs = VerifiedReads(fs, directory, metadata.files())
    return CheckpointRef(fs, directory, metadata, signing_key)
