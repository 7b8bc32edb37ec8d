"""Raw keyed state: opaque bytes an operator writes per key group of its range.

Flink's raw keyed state: at a snapshot the operator writes one stream per key group it
owns; on restore each subtask reads the streams of exactly its key groups, whichever old
subtasks held them. The bytes are the operator's own business: they are carried through
checkpoints untouched, moved on rescale by key group, and never decoded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from statebackend.errors import SerializationError, StateAccessError
from statebackend.keygroups import KeyGroupRange


@dataclass(frozen=True)
class RawKeyedStateCut:
    """An immutable copy of one subtask's raw keyed state: bytes by key group."""

    key_group_range: KeyGroupRange
    streams: Mapping[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "streams", MappingProxyType(dict(sorted(self.streams.items()))))


class RawKeyedState:
    """One subtask's raw keyed state: a stream of bytes per key group of its range.

    ``write`` replaces a key group's stream, ``read`` returns it; ``sync_cut`` freezes all
    of them for a snapshot (bytes are immutable, so later writes do not show in it).
    """

    def __init__(self, key_group_range: KeyGroupRange, restored: RawKeyedStateCut | None = None):
        self.key_group_range = key_group_range
        self._is_restored = restored is not None
        self._streams: dict[int, bytes] = {}
        if restored is not None:
            self._streams = {g: s for g, s in restored.streams.items() if g in key_group_range}

    @property
    def is_restored(self) -> bool:
        """Whether this state was created from a checkpoint (even an empty share of one)."""
        return self._is_restored

    def write(self, key_group: int, data: bytes) -> None:
        """Make ``data`` the stream of ``key_group`` (empty bytes remove it).

        StateAccessError for a key group outside the range, SerializationError for
        anything but bytes.
        """
        if key_group not in self.key_group_range:
            raise StateAccessError(
                f"key group {key_group} is outside this subtask's key-group range "
                f"{self.key_group_range.start}..{self.key_group_range.end}: write raw keyed "
                f"state only for the key groups the subtask owns"
            )
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise SerializationError(
                f"raw keyed state of key group {key_group} must be bytes, not "
                f"{type(data).__name__}: encode it first"
            )
        if data:
            self._streams[key_group] = bytes(data)
        else:
            self._streams.pop(key_group, None)

    def read(self, key_group: int) -> bytes:
        """The stream of ``key_group`` (empty bytes when it has none)."""
        return self._streams.get(key_group, b"")

    def key_groups(self) -> Iterator[int]:
        """The key groups that have a stream, ascending."""
        return iter(sorted(self._streams))

    def sync_cut(self) -> RawKeyedStateCut:
        """An immutable copy of every stream, for a snapshot."""
        return RawKeyedStateCut(self.key_group_range, self._streams)
