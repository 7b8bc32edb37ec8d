"""Timers as a keyed function sees them: Flink's ``TimerService`` for one keyed backend.

A timer is a (key, timestamp) pair in one of two time domains: event time (fired when the
watermark passes it) and processing time (fired when the processing-time clock passes
it). Timers are registered, deleted and listed for the backend's current key; firing
calls ``on_timer(key, timestamp)`` with that key set as the current key, so the callback
reads and writes the key's state. Timestamps are int milliseconds (signed 64-bit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

MIN_TIMESTAMP = -(2**63)
"""The smallest timestamp (Java's ``Long.MIN_VALUE``): the watermark and processing time
of a backend before anything advanced them."""

MAX_TIMESTAMP = 2**63 - 1
"""The largest timestamp (Java's ``Long.MAX_VALUE``)."""

TIMER_STATE_PREFIX = "_timers."
"""State names starting with this hold a backend's timers; no user state may take them."""

OnTimer = Callable[[Any, int], None]
"""``on_timer(key, timestamp)``: called for each fired timer, the key being current."""


def is_timer_state(name: str) -> bool:
    """Whether state ``name`` is one of the timer stores of a keyed backend."""
    return name.startswith(TIMER_STATE_PREFIX)


class TimerService(Protocol):
    """Event-time and processing-time timers of one keyed backend.

    Registering a timer that exists keeps one; deleting one that does not exist does
    nothing. A fired timer is removed. Timers stay when the key's state is cleared.
    """

    def register_event_time_timer(self, timestamp: int) -> None:
        """Register an event-time timer at ``timestamp`` for the current key."""

    def register_processing_time_timer(self, timestamp: int) -> None:
        """Register a processing-time timer at ``timestamp`` for the current key."""

    def delete_event_time_timer(self, timestamp: int) -> None:
        """Delete the current key's event-time timer at ``timestamp``, if it exists."""

    def delete_processing_time_timer(self, timestamp: int) -> None:
        """Delete the current key's processing-time timer at ``timestamp``, if it exists."""

    def event_time_timers(self) -> Iterator[int]:
        """The current key's event-time timer timestamps, ascending."""

    def processing_time_timers(self) -> Iterator[int]:
        """The current key's processing-time timer timestamps, ascending."""

    @property
    def current_watermark(self) -> int:
        """The event-time clock: ``MIN_TIMESTAMP`` until advanced."""

    @property
    def current_processing_time(self) -> int:
        """The processing-time clock: ``MIN_TIMESTAMP`` until advanced."""

    def advance_watermark(self, timestamp: int, on_timer: OnTimer, fire_new: bool = True) -> int:
        """Move the watermark to ``timestamp`` (it never goes back) and fire every
        event-time timer at or before it, in ascending (timestamp, serialized key) order,
        including timers registered by ``on_timer`` that are already due (as Flink does).
        With ``fire_new=False`` those wait for the next advance instead, and a due timer
        that ``on_timer`` deletes still fires (unlisted from then on), as Spark's
        transformWithState fires the timers due when its timer phase begins, and only
        them. Returns how many fired."""

    def advance_processing_time(
        self, timestamp: int, on_timer: OnTimer, fire_new: bool = True
    ) -> int:
        """As ``advance_watermark``, for the processing-time clock and timers."""
