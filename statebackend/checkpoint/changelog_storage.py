"""A job's per-batch changelog in its checkpoint storage: records, manifests, truncation.

Protocol (one micro-batch B; DESIGN.md "Structured Streaming and the changelog"):

- each keyed subtask attempt, at the end of its batch, drains its backend's changes and
  ``write_record``s them: one file, written synchronously with one PUT (a temp file and a
  rename on file systems that rename atomically), ``changelog/<B>/<op>-<i>-<attempt>``;
  it returns the record's handle to the driver (e.g. in its result row);
- the driver accepts one attempt per subtask and ``commit``s manifest B, which is written
  once: committing B again with the same content is a no-op, with other content an error;
- when a materialized checkpoint N, taken at the end of batch b, has completed, the driver
  calls ``materialized(N, b)``: the next manifests build on N and drop the records of
  batches <= b;
- ``cleanup`` (run by ``commit``, or on its own off the critical path) keeps the newest
  ``retained`` manifests and deletes every record of a committed batch that none of them
  references: records at or below their bases, and the attempts the driver did not accept.
  Records of batches newer than the newest manifest are never touched (they may be in
  flight). ``statebackend gc`` never deletes manifests, and deletes only records of
  batches up to the newest manifest that no manifest references (``tools/gc.py``).

The checkpoints that retained manifests build on must outlive them:
``referenced_checkpoints`` names them for the checkpoint retention.

The driver is the job's only committer (one driver per job directory, fenced by leader
epochs), so its ``ChangelogStorage`` lists the manifests once and then keeps the list as
it commits and deletes them (listing them again when a batch does not follow the newest
it knows: another object of the driver committed meanwhile), and ``cleanup`` looks only
at the records directories of the batches committed since its previous run but one (to
delete the attempts not accepted, and a late straggler's) and of the batches no longer
referenced (deleted whole, with any record a zombie attempt wrote later). A batch then
costs the driver a bounded number of storage calls (check, write, two listings,
deletes), whatever the checkpoint interval. The first ``cleanup`` of an instance, and
the first after ``restart`` or a listing again, lists the whole changelog.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from statebackend.backends.changelog import ChangeSet
from statebackend.backends.operator import OperatorStateCut
from statebackend.checkpoint.layout import batch_ids, join, metadata_path
from statebackend.checkpoint.manifest import BatchManifest, ManifestBase, next_manifest
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.checksums import checksum
from statebackend.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    ConfigurationError,
    IncompatibleStateError,
    StateBackendError,
)
from statebackend.snapshot.changelog_format import (
    ChangelogHandle,
    encode_changes,
    encode_operator_state,
)
from statebackend.snapshot.frames import CODECS, check_codec
from statebackend.snapshot.handles import normalize_path, resolve_path
from statebackend.state.ttl import Clock

DEFAULT_RETAINED_MANIFESTS = 3
_log = logging.getLogger(__name__)


class ChangelogStorage:
    """The changelog records and batch manifests of the job of ``storage``.

    Records are compressed with the storage's ``compression``. ``retained`` manifests
    are kept (at least 1).
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        *,
        retained: int = DEFAULT_RETAINED_MANIFESTS,
        clock: Clock = time.time,
    ) -> None:
        if retained < 1:
            raise ConfigurationError(f"retained manifests {retained!r} is invalid: keep >= 1")
        self.storage = storage
        self.fs = storage.fs
        self.layout = storage.layout
        self.retained = retained
        self.clock = clock
        self._codec = check_codec(storage.compression)
        self._base: ManifestBase | None = None
        self._manifests: dict[int, BatchManifest] = {}
        """Manifests read or written so far: a manifest never changes once written."""
        self._ids: list[int] | None = None
        """The committed batches with a manifest, as this committer knows them (None:
        list them at the next need)."""
        self._swept: int | None = None
        """The newest batch whose records ``cleanup`` has looked at since the changelog
        was last listed whole (None: list it whole at the next ``cleanup``)."""
        self._referenced: set[int] = set()
        """The batches the retained manifests referenced at the last ``cleanup``."""
        self._recent: set[int] = set()
        """The referenced batches committed between the last two ``cleanup`` runs."""

    # -- subtasks -------------------------------------------------------------------------

    def write_record(
        self,
        batch_id: int,
        operator_id: str,
        subtask: int,
        attempt: str,
        changes: ChangeSet,
        operator_state: OperatorStateCut | None = None,
    ) -> ChangelogHandle:
        """Write one subtask attempt's changes of batch B, and its ``operator_state`` at
        the end of B if given, durably; its handle.

        A batch without changes or operator state writes no file. Each attempt writes its
        own file, so a retried or speculative attempt never overwrites another's.
        """
        path = self.layout.changelog_path(batch_id, operator_id, subtask, attempt)
        data, key_groups = encode_changes(changes, self._codec)
        operator_info = None
        if operator_state is not None:
            frame, operator_info = encode_operator_state(operator_state, len(data), self._codec)
            data += frame
        if data:
            self.fs.write_atomic(path, data)
        return ChangelogHandle(
            batch_id=batch_id,
            operator_id=operator_id,
            subtask=subtask,
            attempt=attempt,
            path=self._relative(path) if data else None,
            size=len(data),
            checksum=checksum(data, self.fs.checksum_algorithm),
            changes=len(changes),
            key_group_range=changes.key_group_range,
            key_groups=tuple(key_groups),
            states=tuple(changes.states),
            key_serializer=changes.key_serializer,
            compression=CODECS[self._codec],
            timers=changes.timers,
            operator_state=operator_info,
        )

    # -- the driver -----------------------------------------------------------------------

    def commit(
        self,
        batch_id: int,
        accepted: Mapping[str, Sequence[ChangelogHandle]],
        *,
        max_parallelism: int,
        properties: Mapping[str, Any] | None = None,
        cleanup: bool = True,
    ) -> BatchManifest:
        """Write manifest B: the newest manifest's records (after the base set by
        ``materialized``) plus ``accepted`` (per operator, one record per subtask in
        subtask order). Then ``cleanup`` unless told not to; a storage failure there is
        logged and the deletions retried at the next commit (the batch is committed).

        If manifest B exists already with the same content, returns it (a re-run of a
        committed batch); with other content raises CheckpointError. Manifests are
        written atomically and never overwritten.
        """
        path = self.layout.manifest_path(batch_id)
        if self.fs.exists(path):
            existing = self.load_manifest(batch_id)
            if existing.accepted(accepted) and existing.properties == dict(properties or {}):
                return existing
            raise CheckpointError(
                f"{path} already commits batch {batch_id} with other records or "
                f"properties: a batch is committed once (is another driver running?)"
            )
        known = self._ids is not None
        ids = self._committed_ids()
        if known and (ids[-1] if ids else -1) != batch_id - 1:
            # Batches follow each other: another committer of the job (a query restarted
            # on another object), or a write this one saw fail, may have committed since.
            self._ids = self._swept = None
            ids = self._committed_ids()
        previous = self.load_manifest(ids[-1]) if ids else None
        base = None if previous is None else previous.base
        if self._base is not None and (base is None or base.batch_id < self._base.batch_id):
            base = self._base
        manifest = next_manifest(
            previous,
            job_id=self.storage.job_id,
            batch_id=batch_id,
            max_parallelism=max_parallelism,
            accepted=accepted,
            base=base,
            properties=properties,
            committed_at=self.clock(),
        )
        self.fs.write_atomic(path, manifest.to_bytes(self.storage.signing_key))
        self._manifests[batch_id] = manifest
        bisect.insort(ids, batch_id)
        if cleanup:
            try:
                self.cleanup()
            except CheckpointError:  # the batch is committed: deleting is retried later
                self._ids = self._swept = None  # list everything again at the next cleanup
                _log.warning(
                    "batch %s is committed, but deleting what no retained manifest needs "
                    "failed; the next commit retries",
                    batch_id,
                    exc_info=True,
                )
        return manifest

    def materialized(self, checkpoint_id: int, batch_id: int, directory: str | None = None) -> None:
        """Checkpoint N, taken at the end of batch b, completed: later manifests build on
        it. Its subtasks must have cut the state of the attempts manifest b accepted, after
        their batch (state(b)). ``directory`` defaults to the job's ``chk-<N>``.

        Raises CheckpointError if batch b is not committed yet or N is not complete.
        """
        latest = self._committed_ids()
        if not latest or latest[-1] < batch_id:
            raise CheckpointError(
                f"checkpoint {checkpoint_id} of batch {batch_id} cannot become the base "
                f"before manifest {batch_id} is committed: commit the batch first"
            )
        base = self._completed_base(checkpoint_id, batch_id, directory)
        if self._base is None or self._base.batch_id < batch_id:
            self._base = base

    def restart(
        self, batch_id: int | None, checkpoint_id: int = 0, directory: str | None = None
    ) -> list[int]:
        """The job continues from completed checkpoint N (``directory``, default its
        ``chk-<N>``), taken at the end of batch b, or from nothing (``batch_id`` None),
        instead of from its newest manifest: the manifests of later batches (a history
        that is abandoned) are deleted, and the next manifest builds on N. Returns the
        batches whose manifests were deleted.

        Raises CheckpointError if N is not complete.
        """
        base = (
            None if batch_id is None else self._completed_base(checkpoint_id, batch_id, directory)
        )
        after = -1 if batch_id is None else batch_id
        ids = self.manifest_ids()
        dropped = [old for old in ids if old > after]
        for old in reversed(dropped):  # newest first: a crash leaves a prefix of the history
            self.fs.delete(self.layout.manifest_path(old))
            self._manifests.pop(old, None)
        self._base = base
        self._ids = [old for old in ids if old <= after]
        self._swept = None
        return dropped

    def _completed_base(
        self, checkpoint_id: int, batch_id: int, directory: str | None
    ) -> ManifestBase:
        own = self.layout.checkpoint_path(checkpoint_id)
        directory = own if directory is None else directory.rstrip("/")
        if not self.fs.exists(metadata_path(directory)):
            raise CheckpointError(f"{directory} is not a completed checkpoint: no _metadata")
        # The job's own checkpoint however it was spelled (a restore from file:///ck/job/
        # chk-3 of a job in /ck): relative, so that retention keeps it while it is a base.
        path = self._relative(own) if self.fs.same_path(directory, own) else directory
        return ManifestBase(checkpoint_id, batch_id, path)

    def cleanup(self) -> list[str]:
        """Keep the newest ``retained`` manifests; delete the records of committed
        batches that none of them references (between materializations: of the batches
        committed since the last ``cleanup``). Returns the deleted paths."""
        ids = self._committed_ids()
        if not ids:
            return []
        deleted = []
        for old in ids[: -self.retained]:
            path = self.layout.manifest_path(old)
            self.fs.delete(path)
            self._manifests.pop(old, None)
            deleted.append(path)
        del ids[: -self.retained]
        kept = [self.load_manifest(batch_id) for batch_id in ids]
        referenced = {
            resolve_path(self.layout.manifests_dir, f.path) for m in kept for f in m.files()
        }
        referenced_batches = {h.batch_id for m in kept for h in m.handles()}
        if self._swept is None:
            swept = batch_ids(self.fs.list_dir(self.layout.changelog_dir))
            self._recent = referenced_batches & {ids[-1]}
        else:  # older batches were looked at twice: their records are as they were
            committed = referenced_batches.intersection(range(self._swept + 1, ids[-1] + 1))
            unreferenced = self._referenced - referenced_batches
            recent = self._recent & referenced_batches
            swept = sorted(unreferenced | committed | recent)
            self._recent = committed
        self._swept, self._referenced = ids[-1], referenced_batches
        for batch_id in swept:
            if batch_id > ids[-1]:
                continue
            directory = self.layout.batch_changelog_dir(batch_id)
            if batch_id not in referenced_batches:
                self.fs.delete(directory, recursive=True)
                deleted.append(directory)
                continue
            for name in self.fs.list_dir(directory):
                path = join(directory, name)
                if normalize_path(path) not in referenced:
                    self.fs.delete(path)
                    deleted.append(path)
        return deleted

    # -- reading --------------------------------------------------------------------------

    def manifest_ids(self) -> list[int]:
        """The committed batches that have a manifest, ascending."""
        return batch_ids(self.fs.list_dir(self.layout.manifests_dir))

    def _committed_ids(self) -> list[int]:
        """The committed batches that have a manifest, ascending, as this committer
        knows them (listed once, then kept as it commits and deletes); not a copy."""
        if self._ids is None:
            self._ids = self.manifest_ids()
        return self._ids

    def load_manifest(self, batch_id: int) -> BatchManifest:
        """Manifest B, validated; CheckpointCorruptedError naming it if it is missing,
        malformed or of another job or batch."""
        cached = self._manifests.get(batch_id)
        if cached is not None:
            return cached
        data = self.fs.read_file(self.layout.manifest_path(batch_id))
        return self._parse_manifest(batch_id, data)

    def load_manifests(self, ids: Sequence[int]) -> list[BatchManifest | StateBackendError]:
        """Manifests ``ids``, read with several requests in flight, each as
        ``load_manifest`` gives it or the error it raises (a CheckpointError, an
        IncompatibleStateError), in order."""
        paths = {b: self.layout.manifest_path(b) for b in ids if b not in self._manifests}
        read = dict(zip(paths, self.fs.read_files(list(paths.values())), strict=True))
        loaded: list[BatchManifest | StateBackendError] = []
        for batch_id in ids:
            data = read.get(batch_id)
            try:
                if isinstance(data, CheckpointError):
                    raise data
                loaded.append(
                    self.load_manifest(batch_id)
                    if data is None
                    else self._parse_manifest(batch_id, data)
                )
            except (CheckpointError, IncompatibleStateError) as exc:
                loaded.append(exc)
        return loaded

    def _parse_manifest(self, batch_id: int, data: bytes) -> BatchManifest:
        path = self.layout.manifest_path(batch_id)
        manifest = BatchManifest.from_bytes(data, path, self.storage.signing_key)
        if manifest.job_id != self.storage.job_id or manifest.batch_id != batch_id:
            raise CheckpointCorruptedError(
                f"{path} commits batch {manifest.batch_id} of job {manifest.job_id!r}, not "
                f"batch {batch_id} of job {self.storage.job_id!r}"
            )
        self._manifests[batch_id] = manifest
        return manifest

    def latest_manifest(self) -> BatchManifest | None:
        """The newest manifest (what a restore after a crash starts from), or None."""
        ids = self.manifest_ids()
        return self.load_manifest(ids[-1]) if ids else None

    def _relative(self, path: str) -> str:
        """``path`` in the job directory, relative to the manifests directory."""
        return "../" + path[len(self.layout.job_dir) :].lstrip("/")

    def base_directory(self, manifest: BatchManifest) -> str | None:
        """The directory of ``manifest``'s base checkpoint, or None."""
        if manifest.base is None:
            return None
        path = manifest.base.path
        if path.startswith("../"):
            return resolve_path(self.layout.manifests_dir, path)
        return path

    def record_path(self, handle: ChangelogHandle) -> str | None:
        """The path of a record's file (None for a batch without changes)."""
        if handle.path is None:
            return None
        return resolve_path(self.layout.manifests_dir, handle.path)

    def referenced_checkpoints(self) -> set[int]:
        """Ids of the job's own checkpoints the retained manifests build on: retention
        of checkpoints must keep them (a savepoint base elsewhere is not the job's)."""
        ids = self.manifest_ids()[-self.retained :]
        manifests = (self.load_manifest(batch_id) for batch_id in ids)
        return {m.base.checkpoint_id for m in manifests if m.base is not None and self._is_own(m)}

    def _is_own(self, manifest: BatchManifest) -> bool:
        """Whether ``manifest``'s base is one of the job's checkpoints, not a savepoint
        elsewhere (also when the manifest recorded it by an absolute spelling)."""
        directory = self.base_directory(manifest)
        assert manifest.base is not None and directory is not None
        return self.fs.same_path(
            directory, self.layout.checkpoint_path(manifest.base.checkpoint_id)
        )
