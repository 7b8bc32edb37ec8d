"""Keyed state handles of either format: parsing them and reading their entries."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from statebackend.backends.stores import Entry
from statebackend.errors import CheckpointCorruptedError
from statebackend.keygroups import KeyGroupRange
from statebackend.snapshot.handles import resolve_path
from statebackend.snapshot.incremental import (
    IncrementalFileSystem,
    IncrementalKeyedStateHandle,
    read_incremental_entries,
    read_incremental_runs,
)
from statebackend.snapshot.keyed_format import (
    FullKeyedStateHandle,
    read_composite_runs,
    read_keyed_entries,
)

KeyedHandle = FullKeyedStateHandle | IncrementalKeyedStateHandle
"""A keyed state handle: full (one file, key-group index) or incremental (RocksDB files)."""

_TYPES: dict[str, Callable[[dict[str, Any]], KeyedHandle]] = {
    "keyed-full": FullKeyedStateHandle.from_json,
    "keyed-incremental": IncrementalKeyedStateHandle.from_json,
}


def keyed_handle_from_json(data: dict[str, Any]) -> KeyedHandle:
    """The keyed handle of ``data`` (a handle's ``to_json``), by its ``type``."""
    parse = _TYPES.get(data.get("type", "keyed-full"))
    if parse is None:
        raise CheckpointCorruptedError(f"unknown keyed state handle type {data.get('type')!r}")
    return parse(data)


def read_keyed_handle(
    fs: IncrementalFileSystem,
    directory: str,
    handle: KeyedHandle,
    key_groups: KeyGroupRange,
    *,
    read_range: Callable[[str, int, int], bytes],
    local_dir: Path | None = None,
) -> Iterator[tuple[str, int, Entry]]:
    """(state name, key group, entry) of the key groups of ``handle`` in ``key_groups``,
    its files being relative to ``directory``: ranged reads (``read_range``) of a full
    snapshot, a download (into ``local_dir``) of an incremental one."""
    if isinstance(handle, IncrementalKeyedStateHandle):
        return read_incremental_entries(fs, directory, handle, key_groups, local_dir)
    return read_keyed_entries(read_range, resolve_path(directory, handle.path), handle, key_groups)


def read_keyed_runs(
    fs: IncrementalFileSystem,
    directory: str,
    handle: KeyedHandle,
    key_groups: KeyGroupRange,
    *,
    read_range: Callable[[str, int, int], bytes],
    local_dir: Path | None = None,
) -> Iterator[tuple[str, int, list[tuple[bytes, bytes]]]]:
    """(state name, key group, its (composite key, value) pairs) of the key groups of
    ``handle`` in ``key_groups``, each state's pairs in composite-key order: what
    ``read_keyed_handle`` reads, as a RocksDB backend bulk-loads it."""
    if isinstance(handle, IncrementalKeyedStateHandle):
        return read_incremental_runs(fs, directory, handle, key_groups, local_dir)
    return read_composite_runs(read_range, resolve_path(directory, handle.path), handle, key_groups)
