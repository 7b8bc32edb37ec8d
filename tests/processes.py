"""Subprocesses the tests kill midway: wait for a sign of progress, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

WAIT = 120.0
"""How long a subprocess may take to show progress, or to die (a loaded CI machine)."""


def wait_for(condition: Callable[[], bool], process: subprocess.Popen[Any], what: str) -> None:
    """Return once ``condition()`` holds; AssertionError if ``process`` ends first or it
    does not hold within ``WAIT`` seconds (``what``: the progress awaited, for the
    message)."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert process.poll() is None, f"the process ended before it {what}"
        assert time.monotonic() < deadline, f"the process never {what}"
        time.sleep(0.02)


def kill_when(condition: Callable[[], bool], process: subprocess.Popen[Any], what: str) -> None:
    """SIGKILL ``process`` once ``condition()`` holds (``wait_for``) and check that the
    signal ended it; whatever happens, ``process`` is not left running."""
    try:
        wait_for(condition, process, what)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=WAIT) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
