"""The directories a RocksDB backend's snapshots hard-link their native checkpoints into
(``cut-*`` in the backend's local directory), and the removal of those a dead process left.

A cut lives from the synchronous part of a snapshot until its upload ends, which may be
after the backend was closed and another process (the next batch's task, in another
Python worker) reopened the database. So the process that makes a cut holds an ``flock``
on a lock file inside it for its whole life, and the kernel drops that lock when the
process dies (a killed worker never removes its cuts itself). ``sweep_cuts`` removes
the cuts whose lock it can take: those of dead processes only.

A heap backend rebuilt in the Spark runtime downloads into such a directory of the
subtasks' local directory (``cut-restore-<i>-*``, ``local_state``) the same way.

Making a cut and sweeping both hold an ``flock`` on the local directory itself, so that a
sweep never sees a cut whose lock is not held yet.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_PREFIX = "cut-"
_LOCK_FILE = "lock"
_log = logging.getLogger(__name__)


@contextmanager
def _directory_locked(local_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``local_dir`` (released when the block is left)."""
    fd = os.open(local_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class LocalCut:
    """A new cut directory (``path``, named ``cut-<label>-<random>``) in ``local_dir``,
    locked by this process until ``release``."""

    def __init__(self, local_dir: Path, label: str) -> None:
        with _directory_locked(local_dir):
            self.path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{label}-", dir=local_dir))
            self._fd: int | None = os.open(self.path / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # a new file: nobody else can hold it

    def release(self) -> None:
        """Remove the directory, then drop its lock; safe to call more than once."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(fd)


def sweep_cuts(local_dir: Path) -> None:
    """Remove the cut directories in ``local_dir`` that no live process holds (left by a
    process that died during an upload); cuts still in use, in this process or another,
    are kept."""
    with _directory_locked(local_dir):
        for path in local_dir.glob(f"{_PREFIX}*"):
            if path.is_dir() and not lock_held(path / _LOCK_FILE):
                shutil.rmtree(path, ignore_errors=True)
                _log.info("removed %s, left by a process that died during its upload", path)


def lock_held(lock: Path) -> bool:
    """Whether a live process holds the ``flock`` of the file ``lock`` now (False if it
    does not exist: its maker died before locking it)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # released at once: nobody is kept from taking it
    return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # its maker is gone and sweeps exclude each other: nobody takes it now
    return False
