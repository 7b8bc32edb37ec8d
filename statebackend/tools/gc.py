"""``statebackend gc``: files of a job that no checkpoint can use any more, safe to run
while the job is running.

In Flink only the job deletes its own files. gc is a separate process that cannot see what
a running job is about to do, so it deletes only what it can prove unused. A file is
garbage only if all of these hold:

1. it was last modified longer than the grace period ago (on the storage's clock; default
   one hour: keep it above the checkpoint timeout and any clock difference between this
   machine and the storage);
2. no ``_metadata`` of the job references it (its completed checkpoints, and the
   savepoints in its ``savepoints/`` directory);
3. no acknowledgement of a checkpoint without ``_metadata`` references it (read with
   ``CheckpointStorage.read_acks``; if one cannot be read, ``shared/`` is left alone). So
   an aborted checkpoint whose acknowledgements remain goes in two runs: its
   acknowledgements first, then the files they referenced;
4. it is one of
   - a file in a completed ``chk-<N>`` that its ``_metadata`` does not reference (a
     retried task's upload, a left-over ``acks/``);
   - a file of a ``chk-<N>`` without ``_metadata`` older than the newest completed
     checkpoint (an aborted attempt, a late upload), unless ``chk-<N>`` still has the
     pending marker (``_pending``) of the job's newest leader epoch: that coordinator may
     still complete it (concurrent checkpoints); a marker of a superseded (fenced) leader
     does not protect it;
   - a changelog record (``changelog/<B>/...``) of a batch B at or below the newest
     batch manifest that no manifest in ``manifests/`` references: a record at or below
     every retained manifest's base, or an attempt the driver did not accept (a retried or
     speculative task's). Records of batches after the newest manifest may still be
     committed and are never touched; a later manifest references no record of a batch
     at or below the newest one that the newest does not (manifests only drop records
     below their base and add their own batch's). If a manifest cannot be read, no record
     is garbage;
   - a file in ``shared/`` written before the newest completed checkpoint was triggered.
     An incremental snapshot uploads its SST files to ``shared/`` before anything of its
     ``chk-<N>`` exists, so a pending checkpoint may be invisible; but it was triggered
     after the newest completed one, and the shared files it did not upload itself it
     reuses from a completed checkpoint, whose ``_metadata`` references them. The trigger
     time on the storage's clock is the modification time of that checkpoint's
     ``_metadata`` less its duration (``completed_at - triggered_at``). Without a
     completed checkpoint no shared file is garbage;
   - an answered savepoint request in ``requests/`` (the request and its answer), once
     the answer is older than the grace period (the request's own time does not count: a
     ``savepoint trigger --wait`` may still be reading the answer). The request is
     deleted first: a request without its answer is served again.

``delete_garbage`` decides again from a fresh listing just before deleting and deletes only
files both decisions found, unchanged. Never touched: ``_metadata`` files, a ``chk-<N>``
newer than the newest completed checkpoint (it may be pending), ``savepoints/`` (complete or
being written), unanswered savepoint requests, ``manifests/`` (the job keeps the newest
ones), and every other file or directory in the job's directory. The base checkpoints of
manifests are completed checkpoints, whose referenced files are never garbage.
"""

from __future__ import annotations

import json
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.layout import (
    ACKS_DIR,
    CHANGELOG_DIR,
    METADATA_FILE,
    PENDING_FILE,
    SAVEPOINTS_DIR,
    SHARED_DIR,
    batch_ids,
    checkpoint_id_of,
    checkpoint_ids,
    join,
    metadata_path,
)
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.requests import REQUESTS_DIR, answered_requests
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata_files
from statebackend.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigurationError,
    StateBackendError,
)
from statebackend.snapshot.handles import StoredFile, normalize_path, resolve_path

DEFAULT_GRACE_SECONDS = 3600.0
"""Files modified less than this long ago are never garbage."""
Progress = Callable[[int, int], None]
"""Told (things done, total) as a long step goes on."""


@dataclass(frozen=True)
class Garbage:
    """An unused file: its path, size in bytes, modification time (POSIX seconds, the
    storage's clock), and why it is garbage."""

    path: str
    size: int
    modified: float
    reason: str


@dataclass
class _JobView:
    """What one reading of a job's directory found."""

    completed: dict[int, CheckpointMetadata]
    incomplete: list[int]
    live: set[int]
    """The incomplete checkpoints whose coordinator may still complete them."""
    in_use: set[str]
    shared_before: float | None
    """Shared files modified at or after this may belong to a pending checkpoint."""
    listing: _Listing
    """The job's files, listed once."""
    newest_manifest: int | None = None
    """Changelog records of batches up to this one may be garbage (None: none are)."""


class _Listing:
    """The files below a job's directory (paths as ``join`` builds them) with their sizes
    and modification times, from one listing; and the names in each directory."""

    def __init__(self, fs: CheckpointFileSystem, job_dir: str) -> None:
        self.files = {join(job_dir, path): info for path, info in fs.list_files(job_dir).items()}
        self._names: dict[str, set[str]] = {}
        for path in self.files:
            parent, name = posixpath.split(path)
            while len(parent) >= len(job_dir):
                self._names.setdefault(parent, set()).add(name)
                parent, name = posixpath.split(parent)

    def names(self, directory: str) -> list[str]:
        """The sorted names of the files and directories in ``directory``."""
        return sorted(self._names.get(directory, ()))


def _references(directory: str, files: list[StoredFile]) -> set[str]:
    return {resolve_path(directory, file.path) for file in files}


def _files(listing: _Listing, directory: str) -> list[str]:
    """The files of a checkpoint directory: its entries, and those of its ``acks/``."""
    paths = []
    for name in listing.names(directory):
        path = join(directory, name)
        paths += [join(path, a) for a in listing.names(path)] if name == ACKS_DIR else [path]
    return paths


def _load_all(fs: CheckpointFileSystem, directories: list[str]) -> list[CheckpointMetadata | None]:
    """The ``_metadata`` of each checkpoint or savepoint listed with one, the files read
    several at once; None for one deleted since the listing.

    A ``_metadata`` that exists but cannot be read is an error: what it references is
    unknown, so nothing may be deleted.
    """
    loaded: list[CheckpointMetadata | None] = []
    for metadata in load_metadata_files(fs, directories):
        if isinstance(metadata, CheckpointNotFoundError):
            loaded.append(None)
        elif isinstance(metadata, CheckpointError):
            raise metadata
        else:
            loaded.append(metadata)
    return loaded


def _pending_epoch(storage: CheckpointStorage, checkpoint_id: int) -> int:
    """The leader epoch of the coordinator that marked checkpoint N pending; -1 if the
    marker is gone or unreadable (N was aborted meanwhile). A checkpoint marked by the
    newest leader may still complete; one marked by a superseded (fenced) leader cannot."""
    try:
        marker = json.loads(storage.fs.read_file(storage.layout.pending_marker_path(checkpoint_id)))
        return int(marker["epoch"])
    except (StateBackendError, ValueError, KeyError, TypeError):
        return -1


def _read_manifests(changelog: ChangelogStorage, in_use: set[str]) -> int | None:
    """Add the records every batch manifest references to ``in_use``; the newest
    manifest's batch, or None if there is none or one cannot be read (then no record is
    garbage)."""
    ids = changelog.manifest_ids()
    for batch_id, manifest in zip(ids, changelog.load_manifests(ids), strict=True):
        if not isinstance(manifest, BatchManifest):
            if changelog.fs.exists(changelog.layout.manifest_path(batch_id)):
                return None  # unknown references: keep every record
            continue  # retired by the job meanwhile: newer manifests hold what it needed
        in_use |= {
            resolve_path(changelog.layout.manifests_dir, file.path) for file in manifest.files()
        }
    return ids[-1] if ids else None


def _read_job(fs: CheckpointFileSystem, job_dir: str) -> _JobView:
    parent, _, job_id = job_dir.rpartition("/")
    storage = CheckpointStorage(parent or ".", job_id, filesystem=fs)
    view = _JobView({}, [], set(), set(), None, _Listing(fs, job_dir))
    listing = view.listing
    leader = max(storage.leader_epochs(), default=0)
    completed = []
    for checkpoint_id in checkpoint_ids(listing.names(job_dir)):
        directory = join(job_dir, f"chk-{checkpoint_id}")
        names = listing.names(directory)
        if METADATA_FILE in names:
            completed.append((checkpoint_id, directory))
            continue
        view.incomplete.append(checkpoint_id)
        if PENDING_FILE in names and _pending_epoch(storage, checkpoint_id) >= leader:
            view.live.add(checkpoint_id)
    savepoints_dir = join(job_dir, SAVEPOINTS_DIR)
    savepoints = [
        join(savepoints_dir, name)
        for name in listing.names(savepoints_dir)
        if METADATA_FILE in listing.names(join(savepoints_dir, name))
    ]
    directories = [directory for _, directory in completed] + savepoints
    loaded = _load_all(fs, directories)
    for (checkpoint_id, _), metadata in zip(completed, loaded, strict=False):
        if metadata is not None:
            view.completed[checkpoint_id] = metadata
    for directory, metadata in zip(directories, loaded, strict=True):
        if metadata is not None:
            view.in_use |= _references(directory, metadata.files())
    acks_readable = True
    for checkpoint_id in view.incomplete:
        try:
            acks = storage.read_acks(checkpoint_id)
        except (StateBackendError, ValueError, KeyError, TypeError):
            acks_readable = False  # being completed or aborted right now, or unknown
            continue
        directory = join(job_dir, f"chk-{checkpoint_id}")
        view.in_use |= {ref for ack in acks for ref in _references(directory, ack.files())}
    view.newest_manifest = _read_manifests(ChangelogStorage(storage), view.in_use)
    if view.completed and acks_readable:
        newest = max(view.completed)
        metadata = view.completed[newest]
        _, completed_at = listing.files[metadata_path(join(job_dir, f"chk-{newest}"))]
        duration = max(0.0, metadata.completed_at - metadata.triggered_at)
        view.shared_before = completed_at - duration
    return view


def _answered_requests(job_dir: str, listing: _Listing) -> list[tuple[str | None, str]]:
    """(request path or None, answer path) of the job's answered savepoint requests."""
    directory = join(job_dir, REQUESTS_DIR)
    return [
        (None if request is None else join(directory, request), join(directory, answer))
        for request, answer in answered_requests(listing.names(directory))
    ]


def _candidates(job_dir: str, view: _JobView) -> list[tuple[str, str]]:
    """(path, reason) of the files rules 2 to 4 of the module docstring allow deleting,
    except the time limit of shared files, which needs their modification times."""
    newest = max(view.completed, default=0)
    listing = view.listing
    candidates: list[tuple[str, str]] = []
    for checkpoint_id in view.completed:
        directory = join(job_dir, f"chk-{checkpoint_id}")
        candidates += [
            (path, f"not referenced by chk-{checkpoint_id}/{METADATA_FILE}")
            for path in _files(listing, directory)
            if posixpath.basename(path) != METADATA_FILE
        ]
    for checkpoint_id in view.incomplete:
        if checkpoint_id < newest and checkpoint_id not in view.live:
            candidates += [
                (path, f"chk-{checkpoint_id} never completed and chk-{newest} is newer")
                for path in _files(listing, join(job_dir, f"chk-{checkpoint_id}"))
            ]
    if view.newest_manifest is not None:
        changelog_dir = join(job_dir, CHANGELOG_DIR)
        for batch_id in batch_ids(listing.names(changelog_dir)):
            if batch_id <= view.newest_manifest:
                directory = join(changelog_dir, str(batch_id))
                candidates += [
                    (join(directory, name), "changelog record no batch manifest references")
                    for name in listing.names(directory)
                ]
    for request, answer in _answered_requests(job_dir, listing):
        candidates += [
            (path, "savepoint request answered longer than the grace period ago")
            for path in (request, answer)  # the request first: unanswered, it is served again
            if path is not None
        ]
    if view.shared_before is not None:
        shared = join(job_dir, SHARED_DIR)
        candidates += [
            (join(shared, name), "shared file no checkpoint or savepoint uses")
            for name in listing.names(shared)
        ]
    # Only files: a directory someone put among a checkpoint's entries is not gc's.
    return [
        (path, why)
        for path, why in candidates
        if path in listing.files and normalize_path(path) not in view.in_use
    ]


def find_garbage(
    fs: CheckpointFileSystem,
    job_dir: str,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    now: float | None = None,
    checked: Progress | None = None,
) -> list[Garbage]:
    """The garbage files of the job in ``job_dir`` (see the module docstring): none
    modified within ``grace_seconds`` before ``now`` (default: the current time).
    ``checked(done, total)`` is told of each candidate file whose time was looked up.

    Raises ConfigurationError if ``grace_seconds`` is negative, and CheckpointError if a
    ``_metadata`` of the job cannot be read.
    """
    if not grace_seconds >= 0:  # also refuses NaN, which would make every file old
        raise ConfigurationError(
            f"grace period {grace_seconds!r} is invalid: give a number of seconds >= 0"
        )
    job_dir = job_dir.rstrip("/")
    view = _read_job(fs, job_dir)
    oldest_young = (time.time() if now is None else now) - grace_seconds
    shared_prefix = join(job_dir, SHARED_DIR) + "/"
    garbage = []
    candidates = _candidates(job_dir, view)
    answer_of = {
        request: answer
        for request, answer in _answered_requests(job_dir, view.listing)
        if request is not None
    }
    for done, (path, reason) in enumerate(candidates, 1):
        if checked is not None:
            checked(done, len(candidates))
        size, modified = view.listing.files[path]
        # An answered request goes when its answer is old: a requester may still read it.
        timed = view.listing.files[answer_of[path]][1] if path in answer_of else modified
        too_young = max(modified, timed) > oldest_young
        if path.startswith(shared_prefix):
            assert view.shared_before is not None
            too_young |= modified >= view.shared_before
        if not too_young:
            garbage.append(Garbage(path, size, modified, reason))
    return garbage


def delete_garbage(
    fs: CheckpointFileSystem,
    job_dir: str,
    garbage: list[Garbage],
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    checked: Progress | None = None,
    deleted: Progress | None = None,
) -> list[Garbage]:
    """Delete those of ``garbage`` (from ``find_garbage`` of ``job_dir``) that a fresh
    ``find_garbage`` (told ``checked``) finds again with the same modification time, and
    the directories of never-completed checkpoints and of changelog batches that are left
    empty. Returns what it deleted; ``deleted(done, total)`` is told of each file."""
    again = find_garbage(fs, job_dir, grace_seconds=grace_seconds, checked=checked)
    confirmed = {(item.path, item.modified) for item in again}
    doomed = [item for item in garbage if (item.path, item.modified) in confirmed]
    directories = set()
    for done, item in enumerate(doomed, 1):
        fs.delete(item.path)
        if deleted is not None:
            deleted(done, len(doomed))
        directory = posixpath.dirname(item.path)
        if posixpath.basename(directory) == ACKS_DIR:
            directories.add(directory)
            directory = posixpath.dirname(directory)
        if (
            checkpoint_id_of(directory) is not None
            or posixpath.basename(posixpath.dirname(directory)) == CHANGELOG_DIR
        ):
            directories.add(directory)
    for directory in sorted(directories, reverse=True):
        if not fs.list_dir(directory):
            fs.delete(directory, recursive=True)
    return doomed
