"""What every state handle offers, whatever its format: the named contracts
(``KeyedHandle``, ``OperatorHandle``), the parts of a keyed handle's JSON that describe the
state (key-group range, states, key serializer), the files it references, and the one
file with a key-group index that the full keyed, raw keyed and changelog formats share
(``KeyGroupIndexedFile``).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

from statebackend.backends.keyed import StateMetaInfo
from statebackend.backends.stores import Entry
from statebackend.backends.timers import TimerSnapshotInfo
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import SerializerConfig
from statebackend.serializers.base import config_problem

Relocate = Callable[[str], str]
"""Maps a handle's stored path to another (a savepoint copy, a moved directory)."""

ReadRange = Callable[[str, int, int], bytes]
"""``read_range(path, start, length)``: the bytes of a ranged read of a stored file."""

IndexedFileT = TypeVar("IndexedFileT", bound="KeyGroupIndexedFile")

INLINE_LIMIT = 20 * 1024
"""State smaller than this (bytes) is kept inside its handle, so in ``_metadata``,
instead of a file of its own: an operator-state blob, a native checkpoint's small files
(Flink's ``state.storage.fs.memory-threshold``)."""

KeyGroupIndex = tuple[tuple[int, int, int], ...]
"""``(key group, offset, length)`` of the key groups that have bytes in a file, in order."""


class StoredFile(NamedTuple):
    """A file a handle references: its path (relative to the directory that holds
    ``_metadata``), its size in bytes and its checksum."""

    path: str
    size: int
    checksum: str


def normalize_path(path: str) -> str:
    """``path`` with ``.`` and ``..`` resolved (after any ``scheme://``)."""
    scheme, sep, rest = path.rpartition("://")
    return f"{scheme}{sep}{posixpath.normpath(rest)}"


def resolve_path(directory: str, relative: str) -> str:
    """The path of a file a handle references: ``relative`` (which may climb out with
    ``..``, e.g. ``../shared/x``) taken from ``directory``."""
    return normalize_path(f"{directory.rstrip('/')}/{relative}")


def keyed_state_json(
    key_group_range: KeyGroupRange,
    states: tuple[StateMetaInfo, ...],
    key_serializer: SerializerConfig,
    timers: TimerSnapshotInfo | None = None,
) -> dict[str, Any]:
    """The JSON of what a keyed handle holds, shared by every keyed format (``timers``
    only when known: handles written before timers existed have none)."""
    document: dict[str, Any] = {
        "key_group_range": key_group_range.to_json(),
        "states": [meta.to_json() for meta in states],
        "key_serializer": key_serializer,
    }
    if timers is not None:
        document["timers"] = timers.to_json()
    return document


def keyed_state_from_json(data: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``keyed_state_json``, as keyword arguments of a handle."""
    problem = config_problem(data["key_serializer"])
    if problem is not None:
        raise TypeError(f"key serializer: {problem}")
    return {
        "key_group_range": KeyGroupRange.from_json(data["key_group_range"]),
        "states": tuple(StateMetaInfo.from_json(m) for m in data["states"]),
        "key_serializer": data["key_serializer"],
        "timers": TimerSnapshotInfo.from_json(data["timers"]) if "timers" in data else None,
    }


class SnapshotFileSystem(Protocol):
    """What reading and writing snapshot files needs of a file system
    (``checkpoint.filesystem``)."""

    checksum_algorithm: str
    """The algorithm of the checksums of the files it writes (``checksums.py``)."""

    def write_file(
        self, path: str, chunks: Iterable[bytes], *, should_stop: Callable[[], bool] | None = None
    ) -> Any:
        """Stream chunks to a new file; return an object with ``size`` and ``checksum``;
        leave nothing behind if stopped or failed."""

    def open_read(self, path: str) -> Any:
        """A binary stream of ``path``."""

    def delete(self, path: str, recursive: bool = False) -> None:
        """Delete ``path``; not an error if it does not exist."""


@dataclass(frozen=True)
class HandleFiles:
    """Where a restore reads a handle's files from: the file system, the directory the
    handle's paths are relative to, how ranged reads are made (``read_range``, e.g. one
    that counts bytes) and where downloads go (``local_dir``; None: the system's temp)."""

    fs: SnapshotFileSystem
    directory: str
    read_range: ReadRange
    local_dir: Path | None = None

    def path_of(self, relative: str) -> str:
        """The full path of a file a handle references."""
        return resolve_path(self.directory, relative)


class KeyedHandle(Protocol):
    """What every keyed state handle offers, whatever its format (full, incremental):
    the key groups and states it holds, its files, and how to read them back."""

    @property
    def key_group_range(self) -> KeyGroupRange:
        """The key groups of the subtask that wrote it."""

    @property
    def states(self) -> tuple[StateMetaInfo, ...]:
        """The meta info of every state it holds."""

    @property
    def key_serializer(self) -> SerializerConfig:
        """The configuration of the serializer its keys were written with."""

    @property
    def timers(self) -> TimerSnapshotInfo | None:
        """The subtask's timer clocks (None in handles written before timers existed)."""

    @property
    def size(self) -> int:
        """Bytes of all its files."""

    def files(self) -> list[StoredFile]:
        """Every file the handle references."""

    def bytes_for(self, key_groups: KeyGroupRange) -> int:
        """How many bytes a restore of ``key_groups`` reads."""

    def with_paths(self, relocate: Relocate) -> KeyedHandle:
        """The same handle with every file's path mapped by ``relocate``."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for ``_metadata``, with its ``type``."""

    def read_entries(
        self, files: HandleFiles, key_groups: KeyGroupRange
    ) -> Iterator[tuple[str, int, Entry]]:
        """(state name, key group, entry) of its key groups in ``key_groups``."""

    def read_runs(
        self, files: HandleFiles, key_groups: KeyGroupRange
    ) -> Iterator[tuple[str, int, list[tuple[bytes, bytes]]]]:
        """(state name, key group, its (composite key, value) pairs) of its key groups in
        ``key_groups``, each state's pairs in composite-key order: what ``read_entries``
        reads, as a RocksDB backend bulk-loads it."""


class OperatorHandle(Protocol):
    """What every operator state handle offers: a stored file (``path`` None when the
    state is kept inline), its size and checksum, and its JSON form."""

    @property
    def path(self) -> str | None:
        """The file, relative to the checkpoint directory; None when inline."""

    @property
    def size(self) -> int:
        """Bytes of the state."""

    @property
    def checksum(self) -> str:
        """The checksum of those bytes."""

    def stored_size(self) -> int:
        """Bytes stored in a file for this handle (0 when inlined)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for ``_metadata``, with its ``type``."""


@dataclass(frozen=True)
class KeyGroupIndexedFile:
    """A handle whose bytes are one file of checksummed frames (``path``, ``size``,
    ``checksum``; ``path`` None when there are no bytes) compressed with ``compression``,
    holding key groups of ``key_group_range``, with an index ``key_groups`` of where each
    key group's frames are: the base of the full keyed, raw keyed and changelog handles."""

    path: str | None
    size: int
    checksum: str
    key_group_range: KeyGroupRange
    key_groups: KeyGroupIndex
    compression: str

    def bytes_for(self, key_groups: KeyGroupRange) -> int:
        """How many bytes of the file hold the given key groups."""
        return sum(length for group, _, length in self.key_groups if group in key_groups)

    def files(self) -> list[StoredFile]:
        """The one file of the handle (none without a file)."""
        return [] if self.path is None else [StoredFile(self.path, self.size, self.checksum)]

    def with_paths(self: IndexedFileT, relocate: Relocate) -> IndexedFileT:
        """The same handle with its file's path mapped by ``relocate``."""
        path = None if self.path is None else relocate(self.path)
        return replace(self, path=path)

    def indexed_file_json(self) -> dict[str, Any]:
        """The JSON of the file and its index (part of the handle's ``to_json``; the
        key-group range is the handle's to write)."""
        return {
            "path": self.path,
            "size": self.size,
            "checksum": self.checksum,
            "key_groups": [list(item) for item in self.key_groups],
            "compression": self.compression,
        }


def indexed_file_from_json(data: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``KeyGroupIndexedFile.indexed_file_json``, as keyword arguments of
    a handle."""
    path = data["path"]
    return {
        "path": None if path is None else str(path),
        "size": int(data["size"]),
        "checksum": str(data["checksum"]),
        "key_groups": tuple((int(g), int(o), int(n)) for g, o, n in data["key_groups"]),
        "compression": str(data.get("compression", "none")),
    }
