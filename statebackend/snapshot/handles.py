"""What every keyed state handle has, whatever its format: the parts of its JSON that
describe the state (key-group range, states, key serializer) and the files it references.
"""

from __future__ import annotations

import posixpath
from typing import Any, NamedTuple

from statebackend.backends.keyed import StateMetaInfo
from statebackend.backends.timers import TimerSnapshotInfo
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import SerializerConfig


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
    return {
        "key_group_range": KeyGroupRange.from_json(data["key_group_range"]),
        "states": tuple(StateMetaInfo.from_json(m) for m in data["states"]),
        "key_serializer": data["key_serializer"],
        "timers": TimerSnapshotInfo.from_json(data["timers"]) if "timers" in data else None,
    }
