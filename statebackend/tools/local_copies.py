"""Executor-local copies of keyed state on a host's disk, and removing the idle ones.

Each keyed subtask keeps its RocksDB between batches under ``spark.statebackend.local.dir``:

    <local.dir>/<job_id>/<operator>/subtask-<i>          the RocksDB directory
    <local.dir>/<job_id>/<operator>/subtask-<i>.version  what it holds (rewritten after
                                                          each batch)
    <local.dir>/<job_id>/<operator>/subtask-<i>.lock     ``flock``-ed by the task using it

A copy is a cache: a subtask that finds none rebuilds its key groups from the job's
storage. Nothing on an executor can tell that a job will not run again (another
application may run it), so copies of retired jobs stay until removed:
``statebackend local-gc`` lists (and with ``--apply`` removes) the copies on this host
that no task has used for a while and no task holds now.

Reads of stored state (``statebackend read``, ``spark.state_reader.read_state``) download
into such a copy too, one per concurrent reader, ``flock``-ed while it reads and removed
after (``read_scratch``): ``<local.dir>/@reads/scratch/subtask-<i>``. A reader killed midway
leaves its copy behind; the next reader that takes its slot, or ``local-gc``, removes it,
whatever its age (a read copy is never reused).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from statebackend.backends.local_cuts import lock_held
from statebackend.errors import LocalStateError

SUBTASK_PREFIX = "subtask-"
LOCK_SUFFIX = ".lock"
MARKER_SUFFIX = ".version"
IDLE_SECONDS = 7 * 24 * 3600.0
"""How long no task must have used a copy before ``local-gc`` takes it for idle."""
READS = Path("@reads", "scratch")
"""Where under a local directory readers download (``read_scratch``); ``@`` is in no job
id, so no job's copies are there."""


def default_local_dir() -> str:
    """Where executors keep their RocksDB instances, and readers download, unless
    ``local.dir`` (``--local-dir``) is set: one host-wide directory, so every executor
    process on a host finds the local copies."""
    return str(Path(tempfile.gettempdir()) / "statebackend-local")


@dataclass(frozen=True)
class LocalCopy:
    """Subtask ``subtask``'s copy under ``root`` (``<local.dir>/<job_id>/<operator>``)."""

    root: Path
    subtask: int

    @property
    def directory(self) -> Path:
        """The RocksDB directory."""
        return self.root / f"{SUBTASK_PREFIX}{self.subtask}"

    @property
    def marker(self) -> Path:
        """The version marker: what the directory holds."""
        return self.root / f"{SUBTASK_PREFIX}{self.subtask}{MARKER_SUFFIX}"

    @property
    def lock(self) -> Path:
        """The lock file a task ``flock``s while it uses the copy."""
        return self.root / f"{SUBTASK_PREFIX}{self.subtask}{LOCK_SUFFIX}"

    def last_used(self) -> float:
        """When a task last changed the copy (seconds since the epoch): the newest
        modification time of its marker, lock file and directory."""
        times = []
        for path in (self.marker, self.lock, self.directory):
            with suppress(FileNotFoundError):
                times.append(path.stat().st_mtime)
        return max(times, default=0.0)

    def size(self) -> int:
        """The bytes of the files in the copy's directory."""
        total = 0
        for path in self.directory.rglob("*"):
            with suppress(FileNotFoundError):
                if path.is_file():
                    total += path.stat().st_size
        return total


def copies_under(root: Path) -> list[LocalCopy]:
    """The copies under one operator's ``root``, by subtask."""
    found = set()
    for lock in root.glob(f"{SUBTASK_PREFIX}*{LOCK_SUFFIX}"):
        index = lock.name.removeprefix(SUBTASK_PREFIX).removesuffix(LOCK_SUFFIX)
        if index.isdigit():
            found.add(int(index))
    return [LocalCopy(root, subtask) for subtask in sorted(found)]


def local_copies(local_dir: Path) -> list[LocalCopy]:
    """Every copy under ``local_dir`` (``<local_dir>/<job_id>/<operator>/subtask-<i>``)."""
    roots = sorted({lock.parent for lock in local_dir.glob(f"*/*/{SUBTASK_PREFIX}*{LOCK_SUFFIX}")})
    return [copy for root in roots for copy in copies_under(root)]


def idle_copies(local_dir: Path, idle_seconds: float, now: float) -> list[LocalCopy]:
    """The copies under ``local_dir`` no task used within ``idle_seconds`` before ``now``,
    and the read copies (``read_scratch``) no reader holds, whatever their age."""
    reads = local_dir / READS
    return [
        copy
        for copy in local_copies(local_dir)
        if now - copy.last_used() > idle_seconds
        or (copy.root == reads and not lock_held(copy.lock))
    ]


def acquire_lock(copy: LocalCopy, wait: bool = True) -> int | None:
    """Take ``copy``'s lock (a file descriptor to give ``release_lock``), waiting for a
    task holding it, or, with ``wait`` False, None at once if one does. The lock is on the
    file at ``copy.lock`` once taken: one ``remove_if_idle`` unlinked while this waited
    for it is taken again on the file there now."""
    while True:
        try:
            fd = os.open(copy.lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # no directory yet, or removed as empty just now
            copy.root.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(copy.lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def release_lock(fd: int) -> None:
    """Release a lock ``acquire_lock`` took."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def remove_if_idle(copy: LocalCopy) -> bool:
    """Delete ``copy`` (marker, directory, lock file) unless a task holds it now; whether
    it was deleted. The next task of its subtask rebuilds it from the job's storage."""
    fd = acquire_lock(copy, wait=False)
    if fd is None:
        return False
    try:
        copy.marker.unlink(missing_ok=True)
        shutil.rmtree(copy.directory, ignore_errors=True)
        copy.lock.unlink(missing_ok=True)
    finally:
        release_lock(fd)
    for directory in (copy.root, copy.root.parent):  # the operator's, then the job's
        with suppress(OSError):
            directory.rmdir()  # only if empty
    return True


@contextmanager
def read_scratch(local_dir: Path) -> Iterator[Path]:
    """An empty directory under ``local_dir`` for one reader's downloads: the first read
    copy (``READS``) no other reader holds, locked while the block runs and removed after.
    What a reader killed in it left is removed first."""
    root = local_dir / READS
    try:
        slot = 0
        while (fd := acquire_lock(LocalCopy(root, slot), wait=False)) is None:
            slot += 1
    except OSError as error:
        raise LocalStateError(
            f"the local directory {local_dir} is unusable ({error.strerror or error}): give "
            f"a writable directory with room (--local-dir, spark.statebackend.local.dir)"
        ) from error
    copy = LocalCopy(root, slot)
    try:
        os.utime(copy.lock)  # in use now, for local-gc's listing
        shutil.rmtree(copy.directory, ignore_errors=True)
        copy.directory.mkdir(exist_ok=True)
        yield copy.directory
    finally:
        release_lock(fd)
        remove_if_idle(copy)
