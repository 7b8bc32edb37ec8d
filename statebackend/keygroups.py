"""Key groups: the unit in which keyed state moves between subtasks.

The formulas are Flink's (``KeyGroupRangeAssignment``), except that the hash is an
unsigned 32-bit murmur3 of the key serializer's bytes, which is stable across
processes, machines, Python versions and ``PYTHONHASHSEED``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import mmh3

from statebackend.errors import ConfigurationError

UPPER_BOUND_MAX_PARALLELISM = 1 << 15
"""The largest max parallelism (number of key groups): 32768, as in Flink."""

DEFAULT_LOWER_BOUND_MAX_PARALLELISM = 128


def check_max_parallelism(max_parallelism: int) -> None:
    """Raise ConfigurationError unless 1 <= max_parallelism <= 32768."""
    if not isinstance(max_parallelism, int) or not (
        1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM
    ):
        raise ConfigurationError(
            f"max parallelism {max_parallelism!r} is out of range: "
            f"it must be an integer from 1 to {UPPER_BOUND_MAX_PARALLELISM}"
        )


def require_parallelism(parallelism: int) -> int:
    """``parallelism``, or ConfigurationError unless it is an integer >= 1."""
    if not isinstance(parallelism, int) or isinstance(parallelism, bool) or parallelism < 1:
        raise ConfigurationError(
            f"parallelism {parallelism!r} is invalid: it must be an integer >= 1"
        )
    return parallelism


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    """Raise ConfigurationError unless 1 <= parallelism <= max_parallelism (valid M)."""
    check_max_parallelism(max_parallelism)
    require_parallelism(parallelism)
    if parallelism > max_parallelism:
        raise ConfigurationError(
            f"parallelism {parallelism} exceeds max parallelism {max_parallelism}: "
            f"lower the parallelism or start a new job with a larger max parallelism"
        )


def stable_hash(key_bytes: bytes) -> int:
    """Unsigned 32-bit murmur3 (seed 0) of the serialized key."""
    return mmh3.hash(key_bytes, 0, signed=False)


def assign_to_key_group(key_bytes: bytes, max_parallelism: int) -> int:
    """The key group (0 <= g < max_parallelism) of a serialized key."""
    return mmh3.hash(key_bytes, 0, signed=False) % max_parallelism


def compute_key_group_range_for_operator_index(
    max_parallelism: int, parallelism: int, operator_index: int
) -> KeyGroupRange:
    """The contiguous key-group range owned by subtask ``operator_index`` of ``parallelism``."""
    check_parallelism(parallelism, max_parallelism)
    if not 0 <= operator_index < parallelism:
        raise ConfigurationError(
            f"subtask index {operator_index} is out of range for parallelism {parallelism}"
        )
    start = (operator_index * max_parallelism + parallelism - 1) // parallelism
    end = ((operator_index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def compute_operator_index_for_key_group(
    max_parallelism: int, parallelism: int, key_group: int
) -> int:
    """The subtask index that owns ``key_group`` at ``parallelism``."""
    return key_group * parallelism // max_parallelism


def compute_default_max_parallelism(parallelism: int) -> int:
    """Flink's default: next power of two of 1.5 * P, clamped to [128, 32768]."""
    require_parallelism(parallelism)
    wanted = parallelism + parallelism // 2
    power = 1 << (wanted - 1).bit_length() if wanted > 1 else 1
    return min(max(power, DEFAULT_LOWER_BOUND_MAX_PARALLELISM), UPPER_BOUND_MAX_PARALLELISM)


@dataclass(frozen=True)
class KeyGroupRange:
    """An inclusive range of key groups ``start..end``; empty when ``end < start``."""

    start: int
    end: int

    @classmethod
    def empty(cls) -> KeyGroupRange:
        """The empty range."""
        return cls(0, -1)

    def __len__(self) -> int:
        return max(0, self.end - self.start + 1)

    def __bool__(self) -> bool:
        return self.end >= self.start

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        """The key groups in both ranges (possibly empty)."""
        start, end = max(self.start, other.start), min(self.end, other.end)
        return KeyGroupRange(start, end) if start <= end else KeyGroupRange.empty()

    def to_json(self) -> list[int]:
        """``[start, end]`` for metadata files."""
        return [self.start, self.end]

    @classmethod
    def from_json(cls, value: list[int]) -> KeyGroupRange:
        """The inverse of ``to_json``."""
        return cls(int(value[0]), int(value[1]))
