"""Batch manifests: the small JSON document that commits a micro-batch's state.

Manifest B (``<job>/manifests/<B>``, written once by the driver) says how to rebuild the
keyed state as it was at the end of batch B, on its own: the base materialized
checkpoint (None before the first one completed) and, per operator, the changelog
records of every batch after the base up to B, one accepted record per subtask and batch
(the attempt the driver accepted, which absorbs task retries and speculative copies).
Free-form ``properties`` carry what else the job commits with the batch (watermarks,
source offsets): the changelog carries keyed state only, so the operator state a driver
holds (the source offsets) is committed there. Paths are relative to the manifests
directory (``../chk-<N>``, ``../changelog/<B>/...``), like every handle's. A
``"checksum"`` field (the CRC-32 of the rest, as in ``_metadata``) makes damage to any
of it, the source offsets included, a CheckpointCorruptedError when it is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from statebackend.checkpoint.layout import CHANGELOG_DIR, is_plain_name
from statebackend.checkpoint.metadata import index_problem
from statebackend.checkpoint.signing import (
    SigningKey,
    check_document,
    check_signable,
    check_signed_files,
    document_bytes,
)
from statebackend.checksums import algorithm_of
from statebackend.errors import (
    MALFORMED_DOCUMENT,
    CheckpointCorruptedError,
    CheckpointError,
    IncompatibleStateError,
)
from statebackend.keygroups import (
    UPPER_BOUND_MAX_PARALLELISM,
    compute_key_group_range_for_operator_index,
)
from statebackend.snapshot.changelog_format import ChangelogHandle
from statebackend.snapshot.handles import StoredFile

MANIFEST_FORMAT_VERSION = 1
_FIELDS = frozenset(
    {
        "format_version",
        "kind",
        "job_id",
        "batch_id",
        "max_parallelism",
        "committed_at",
        "base",
        "properties",
        "state_meta",
        "operators",
    }
)
"""The top-level fields of a manifest besides its checksum and signature: all that a
release writing no checksum wrote (the same version 1)."""
_KIND = "batch-manifest"
SOURCE_OPERATOR = "source"
"""The operator id of a ``StatefulJob``'s source, whose offsets its driver holds."""
SOURCE_OFFSETS_STATE = "offsets"
"""The source operator's split list state: (partition, byte offset) per owned partition."""
SOURCE_OFFSETS_PROPERTY = "offsets"
"""Property of a ``StatefulJob``'s manifests (and of savepoints folded from them): the
source offsets after the batch, ``[[partition, offset], ...]`` per source subtask, which
are the source's ``offsets`` operator state in its checkpoints."""
FOLDED_FROM_PROPERTY = "folded_from_manifest"
"""Savepoint property: the batch of the manifest the savepoint was folded from. Such a
savepoint holds no driver-held operator state: a job restoring it takes that state from
the manifest's properties, which the savepoint carries."""


def source_offsets(properties: Mapping[str, Any], where: str) -> list[list[tuple[int, int]]] | None:
    """The source offsets committed in ``properties`` (``SOURCE_OFFSETS_PROPERTY``): per
    source subtask, its (partition, byte offset) pairs; None if there are none.
    CheckpointCorruptedError naming ``where`` unless they are pairs of integers >= 0."""
    offsets = properties.get(SOURCE_OFFSETS_PROPERTY)
    if offsets is None:
        return None
    if isinstance(offsets, list) and all(
        isinstance(share, list) and all(_is_offset_pair(pair) for pair in share)
        for share in offsets
    ):
        return [[(partition, offset) for partition, offset in share] for share in offsets]
    raise CheckpointCorruptedError(
        f"{where}: the source offsets {json.dumps(offsets)[:80]} are not [partition, byte "
        f"offset] pairs of integers >= 0 per source subtask; restore from another manifest "
        f"or checkpoint"
    )


def _is_offset_pair(pair: Any) -> bool:
    return (
        isinstance(pair, list)
        and len(pair) == 2
        and all(type(number) is int and number >= 0 for number in pair)
    )


def _compact(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), sort_keys=True).encode("utf-8")


@dataclass(frozen=True)
class ManifestBase:
    """The materialized checkpoint a manifest builds on: checkpoint N, taken at the end
    of batch ``batch_id``; ``path`` is its directory, relative to the manifests
    directory (``../chk-<N>``) or, for a savepoint elsewhere, absolute."""

    checkpoint_id: int
    batch_id: int
    path: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {"checkpoint_id": self.checkpoint_id, "batch_id": self.batch_id, "path": self.path}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ManifestBase:
        """The inverse of ``to_json``."""
        return cls(int(data["checkpoint_id"]), int(data["batch_id"]), str(data["path"]))


@dataclass(frozen=True)
class BatchRecords:
    """One operator's accepted changelog records of one batch, by subtask index."""

    batch_id: int
    parallelism: int
    subtasks: tuple[ChangelogHandle, ...]

    def to_json(self, metas: _MetaTable) -> dict[str, Any]:
        """A JSON-able dict, the handles' state meta info kept in ``metas``."""
        return {
            "batch_id": self.batch_id,
            "parallelism": self.parallelism,
            "subtasks": [metas.compact(handle) for handle in self.subtasks],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], metas: list[dict[str, Any]]) -> BatchRecords:
        """The inverse of ``to_json``."""
        return cls(
            int(data["batch_id"]),
            int(data["parallelism"]),
            tuple(
                ChangelogHandle.from_json({**h, **_meta(metas, h["meta"])})
                for h in data["subtasks"]
            ),
        )


def _meta(metas: list[dict[str, Any]], index: Any) -> dict[str, Any]:
    """Entry ``index`` of a manifest's meta-info table; IndexError unless ``index`` is one
    of its positions (a negative one would name another entry)."""
    if type(index) is not int or not 0 <= index < len(metas):
        raise IndexError(f"meta info index {index!r} is not in 0..{len(metas) - 1}")
    return metas[index]


class _MetaTable:
    """The distinct (states, key serializer) of a manifest's handles, each written once:
    every record of every subtask and batch repeats them, mostly unchanged."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._index: dict[str, int] = {}

    def compact(self, handle: ChangelogHandle) -> dict[str, Any]:
        """The handle's JSON with its meta info replaced by an index into the table."""
        data = handle.to_json()
        meta = {"states": data.pop("states"), "key_serializer": data.pop("key_serializer")}
        key = json.dumps(meta, sort_keys=True)
        if key not in self._index:
            self._index[key] = len(self.entries)
            self.entries.append(meta)
        data["meta"] = self._index[key]
        return data


@dataclass(frozen=True)
class BatchManifest:
    """The content of manifest B (see the module docstring)."""

    job_id: str
    batch_id: int
    max_parallelism: int
    base: ManifestBase | None
    operators: dict[str, tuple[BatchRecords, ...]]
    """Per operator, its records of the batches after the base, ascending."""
    properties: dict[str, Any] = field(default_factory=dict)
    committed_at: float = 0.0

    def parallelism(self, operator_id: str) -> int:
        """The operator's parallelism in batch B."""
        return self.operators[operator_id][-1].parallelism

    def handles(self) -> Iterator[ChangelogHandle]:
        """Every changelog record the manifest references."""
        for batches in self.operators.values():
            for records in batches:
                yield from records.subtasks

    def files(self) -> list[StoredFile]:
        """(path relative to the manifests directory, size, checksum) of every record file."""
        return [f for handle in self.handles() for f in handle.files()]

    def to_json(self) -> dict[str, Any]:
        """The manifest as a JSON-able dict."""
        metas = _MetaTable()
        operators = {
            operator_id: {
                "parallelism": batches[-1].parallelism,
                "batches": [records.to_json(metas) for records in batches],
            }
            for operator_id, batches in sorted(self.operators.items())
        }
        return {
            "format_version": MANIFEST_FORMAT_VERSION,
            "kind": _KIND,
            "job_id": self.job_id,
            "batch_id": self.batch_id,
            "max_parallelism": self.max_parallelism,
            "committed_at": self.committed_at,
            "base": None if self.base is None else self.base.to_json(),
            "properties": self.properties,
            "state_meta": metas.entries,
            "operators": operators,
        }

    def to_bytes(self, signing_key: SigningKey | None = None) -> bytes:
        """The manifest file's bytes; with ``signing_key`` signed (HMAC-SHA256 over the
        bytes without the signature, as ``_metadata``). Raises CheckpointError if signing
        was asked for but a record has no SHA-256 checksum."""
        if signing_key is not None:
            check_signable(
                self.files(),
                f"manifest {self.batch_id}",
                "write the changelog with the signing key set",
            )
        return document_bytes(self.to_json(), _compact, signing_key)

    def accepted(self, records: Mapping[str, Sequence[ChangelogHandle]]) -> bool:
        """Whether this manifest accepted exactly ``records`` (per operator, by subtask)
        in its own batch."""
        for operator_id, handles in records.items():
            batches = self.operators.get(operator_id, ())
            if not batches or batches[-1].batch_id != self.batch_id:
                return False
            if batches[-1].subtasks != tuple(handles):
                return False
        return True

    @classmethod
    def from_bytes(
        cls, data: bytes, where: str, signing_key: SigningKey | None = None
    ) -> BatchManifest:
        """Parse and validate a manifest read from ``where``; with ``signing_key`` its
        signature is checked first, and an unsigned manifest, or one naming a record
        without a SHA-256 checksum, is refused.

        Raises IncompatibleStateError for a format version this release cannot read and
        CheckpointCorruptedError naming ``where`` for anything malformed, inconsistent or
        not signed.
        """
        try:
            document = json.loads(data)
            version = document["format_version"]
            kind = document["kind"]
        except Exception as exc:
            raise CheckpointCorruptedError(f"{where}: not a batch manifest") from exc
        if kind != _KIND:
            raise CheckpointCorruptedError(f"{where}: not a batch manifest (kind {kind!r})")
        check_document(document, _compact, signing_key, where, "manifest or checkpoint", _FIELDS)
        if not isinstance(version, int) or not 1 <= version <= MANIFEST_FORMAT_VERSION:
            raise IncompatibleStateError(
                f"{where} has manifest format version {version!r}; this statebackend reads up "
                f"to version {MANIFEST_FORMAT_VERSION}: upgrade statebackend to restore it"
            )
        try:
            base = document["base"]
            metas = list(document["state_meta"])
            manifest = cls(
                job_id=str(document["job_id"]),
                batch_id=int(document["batch_id"]),
                max_parallelism=int(document["max_parallelism"]),
                base=None if base is None else ManifestBase.from_json(base),
                operators={
                    operator_id: tuple(BatchRecords.from_json(b, metas) for b in op["batches"])
                    for operator_id, op in document["operators"].items()
                },
                properties=dict(document.get("properties", {})),
                committed_at=float(document["committed_at"]),
            )
        except MALFORMED_DOCUMENT as exc:
            raise CheckpointCorruptedError(f"{where}: malformed batch manifest: {exc}") from exc
        problem = manifest.inconsistency()
        if problem is not None:
            raise CheckpointCorruptedError(f"{where}: inconsistent batch manifest: {problem}")
        if signing_key is not None:
            check_signed_files(manifest.files(), where)
        return manifest

    def inconsistency(self) -> str | None:
        """What is wrong with the manifest's structure, or None."""
        if not 1 <= self.max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
            return (
                f"max parallelism {self.max_parallelism} is not in 1..{UPPER_BOUND_MAX_PARALLELISM}"
            )
        if not math.isfinite(self.committed_at):
            return f"committed_at {self.committed_at!r} is not a time"
        low = -1 if self.base is None else self.base.batch_id
        if self.base is not None and self.base.batch_id > self.batch_id:
            return f"base batch {self.base.batch_id} is after batch {self.batch_id}"
        if self.base is not None and (self.base.checkpoint_id < 0 or self.base.batch_id < -1):
            return (
                f"base checkpoint {self.base.checkpoint_id} of batch {self.base.batch_id} "
                f"is no checkpoint"
            )
        for operator_id, batches in self.operators.items():
            if not batches:
                return f"operator {operator_id!r} has no batches"
            previous = low
            for records in batches:
                if not previous < records.batch_id <= self.batch_id:
                    return (
                        f"operator {operator_id!r} lists batch {records.batch_id} after "
                        f"{previous}, outside {low + 1}..{self.batch_id}"
                    )
                previous = records.batch_id
                problem = _records_problem(operator_id, records, self.max_parallelism)
                if problem is not None:
                    return problem
        return None


def _records_problem(operator_id: str, records: BatchRecords, max_parallelism: int) -> str | None:
    if not 1 <= records.parallelism <= max_parallelism:
        return f"operator {operator_id!r} has parallelism {records.parallelism}"
    if len(records.subtasks) != records.parallelism:
        return (
            f"operator {operator_id!r} batch {records.batch_id} has {len(records.subtasks)} "
            f"records for parallelism {records.parallelism}"
        )
    for index, handle in enumerate(records.subtasks):
        expected = compute_key_group_range_for_operator_index(
            max_parallelism, records.parallelism, index
        )
        if (
            handle.operator_id != operator_id
            or handle.subtask != index
            or handle.batch_id != records.batch_id
            or handle.key_group_range != expected
        ):
            return (
                f"operator {operator_id!r} batch {records.batch_id} subtask {index} names the "
                f"record of {handle.operator_id!r} subtask {handle.subtask} batch "
                f"{handle.batch_id} for key groups {handle.key_group_range}"
            )
        problem = _record_problem(handle)
        if problem is not None:
            return f"operator {operator_id!r} batch {records.batch_id} subtask {index}: {problem}"
    return None


def _record_problem(handle: ChangelogHandle) -> str | None:
    """What is wrong with a record's file (it is not one of its batch's records in the
    job's changelog: ``../changelog/<B>/<name>``), size, checksum or index."""
    directory = f"../{CHANGELOG_DIR}/{handle.batch_id}/"
    if handle.path is not None:
        name = handle.path.removeprefix(directory)
        if name == handle.path or not is_plain_name(name):
            return f"record path {handle.path!r} is not a file of {directory}"
    if handle.size < 0 or algorithm_of(handle.checksum) is None:
        return f"record {handle.path} has a negative size or a malformed checksum"
    info = handle.operator_state
    if info is not None and not 0 <= info.offset <= info.offset + info.length <= handle.size:
        return (
            f"record {handle.path}: its operator state at {info.offset}+{info.length} lies "
            f"outside its {handle.size} bytes"
        )
    return index_problem(handle)


def next_manifest(
    previous: BatchManifest | None,
    *,
    job_id: str,
    batch_id: int,
    max_parallelism: int,
    accepted: Mapping[str, Sequence[ChangelogHandle]],
    base: ManifestBase | None,
    properties: Mapping[str, Any] | None = None,
    committed_at: float = 0.0,
) -> BatchManifest:
    """Manifest ``batch_id``: ``previous``'s records after ``base`` plus the ``accepted``
    records of this batch (per operator, one per subtask in subtask order).

    Raises CheckpointError if the batch does not follow ``previous``, if ``base`` is
    older than ``previous``'s, or if the accepted records do not fit.
    """
    if previous is not None:
        if previous.batch_id >= batch_id:
            raise CheckpointError(
                f"batch {batch_id} cannot follow manifest {previous.batch_id} of job "
                f"{job_id!r}: batches commit in ascending order, so another query or driver "
                f"runs this job too; stop it: one run per job at a time"
            )
        if previous.max_parallelism != max_parallelism:
            raise CheckpointError(
                f"batch {batch_id} has max parallelism {max_parallelism}, manifest "
                f"{previous.batch_id} {previous.max_parallelism}: key groups are fixed"
            )
        if previous.base is not None and (base is None or base.batch_id < previous.base.batch_id):
            raise CheckpointError(
                f"the base of batch {batch_id} cannot be older than manifest "
                f"{previous.batch_id}'s (checkpoint {previous.base.checkpoint_id})"
            )
    after = -1 if base is None else base.batch_id
    operators: dict[str, tuple[BatchRecords, ...]] = {}
    if previous is not None:
        for operator_id, batches in previous.operators.items():
            kept = tuple(records for records in batches if records.batch_id > after)
            if kept:
                operators[operator_id] = kept
    for operator_id, handles in accepted.items():
        records = BatchRecords(batch_id, len(handles), tuple(handles))
        operators[operator_id] = (*operators.get(operator_id, ()), records)
    manifest = BatchManifest(
        job_id,
        batch_id,
        max_parallelism,
        base,
        operators,
        dict(properties or {}),
        committed_at,
    )
    problem = manifest.inconsistency()
    if problem is not None:
        raise CheckpointError(f"cannot commit batch {batch_id}: {problem}")
    return manifest
