"""The incremental keyed snapshot format (RocksDB): the native checkpoint's files as they are.

The synchronous cut of a RocksDB backend is a native checkpoint (hard links). The
incremental snapshot uploads its files without reading a single entry:

- SST files are immutable and their names are never reused within a database, so each
  is uploaded once, to the job's ``shared/`` directory as ``<subtask>-<random>-<sst>``;
  later snapshots of the same backend reference the copy that the newest *completed*
  checkpoint it took refers to (matched by file name and size, as Flink's
  RocksIncrementalSnapshotStrategy does). The backend keeps these upload records in its
  ``NativeCheckpoint.records`` directory, one JSON file per checkpoint, so they survive
  ``close()``/reopen across micro-batches and go with the database.
- A file in the record of checkpoint K is reused only if K's ``_metadata`` references
  it. Of several task attempts that snapshot K for one subtask (a retried or speculative
  one), K takes one; the coordinator deletes the shared files the others uploaded, and a
  local copy of an attempt that was not taken uploads those SST files again instead of
  referencing deleted ones.
- The other files (MANIFEST, CURRENT, OPTIONS, rocksdict's config, the WAL, empty after
  the checkpoint's flush) are private to the checkpoint. Those smaller than
  ``INLINE_LIMIT`` are kept inside the handle, so in ``_metadata``, as Flink keeps state
  below its memory threshold: one request for the snapshot's small files instead of one
  per file, on upload and on restore. OPTIONS grows by a few KB per column family, so a
  database with several states has one above the limit, uploaded as a file.

Paths in the handle are relative to the checkpoint directory (``../shared/...`` for
shared files), like every handle's. A snapshot that is cancelled or fails deletes the
files it uploaded itself and never a shared file it reuses; the coordinator's registry
(``checkpoint/registry.py``) deletes shared files that no retained checkpoint references.

A restore downloads all files of a handle (checking sizes and checksums), opens them
read-only as RocksDB and streams the key groups it needs, state by state.
"""

from __future__ import annotations

import base64
import json
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from statebackend.backends.keyed import KeyedStateCut, NativeCheckpoint, StateMetaInfo
from statebackend.backends.rocksdb import CheckpointReader, RocksDBCheckpointView
from statebackend.backends.stores import Entry, split_composite_key
from statebackend.backends.timers import TimerSnapshotInfo
from statebackend.checksums import CRC32, RunningChecksum, algorithm_of, checksum
from statebackend.errors import CheckpointCancelledError, CheckpointCorruptedError
from statebackend.keygroups import KeyGroupRange
from statebackend.serializers import SerializerConfig
from statebackend.snapshot.handles import (
    INLINE_LIMIT,
    HandleFiles,
    Relocate,
    SnapshotFileSystem,
    StoredFile,
    keyed_state_from_json,
    keyed_state_json,
    resolve_path,
)

CHUNK_BYTES = 4 << 20
"""Bytes read from a local file per chunk of an upload or download."""

_SST_SUFFIX = ".sst"


@dataclass(frozen=True)
class SharedLocation:
    """Where a job's shared files go, as a path (``directory``) and as seen from a
    checkpoint directory (``relative``, e.g. ``../shared``), and how a snapshot learns
    which files an earlier checkpoint holds: ``completed_files(N)`` is None if N is not
    complete, else the paths (relative to N's directory) of the files its ``_metadata``
    references. A snapshot reuses only files a completed checkpoint holds."""

    directory: str
    relative: str
    completed_files: Callable[[int], frozenset[str] | None]


class NativeFile(NamedTuple):
    """One file of a native checkpoint in a handle: its name in the RocksDB directory,
    its stored path (relative to the checkpoint directory; None when its bytes are
    ``inline`` in the handle), size and checksum."""

    name: str
    path: str | None
    size: int
    checksum: str
    inline: bytes | None = None

    def stored(self) -> StoredFile | None:
        """The file as stored apart from ``_metadata``; None when it is inline."""
        return None if self.path is None else StoredFile(self.path, self.size, self.checksum)

    def inline_intact(self) -> bool:
        """Whether its inline bytes have its size and checksum (a stored file is checked
        as it is read)."""
        if self.inline is None:
            return True
        digest = checksum(self.inline, algorithm_of(self.checksum) or CRC32)
        return len(self.inline) == self.size and digest == self.checksum

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the inline bytes in base64)."""
        document: dict[str, Any] = {"name": self.name, "size": self.size}
        if self.inline is None:
            document["path"] = self.path
        else:
            document["inline"] = base64.b64encode(self.inline).decode()
        return {**document, "checksum": self.checksum}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NativeFile:
        """The inverse of ``to_json``."""
        if not isinstance(data["name"], str):
            raise TypeError(f"native file name {data['name']!r} is not a string")
        inline = data.get("inline")
        return cls(
            data["name"],
            None if inline is not None else str(data["path"]),
            int(data["size"]),
            data["checksum"],
            None if inline is None else base64.b64decode(inline, validate=True),
        )


@dataclass(frozen=True)
class IncrementalKeyedStateHandle:
    """One subtask's incremental keyed snapshot: the files of its native checkpoint.

    ``shared`` are its SST files (in the job's ``shared/`` directory, possibly uploaded
    by an earlier checkpoint), ``private`` the checkpoint's other files.
    """

    key_group_range: KeyGroupRange
    states: tuple[StateMetaInfo, ...]
    key_serializer: SerializerConfig
    shared: tuple[NativeFile, ...]
    private: tuple[NativeFile, ...]
    timers: TimerSnapshotInfo | None = None

    @property
    def size(self) -> int:
        """Bytes of all files of the snapshot."""
        return sum(f.size for f in (*self.shared, *self.private))

    def bytes_for(self, key_groups: KeyGroupRange) -> int:
        """Bytes a restore of ``key_groups`` reads: all files, whatever the key groups."""
        return self.size if key_groups else 0

    def files(self) -> list[StoredFile]:
        """Every stored file the snapshot references, shared ones first (not the ones
        inline in the handle)."""
        return [s for f in (*self.shared, *self.private) if (s := f.stored()) is not None]

    def with_paths(self, relocate: Relocate) -> IncrementalKeyedStateHandle:
        """The same handle with every stored file's path mapped by ``relocate``."""

        def moved(file: NativeFile) -> NativeFile:
            return file if file.path is None else file._replace(path=relocate(file.path))

        return replace(
            self,
            shared=tuple(moved(f) for f in self.shared),
            private=tuple(moved(f) for f in self.private),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for ``_metadata``."""
        return {
            "type": "keyed-incremental",
            "shared": [f.to_json() for f in self.shared],
            "private": [f.to_json() for f in self.private],
            **keyed_state_json(self.key_group_range, self.states, self.key_serializer, self.timers),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IncrementalKeyedStateHandle:
        """The inverse of ``to_json``."""
        return cls(
            shared=tuple(NativeFile.from_json(f) for f in data["shared"]),
            private=tuple(NativeFile.from_json(f) for f in data["private"]),
            **keyed_state_from_json(data),
        )

    def read_entries(
        self, files: HandleFiles, key_groups: KeyGroupRange
    ) -> Iterator[tuple[str, int, Entry]]:
        """(state name, key group, entry) of its key groups in ``key_groups``, from its
        files downloaded into ``files.local_dir`` (``read_incremental_entries``)."""
        return read_incremental_entries(
            files.fs, files.directory, self, key_groups, files.local_dir
        )

    def read_runs(
        self, files: HandleFiles, key_groups: KeyGroupRange
    ) -> Iterator[tuple[str, int, list[tuple[bytes, bytes]]]]:
        """Runs of composite keys of its key groups in ``key_groups``, from its files
        downloaded into ``files.local_dir`` (``read_incremental_runs``)."""
        return read_incremental_runs(files.fs, files.directory, self, key_groups, files.local_dir)


# -- upload records ---------------------------------------------------------------------------


def _record_path(native: NativeCheckpoint, checkpoint_id: int) -> Path:
    return native.records / f"{checkpoint_id}.json"


def _recorded_ids(native: NativeCheckpoint) -> list[int]:
    if not native.records.is_dir():
        return []
    return sorted(int(p.stem) for p in native.records.glob("*.json") if p.stem.isdigit())


def reusable_files(
    native: NativeCheckpoint, checkpoint_id: int, shared: SharedLocation
) -> dict[tuple[str, int], NativeFile]:
    """The shared files this backend recorded for the newest completed checkpoint before
    ``checkpoint_id`` that this checkpoint's ``_metadata`` references, by (SST name,
    size): not those it uploaded for a snapshot the checkpoint did not take (another task
    attempt's of this subtask was taken, and these were deleted). Records older than that
    one are dropped."""
    earlier = [n for n in _recorded_ids(native) if n < checkpoint_id]
    for previous in reversed(earlier):
        held = shared.completed_files(previous)
        if held is None:
            continue
        for older in earlier:
            if older < previous:
                _record_path(native, older).unlink(missing_ok=True)
        record = json.loads(_record_path(native, previous).read_text())
        if record["shared_dir"] != shared.directory:
            return {}
        files = (NativeFile.from_json(f) for f in record["files"])
        return {(f.name, f.size): f for f in files if f.path in held}
    return {}


def record_uploads(
    native: NativeCheckpoint, checkpoint_id: int, shared: SharedLocation, files: list[NativeFile]
) -> None:
    """Note the shared files of checkpoint ``checkpoint_id`` for later snapshots (written
    atomically; skipped if the backend's directory is gone)."""
    document = {"shared_dir": shared.directory, "files": [f.to_json() for f in files]}
    path = _record_path(native, checkpoint_id)
    with suppress(FileNotFoundError):  # the backend was disposed meanwhile
        native.records.mkdir(exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(document))
        temporary.replace(path)


# -- upload -------------------------------------------------------------------------------------


def _local_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def upload_native_checkpoint(
    fs: SnapshotFileSystem,
    directory: str,
    name: str,
    shared: SharedLocation,
    checkpoint_id: int,
    cut: KeyedStateCut,
    should_stop: Callable[[], bool],
    threads: int = 4,
    uploaded: list[str] | None = None,
    abandoned: Callable[[], bool] = lambda: False,
) -> IncrementalKeyedStateHandle:
    """Upload the files of ``cut``'s native checkpoint for checkpoint ``checkpoint_id``:
    new SST files to ``shared``, the others into ``directory`` (the checkpoint's), each
    named after ``name`` (the subtask's unique prefix), up to ``threads`` files at a time.
    Checks ``should_stop`` before each file and chunk; on cancellation or failure deletes
    what it uploaded and raises. Asks ``abandoned`` once all files are written (or one
    failed): if the checkpoint was aborted meanwhile, it deletes them too and raises
    CheckpointCancelledError, so that a late upload leaves nothing behind. On success the
    paths it uploaded (not the shared files it reuses) are appended to ``uploaded``.
    """
    native = cut.native
    if native is None:
        raise ValueError("an incremental snapshot needs a cut with a native checkpoint")
    previous = reusable_files(native, checkpoint_id, shared)
    token = uuid.uuid4().hex[:12]
    shared_files: list[NativeFile] = []
    inline_files: list[NativeFile] = []
    pending: list[tuple[Path, str, str, bool]] = []
    for local in sorted(native.directory.iterdir()):
        is_sst = local.suffix == _SST_SUFFIX
        size = local.stat().st_size
        if not is_sst and size < INLINE_LIMIT:
            data = local.read_bytes()
            digest = checksum(data, fs.checksum_algorithm)
            inline_files.append(NativeFile(local.name, None, len(data), digest, data))
            continue
        reused = previous.get((local.name, size)) if is_sst else None
        # A file recorded with another checksum algorithm (signing was switched on) is
        # uploaded again, so that every file of a signed checkpoint has a SHA-256.
        if reused is not None and algorithm_of(reused.checksum) == fs.checksum_algorithm:
            shared_files.append(reused)
            continue
        stored = f"{name}-{token}-{local.name}"
        remote = f"{shared.directory}/{stored}" if is_sst else f"{directory}/{stored}"
        relative = f"{shared.relative}/{stored}" if is_sst else stored
        pending.append((local, remote, relative, is_sst))

    failed = threading.Event()
    failures: list[BaseException] = []  # the first is the cause; later ones follow from it

    def stop() -> bool:
        return failed.is_set() or should_stop()

    def upload(local: Path, remote: str, relative: str, is_sst: bool) -> NativeFile:
        try:
            if stop():
                raise CheckpointCancelledError(f"the upload of {directory} was cancelled")
            written = fs.write_file(remote, _local_chunks(local), should_stop=stop)
        except BaseException as exc:
            failures.append(exc)
            failed.set()  # the other files stop at their next chunk
            raise
        return NativeFile(local.name, relative, written.size, written.checksum)

    # The files are independent: checksumming and writing them release the GIL, so
    # several at a time use more than one core and overlap object-store round trips.
    with ThreadPoolExecutor(max(1, min(threads, len(pending))), "statebackend-file") as pool:
        futures = [pool.submit(upload, *item) for item in pending]
        wait(futures)
    if (not failures or not isinstance(failures[0], CheckpointCancelledError)) and abandoned():
        # A write that failed because the abort deleted the directory under it was
        # cancelled, not broken: ``should_stop`` only looks at the abort now and then.
        aborted = CheckpointCancelledError(
            f"checkpoint {checkpoint_id} was aborted while {name} uploaded; its files were deleted"
        )
        aborted.__cause__ = failures[0] if failures else None
        failures.insert(0, aborted)
    if failures:
        # write_file leaves nothing of a file it did not finish; delete the finished ones.
        for (_, remote, _, _), future in zip(pending, futures, strict=True):
            if future.exception() is None:
                with suppress(Exception):
                    fs.delete(remote)
        raise failures[0]
    written = [future.result() for future in futures]
    if uploaded is not None:
        uploaded.extend(remote for _, remote, _, _ in pending)
    shared_files += [file for file, item in zip(written, pending, strict=True) if item[3]]
    private_files = inline_files + [
        file for file, item in zip(written, pending, strict=True) if not item[3]
    ]
    record_uploads(native, checkpoint_id, shared, shared_files)
    return IncrementalKeyedStateHandle(
        key_group_range=cut.key_group_range,
        states=tuple(cut.states),
        key_serializer=cut.key_serializer,
        shared=tuple(shared_files),
        private=tuple(sorted(private_files)),
        timers=cut.timers,
    )


# -- restore ------------------------------------------------------------------------------------


def _download(fs: SnapshotFileSystem, remote: str, file: NativeFile, target: Path) -> None:
    size, running = 0, RunningChecksum(algorithm_of(file.checksum) or CRC32)
    stream = fs.open_read(remote)
    try:
        with target.open("wb") as out:
            while size <= file.size and (chunk := stream.read(CHUNK_BYTES)):
                out.write(chunk)
                size += len(chunk)
                running.update(chunk)
    finally:
        stream.close()
    if size > file.size:  # stopped reading: a file far larger would fill the disk
        raise CheckpointCorruptedError(
            f"{remote} is larger than the {file.size} bytes the _metadata declares; the "
            f"file is corrupted"
        )
    if running.value() != file.checksum or size != file.size:
        raise CheckpointCorruptedError(
            f"{remote}: size {size} and checksum {running.value()} != expected {file.size} "
            f"and {file.checksum}; the file is truncated or corrupted"
        )


def download_native_checkpoint(
    fs: SnapshotFileSystem,
    directory: str,
    handle: IncrementalKeyedStateHandle,
    target: Path,
    threads: int = 4,
) -> None:
    """Download every file of ``handle`` (relative to ``directory``) into the existing
    directory ``target``, up to ``threads`` at a time, checking each one's size and
    checksum (CheckpointCorruptedError naming it); files inline in the handle are
    checked and written as they are."""
    stored: list[NativeFile] = []
    for file in (*handle.shared, *handle.private):
        if file.inline is None:
            stored.append(file)
            continue
        if not file.inline_intact():
            raise CheckpointCorruptedError(
                f"{file.name} (inline in the _metadata of {directory}) does not match its "
                f"size {file.size} and checksum {file.checksum}; the _metadata is corrupted"
            )
        (target / file.name).write_bytes(file.inline)
    if not stored:
        return
    with ThreadPoolExecutor(max(1, min(threads, len(stored))), "statebackend-file") as pool:
        futures = [
            pool.submit(_download, fs, resolve_path(directory, str(f.path)), f, target / f.name)
            for f in stored
        ]
        for future in futures:
            future.result()


def read_incremental_runs(
    fs: SnapshotFileSystem,
    directory: str,
    handle: IncrementalKeyedStateHandle,
    key_groups: KeyGroupRange,
    local_dir: Path | None = None,
) -> Iterator[tuple[str, int, list[tuple[bytes, bytes]]]]:
    """(state name, key group, its (composite key, value) pairs) for the key groups of
    ``handle`` in ``key_groups``, state by state, in composite-key order. Downloads the
    handle's files (``download_native_checkpoint``) into a temporary directory under
    ``local_dir`` (default: the system's), removed when the iteration ends."""
    if not handle.key_group_range.intersection(key_groups):
        return
    with tempfile.TemporaryDirectory(prefix="restore-", dir=local_dir) as temporary:
        download_native_checkpoint(fs, directory, handle, Path(temporary))
        yield from read_downloaded_runs(Path(temporary), handle, key_groups)


def read_downloaded_runs(
    local: Path, handle: IncrementalKeyedStateHandle, key_groups: KeyGroupRange
) -> Iterator[tuple[str, int, list[tuple[bytes, bytes]]]]:
    """``read_incremental_runs`` of a handle whose files were downloaded into ``local``."""
    wanted = handle.key_group_range.intersection(key_groups)
    if not wanted:
        return
    reader = CheckpointReader(str(local), [meta.name for meta in handle.states])
    try:
        for meta in handle.states:
            view = RocksDBCheckpointView(reader, meta.name)
            for key_group in wanted:
                yield meta.name, key_group, list(view.composite_items(key_group))
    finally:
        reader.close()


def read_incremental_entries(
    fs: SnapshotFileSystem,
    directory: str,
    handle: IncrementalKeyedStateHandle,
    key_groups: KeyGroupRange,
    local_dir: Path | None = None,
) -> Iterator[tuple[str, int, Entry]]:
    """(state name, key group, entry) for the key groups of ``handle`` in ``key_groups``,
    state by state, read as ``read_incremental_runs`` does."""
    for name, key_group, pairs in read_incremental_runs(
        fs, directory, handle, key_groups, local_dir
    ):
        for composite, value in pairs:
            _, key, user_key = split_composite_key(composite)
            yield name, key_group, (key, user_key, value)
