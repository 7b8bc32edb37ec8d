"""Opening what a command names: a storage location, or a checkpoint, savepoint or batch
manifest in it.

A checkpoint or savepoint is named by its directory (or its ``_metadata``), a batch
manifest by its file, ``<job dir>/manifests/<B>``, and ``<job dir>/latest`` names the
newest state of the job: its newest manifest, unless a completed checkpoint holds a
later batch (or the job has no manifests).
"""

from __future__ import annotations

import json
import logging
import posixpath
from dataclasses import dataclass
from typing import Any

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import (
    FAIL_FAST_RETRY,
    CheckpointFileSystem,
    normalize_url,
    open_filesystem,
)
from statebackend.checkpoint.layout import (
    LOCATION_BINDING_FILE,
    MANIFESTS_DIR,
    METADATA_FILE,
    batch_ids,
    checkpoint_ids,
    join,
)
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.signing import SigningKey, VerifiedReads
from statebackend.checkpoint.storage import CheckpointStorage, load_metadata
from statebackend.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    StateBackendError,
)

_log = logging.getLogger(__name__)
_LOCAL_PROTOCOLS = ("file", "local")


def open_location(url: str, storage_options: dict[str, Any] | None = None) -> CheckpointFileSystem:
    """The file system of ``url`` (any fsspec URL or a local path).

    ``storage_options`` apply to remote protocols only, so one set of options serves a
    command that reads from s3 and writes to a local directory. A refused connection (a
    wrong endpoint) fails at once, as someone is waiting (``FAIL_FAST_RETRY``).
    """
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    options = None if protocol in _LOCAL_PROTOCOLS else storage_options
    return open_filesystem(url, options, retry=FAIL_FAST_RETRY)


@dataclass(frozen=True)
class CheckpointRef:
    """A completed checkpoint or savepoint: its file system, directory and metadata, and
    the key it was checked with (then ``fs`` serves only checked bytes of its files)."""

    fs: CheckpointFileSystem
    directory: str
    metadata: CheckpointMetadata
    signing_key: SigningKey | None = None


def checkpoint_directory(url: str) -> str:
    """The directory (normalized) of a checkpoint given by its directory or its
    ``_metadata`` file."""
    path = normalize_url(url)
    if path.endswith("/" + METADATA_FILE):
        path = path[: -len(METADATA_FILE) - 1]
    return path


def open_checkpoint(
    url: str,
    storage_options: dict[str, Any] | None = None,
    signing_key: SigningKey | None = None,
) -> CheckpointRef:
    """The completed checkpoint or savepoint at ``url``, its ``_metadata`` checked.

    With ``signing_key`` it must be signed with that key, and reads of its files return
    only bytes that match their signed digests (``signing.VerifiedReads``). Raises
    CheckpointNotFoundError if it has no ``_metadata``, CheckpointCorruptedError if the
    metadata is invalid or its signature does not match.
    """
    fs = open_location(url, storage_options)
    directory = checkpoint_directory(url)
    try:
        metadata = load_metadata(fs, directory, signing_key)
    except CheckpointNotFoundError as exc:
        job = job_directory_of(fs, directory)
        if job is None:
            raise
        raise CheckpointNotFoundError(
            f"{directory} is not a checkpoint: it is {job.given_as}: give {job.path}/{LATEST} "
            f"(its newest state) or one of its chk-<N>"
        ) from exc
    if signing_key is not None:
        fs = VerifiedReads(fs, directory, metadata.files())
    return CheckpointRef(fs, directory, metadata, signing_key)


@dataclass(frozen=True)
class JobDirectory:
    """The job a directory given for a checkpoint leads to: its directory, and what the
    given directory is (for an error message: "it is ...")."""

    path: str
    given_as: str


def job_directory_of(fs: CheckpointFileSystem, directory: str) -> JobDirectory | None:
    """The job whose directory ``directory`` is, or to which it is bound as a Spark
    checkpointLocation; None if neither. A listing that fails (a bucket that does not
    exist) raises: that is what is wrong."""
    names = fs.list_dir(directory)
    try:
        if LOCATION_BINDING_FILE in names:
            binding = json.loads(fs.read_file(join(directory, LOCATION_BINDING_FILE)))
            job_dir = join(str(binding["checkpoint_dir"]), str(binding["job_id"]))
            job_id = str(binding["job_id"])
            return JobDirectory(job_dir, f"the Spark checkpointLocation of state job {job_id!r}")
    except (StateBackendError, ValueError, KeyError, TypeError):
        return None
    if MANIFESTS_DIR in names or checkpoint_ids(names):
        return JobDirectory(directory, "a job's directory")
    return None


LATEST = "latest"
"""The last name of ``<job dir>/latest``: the newest state of the job."""


@dataclass(frozen=True)
class ManifestRef:
    """A committed batch manifest: the job's changelog storage, the manifest, and its
    base checkpoint opened (None before the job's first materialization)."""

    changelog: ChangelogStorage
    manifest: BatchManifest
    base: CheckpointRef | None

    @property
    def fs(self) -> CheckpointFileSystem:
        """The file system of the job."""
        return self.changelog.fs

    @property
    def path(self) -> str:
        """The manifest's file."""
        return self.changelog.layout.manifest_path(self.manifest.batch_id)

    @property
    def job_dir(self) -> str:
        """The job's directory."""
        return self.changelog.layout.job_dir


StateRef = CheckpointRef | ManifestRef
"""What a command reads state from."""


def job_changelog(
    fs: CheckpointFileSystem, job_dir: str, signing_key: SigningKey | None = None
) -> ChangelogStorage:
    """The changelog storage of the job in ``job_dir`` (read-only use: nothing is written
    until a method that writes is called); with ``signing_key`` its manifests must be
    signed with it and its records match their signed digests."""
    parent, _, job_id = job_dir.rstrip("/").rpartition("/")
    storage = CheckpointStorage(parent or ".", job_id, filesystem=fs, signing_key=signing_key)
    return ChangelogStorage(storage)


def _manifest_name(path: str) -> tuple[str, int] | None:
    """(job dir, batch id) if ``path`` is ``<job dir>/manifests/<B>``, else None."""
    directory, name = posixpath.split(path)
    job_dir, parent = posixpath.split(directory)
    ids = batch_ids([name])
    if parent != MANIFESTS_DIR or not ids or not job_dir:
        return None
    return job_dir, ids[0]


def checkpoint_batch(metadata: CheckpointMetadata) -> int | None:
    """The batch at whose end a checkpoint was taken, if it says: ``batch_id`` in its
    properties, or ``next_batch`` - 1 (``StatefulJob``'s checkpoints)."""
    properties = metadata.properties
    if isinstance(properties.get("batch_id"), int):
        return int(properties["batch_id"])
    if isinstance(properties.get("next_batch"), int):
        return int(properties["next_batch"]) - 1
    return None


def _latest(
    fs: CheckpointFileSystem, job_dir: str, signing_key: SigningKey | None
) -> tuple[str, int | None]:
    """(the checkpoint directory or job dir, None or the manifest's batch) of the newest
    state of the job in ``job_dir``: its newest manifest, unless the newest completed
    checkpoint is of a later batch (a checkpoint that does not say its batch is older
    than any manifest: a materialization is always followed by its manifest)."""
    parent, _, job_id = job_dir.rpartition("/")
    storage = CheckpointStorage(parent or ".", job_id, filesystem=fs)
    checkpoint = storage.latest_completed()
    manifests = batch_ids(fs.list_dir(storage.layout.manifests_dir))
    if checkpoint is None and not manifests:
        raise CheckpointNotFoundError(
            f"{job_dir} has no completed checkpoint and no batch manifest: give a job "
            f"directory from `statebackend list`"
        )
    if checkpoint is not None:
        try:
            batch = checkpoint_batch(load_metadata(fs, checkpoint, signing_key))
        except CheckpointCorruptedError as exc:
            if not manifests:
                raise
            # As a restore does: the job goes on from its newest manifest.
            _log.warning("%s; %s/latest is the newest manifest", exc, job_dir)
            return job_dir, manifests[-1]
        if not manifests or (batch is not None and batch > manifests[-1]):
            return checkpoint, None
    return job_dir, manifests[-1]


def open_manifest(
    fs: CheckpointFileSystem, job_dir: str, batch_id: int, signing_key: SigningKey | None = None
) -> ManifestRef:
    """Manifest ``batch_id`` of the job in ``job_dir``, with its base checkpoint.

    With a ``signing_key`` the manifest and its base checkpoint must be signed with it,
    and the records and the base's files are read only where they match their signed
    digests. Raises CheckpointNotFoundError if the manifest does not exist,
    CheckpointCorruptedError if it or its base checkpoint is malformed, unsigned or
    changed, or the base is gone.
    """
    changelog = job_changelog(fs, job_dir, signing_key)
    path = changelog.layout.manifest_path(batch_id)
    if not fs.exists(path):
        known = ", ".join(map(str, changelog.manifest_ids())) or "none"
        raise CheckpointNotFoundError(
            f"{path} is not a committed batch manifest (the job has manifests {known}): "
            f"give one from `statebackend list`"
        )
    manifest = changelog.load_manifest(batch_id)
    base = None
    directory = changelog.base_directory(manifest)
    if directory is not None:
        try:
            metadata = load_metadata(fs, directory, signing_key)
            base = CheckpointRef(fs, directory, metadata, signing_key)
        except CheckpointNotFoundError as exc:
            raise CheckpointCorruptedError(
                f"the base checkpoint {directory} of manifest {batch_id} is gone: {exc}"
            ) from exc
    return ManifestRef(changelog, manifest, base)


def open_state(
    url: str,
    storage_options: dict[str, Any] | None = None,
    signing_key: SigningKey | None = None,
) -> StateRef:
    """The checkpoint, savepoint or batch manifest ``url`` names (see the module
    docstring), opened and checked as ``open_checkpoint`` and ``open_manifest`` do."""
    path = checkpoint_directory(url)
    directory, name = posixpath.split(path)
    if name == LATEST and directory:
        fs = open_location(url, storage_options)
        path, batch_id = _latest(fs, directory, signing_key)
        if batch_id is not None:
            return open_manifest(fs, path, batch_id, signing_key)
        return open_checkpoint(path, storage_options, signing_key)
    manifest = _manifest_name(path)
    if manifest is not None:
        fs = open_location(url, storage_options)
        return open_manifest(fs, *manifest, signing_key)
    return open_checkpoint(path, storage_options, signing_key)
