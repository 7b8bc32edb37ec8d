"""Exactly-once for ``transform_with_state`` queries: bind, reconcile, commit, publish.

Spark writes ``commits/N`` after our ``foreachBatch`` function returns and, after a
failure, re-runs only the last batch without ``commits/N``. The keyed subtasks of batch N
write their state changes (``changelog/N``) and their output rows
(``outputs/N/<op>-<i>-<attempt>.parquet``) durably and return one metadata row each; the
driver then:

1. ``bind`` (once, at start): the Spark ``checkpointLocation`` and our job directory
   name each other (``statebackend-binding.json`` there, ``spark-binding.json`` here);
   pairing one with another's partner is a ConfigurationError.
2. ``BatchCommitter.reconcile(N)``: our newest manifest M. M >= N: Spark re-runs a batch
   we committed: its manifest is returned, nothing is processed again. M < N-1: error.
3. ``BatchCommitter.commit(N, rows)``: manifest N accepts the attempt of each subtask
   whose metadata row the driver collected (absorbing retried and speculative attempts)
   and names that attempt's staged output; the state of batch N is then
   base + changelogs, whatever dies afterwards.
4. ``publish``: the batch's output is read from manifest N's staged files, so a re-run
   publishes the very same rows. A ``parquet`` path sink gets them copied to
   ``part-<N>-<subtask>.parquet`` (overwriting is idempotent); other file sinks (any
   format, partitioned or not) get the files Spark writes into a hidden staging
   directory moved to ``part-<N>-<k>`` names, and an earlier attempt's extra files
   deleted (``publish_files``), and so do file-source catalog tables
   (``streaming_tables``); other sinks are appended to and guarded by a ``published/<N>``
   marker written after the write: a crash between the two appends the batch again.
   ``foreachBatch`` functions must, as with Spark, be idempotent by batch id. Every
   staged file is checked against the checksum manifest N holds for it
   (``OUTPUT_CHECKSUMS_PROPERTY``) before it is published; with a signing
   key that is a SHA-256 under the manifest's signature, so a staged file changed after
   its batch ran is refused (CheckpointCorruptedError naming it) instead of published.

Invariant: ``commits/N`` exists => manifest N exists => state(N) = base + changelogs.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.utils import get_protocol
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.types import (
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import (
    CheckpointFileSystem,
    absolute_location,
    normalize_url,
    open_filesystem,
)
from statebackend.checkpoint.layout import (
    LOCATION_BINDING_FILE,
    METADATA_FILE,
    SPARK_BINDING_FILE,
    batch_ids,
    join,
    metadata_path,
)
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metrics import BatchMetrics, record_to_json
from statebackend.checkpoint.signing import FILE_CHECKSUM
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.checksums import algorithm_of, checksum
from statebackend.errors import CheckpointCorruptedError, CheckpointError, ConfigurationError
from statebackend.snapshot.changelog_format import ChangelogHandle
from statebackend.spark.processor_handle import BatchTimes
from statebackend.spark.tasks import StorageSpec

OUTPUTS_PROPERTY = "outputs"
"""Manifest property: the staged output files of the accepted attempts, by subtask."""
OUTPUT_CHECKSUMS_PROPERTY = "output_checksums"
"""Manifest property: the checksum of each staged output file, by subtask (SHA-256 when
the job has a signing key, else CRC-32)."""

METADATA_SCHEMA = StructType(
    [
        StructField("subtask", IntegerType(), False),
        StructField("handle", StringType(), False),
        StructField("output", StringType(), False),
        StructField("rows", LongType(), False),
        StructField("metrics", StringType(), False),
        StructField("output_checksum", StringType(), False),
        StructField("restored_bytes", LongType(), False),
        StructField("restore_seconds", DoubleType(), False),
        StructField("entries", LongType(), True),
    ]
)
"""What a keyed subtask returns for batch N: its changelog handle (JSON), the path of
its staged output rows, their count, its ``BatchMetrics`` (JSON), the staged file's
checksum, the bytes and seconds it spent rebuilding its state from storage (0 when it
reused its local copy), and at a materialization the entries its state held at the cut
(an estimate; null in other batches)."""


def _read_json(fs: CheckpointFileSystem, path: str) -> dict[str, Any] | None:
    if not fs.exists(path):
        return None
    return dict(json.loads(fs.read_file(path)))


def _create_json(fs: CheckpointFileSystem, path: str, document: dict[str, Any]) -> bool:
    return fs.create_exclusive(path, json.dumps(document, sort_keys=True).encode("utf-8"))


def _holds_binding(fs: CheckpointFileSystem, path: str, binding_id: str) -> bool:
    """Whether the binding file ``path`` holds ``binding_id``: an earlier try of the
    ``create_exclusive`` that found it there wrote it (its response was lost)."""
    found = _read_json(fs, path)
    return found is not None and found.get("binding_id") == binding_id


def _options_for(url: str, storage: CheckpointStorage, options: dict[str, Any]) -> dict[str, Any]:
    """The storage options for ``url`` (a sink, or Spark's checkpointLocation): our
    checkpoints' if it has their protocol, else none."""
    same = get_protocol(url) == get_protocol(storage.layout.checkpoint_dir)
    return options if same else {}


def location_filesystem(
    url: str, storage: CheckpointStorage, options: dict[str, Any]
) -> CheckpointFileSystem:
    """The file system of ``url`` (a sink, or Spark's checkpointLocation), opened with
    ``_options_for`` it."""
    return open_filesystem(url, _options_for(url, storage, options))


QUERY_PROPERTY = "query"
"""Manifest property: what a restart of the query must keep (``check_same_query``)."""
METRICS_PROPERTY = "metrics"
"""Manifest property: the batch's ``BatchMetrics`` (``record_to_json``), recorded again
if the run that committed the batch died before recording them."""
RESTORED_FROM = "restored_from"
"""Key of the ``QUERY_PROPERTY``: the savepoint or checkpoint the job's first batch
restored (``transform_with_state``'s ``restore_from``), or None."""


def check_same_query(manifest: BatchManifest, query: dict[str, Any], job_id: str) -> None:
    """Raise ConfigurationError naming the setting if ``query`` (``time_mode``,
    ``output_mode``, ``key``: the key columns' [name, type] pairs) differs from the query
    that committed ``manifest``, or if ``query`` names a ``restored_from`` the job did
    not start from. Spark refuses another time or output mode on restart, state keyed by
    other column types cannot be read (as in Spark, key columns renamed read it), and a
    job that has committed batches has its state. A manifest of an older release,
    without the property, passes the first checks."""
    committed = manifest.properties.get(QUERY_PROPERTY)
    if committed is None:
        committed = {}
    restart = "or start a new job_id with a new checkpointLocation"
    started = committed.get(RESTORED_FROM)
    requested = query.get(RESTORED_FROM)
    # One directory is one location however it is spelled (a path or a file: URL).
    if requested is not None and (
        not isinstance(started, str) or spark_location(requested) != spark_location(started)
    ):
        raise ConfigurationError(
            f"state job {job_id!r} has committed batches up to {manifest.batch_id}, started "
            f"from {started or 'empty state'}: restore_from={query[RESTORED_FROM]} applies "
            f"to a job's first start only; drop restore_from to resume the job, {restart} "
            f"from it"
        )
    if not committed:
        return
    for name in ("time_mode", "output_mode"):
        if committed[name] != query[name]:
            raise ConfigurationError(
                f"[STATE_STORE_INVALID_CONFIG_AFTER_RESTART] cannot change {name} from "
                f"{committed[name]!r} to {query[name]!r} between restarts of state job "
                f"{job_id!r} (committed up to batch {manifest.batch_id}): set {name}="
                f"{committed[name]!r}, {restart}"
            )
    if [kind for _, kind in committed["key"]] != [kind for _, kind in query["key"]]:
        before, now = (", ".join(" ".join(pair) for pair in q["key"]) for q in (committed, query))
        raise ConfigurationError(
            f"state job {job_id!r} is keyed by ({before}), this query by ({now}): its state "
            f"cannot be read with other keys; key_by the same columns, {restart}"
        )


def spark_location(checkpoint_location: str) -> str:
    """The one spelling of a Spark ``checkpointLocation``, which Spark resolves the same
    way: a path or ``file:`` URL is an absolute local path (a relative one from the
    driver's working directory), any URL is ``normalize_url``'d."""
    location = checkpoint_location
    if location.startswith("file:"):
        location = "/" + location.removeprefix("file:").lstrip("/")
    return normalize_url(absolute_location(location))


def _spark_side(
    storage: CheckpointStorage, checkpoint_location: str, options: dict[str, Any]
) -> tuple[str, CheckpointFileSystem, str]:
    """The Spark ``checkpointLocation`` as ``spark_location`` spells it, its file system,
    and the path of its binding file."""
    location = spark_location(checkpoint_location)
    spark_fs = location_filesystem(location, storage, options)
    return location, spark_fs, join(location, LOCATION_BINDING_FILE)


def is_bound(storage: CheckpointStorage, checkpoint_location: str, options: dict[str, Any]) -> bool:
    """Whether the Spark ``checkpointLocation`` is bound to a state job (a query started
    with it before)."""
    _, spark_fs, spark_path = _spark_side(storage, checkpoint_location, options)
    return spark_fs.exists(spark_path)


_BINDING = threading.Lock()
"""Held by ``bind``: its checks and writes are not one atomic step on storage, so two
queries of one job started at once in this process would both find it unbound."""
_BIND_TRIES = 3
"""A start that lost the race for a binding file reads both sides again; a race is lost
at most once per side."""


def bound_restore(storage: CheckpointStorage) -> tuple[str, str | None] | None:
    """How the job of ``storage`` was first started (``checkpointLocation <location>``:
    the query it is bound to, or ``toDF()``) and the ``restore_from`` that start recorded
    (None: it started from empty state); None if no start recorded one (the job never
    started, or a start of an older release bound it)."""
    job_side = _read_json(storage.fs, storage.layout.spark_binding_path)
    how = "toDF()"
    if job_side is None:
        job_side = _read_json(storage.fs, storage.layout.first_start_path)
    else:
        how = f"checkpointLocation {job_side['checkpoint_location']}"
    if job_side is None or RESTORED_FROM not in job_side:
        return None
    recorded = job_side[RESTORED_FROM]
    return how, None if recorded is None else str(recorded)


def record_first_start(storage: CheckpointStorage, restored_from: str | None) -> None:
    """Record in the job's directory that ``toDF()`` starts it with ``restored_from``
    (None: empty state), before its first batch runs, unless a start recorded it already
    (``bound_restore`` reads it); ConfigurationError if that start recorded another one
    (this stream read the job before it)."""
    path = storage.layout.first_start_path
    if not _create_json(storage.fs, path, {RESTORED_FROM: restored_from}):
        _check_same_start(storage, "toDF()", _read_json(storage.fs, path), restored_from)


def _check_same_start(
    storage: CheckpointStorage,
    how: str,
    recorded: dict[str, Any] | None,
    restored_from: str | None,
) -> None:
    """ConfigurationError if the start recorded in ``recorded`` (a binding or
    first-start file; ``how``: by what) was from another ``restore_from``."""
    if recorded is None or RESTORED_FROM not in recorded:
        return
    if not _same_restore(recorded[RESTORED_FROM], restored_from):
        # transform_with_state read the job before that start of it recorded this.
        raise ConfigurationError(
            f"state job {storage.job_id!r} was first started {_started(recorded[RESTORED_FROM])} "
            f"({how}), this start {_started(restored_from)}: call transform_with_state again "
            f"to go on as first started"
        )


def _same_restore(one: object, other: object) -> bool:
    """Whether two recorded ``restore_from`` are the same (None: empty state)."""
    if isinstance(one, str) and isinstance(other, str):
        return spark_location(one) == spark_location(other)
    return one is None and other is None


def _started(restored_from: object) -> str:
    return "from empty state" if restored_from is None else f"with restore_from={restored_from}"


def check_bound_restore(
    job_id: str, bound: tuple[str, str | None], requested: str | None
) -> str | None:
    """The ``restore_from`` a start of a job that has committed no batch goes on from:
    the one recorded at its first start (``bound``: ``bound_restore``), also when none is
    given now. ConfigurationError naming both if another one is given."""
    how, recorded = bound
    if requested is None or _same_restore(recorded, requested):
        return recorded
    raise ConfigurationError(
        f"state job {job_id!r} was first started {_started(recorded)} ({how}) and has "
        f"committed no batch yet: restore_from={requested} applies to a job's first start "
        f"only; drop restore_from to go on as first started, or start a new job_id (a query: "
        f"with a new checkpointLocation) from it"
    )


def check_recorded_restore(storage: CheckpointStorage, bound: tuple[str, str | None]) -> None:
    """ConfigurationError if the ``restore_from`` the job's first start recorded
    (``bound``: ``bound_restore``), which a start without one goes on from, is gone."""
    how, recorded = bound
    if recorded is not None and not storage.fs.exists(metadata_path(recorded)):
        raise ConfigurationError(
            f"state job {storage.job_id!r} was first started with restore_from={recorded} "
            f"({how}) and has committed no batch, but {recorded} is gone (no "
            f"{METADATA_FILE}): put that savepoint back to go on as first started, or start "
            f"a new job_id (a query: with a new checkpointLocation)"
        )


def bind(
    storage: CheckpointStorage,
    checkpoint_location: str,
    options: dict[str, Any],
    restored_from: str | None = None,
) -> str:
    """Bind the Spark ``checkpointLocation`` to the job of ``storage`` (first start) or
    check that they are bound to each other; the binding's id. The first start records
    ``restored_from`` (the state its first batch starts from) with the binding, so that a
    restart before a batch committed goes on from it (``bound_restore``); a start with
    another one is a ConfigurationError (``check_bound_restore``).

    Raises ConfigurationError naming both sides if either is bound to another partner,
    if the job has a partner location whose binding file is gone, or if an unbound job
    holds batches already (``toDF()`` or a ``StatefulJob`` ran them, or both binding
    files were deleted): a new Spark checkpoint would take the job's committed batches
    for its own re-runs and skip its own first batches.
    One binds at a time in this process (``_BINDING``); drivers in other processes
    race for each binding file, which is created only if absent (``create_exclusive``).
    """
    with _BINDING:
        for _ in range(_BIND_TRIES):
            binding_id = _bind(storage, checkpoint_location, options, restored_from)
            if binding_id is not None:
                return binding_id
    raise ConfigurationError(
        f"could not bind checkpointLocation {checkpoint_location} to state job "
        f"{storage.job_id!r}: other drivers keep binding them; run one query per job"
    )


def _bind(
    storage: CheckpointStorage,
    checkpoint_location: str,
    options: dict[str, Any],
    restored_from: str | None,
) -> str | None:
    """``bind``'s one try: the binding's id, or None if another driver wrote a binding
    file between this try's read and its write."""
    location, spark_fs, spark_path = _spark_side(storage, checkpoint_location, options)
    ours = {"checkpoint_dir": storage.layout.checkpoint_dir, "job_id": storage.job_id}
    theirs = _read_json(spark_fs, spark_path)
    job_side = _read_json(storage.fs, storage.layout.spark_binding_path)
    if theirs is not None and (
        theirs.get("job_id") != storage.job_id
        or not isinstance(theirs.get("checkpoint_dir"), str)
        # A local directory is the same as a path or a file: URL (one spelling, as Spark's).
        or spark_location(theirs["checkpoint_dir"]) != spark_location(ours["checkpoint_dir"])
    ):
        raise ConfigurationError(
            f"checkpointLocation {location} belongs to state job {theirs.get('job_id')!r} in "
            f"{theirs.get('checkpoint_dir')}, not to job {storage.job_id!r} in "
            f"{storage.layout.checkpoint_dir}: use that job_id, or a new checkpointLocation"
        )
    if job_side is not None and spark_location(job_side["checkpoint_location"]) != location:
        raise ConfigurationError(
            f"state job {storage.job_id!r} in {storage.layout.checkpoint_dir} belongs to "
            f"checkpointLocation {job_side.get('checkpoint_location')}, not to {location}: use "
            f"that checkpointLocation, or a new job_id"
        )
    if theirs is None and job_side is not None:
        raise ConfigurationError(
            f"checkpointLocation {location} of state job {storage.job_id!r} lost its "
            f"{LOCATION_BINDING_FILE} (was it deleted and recreated?): restore the Spark "
            f"checkpoint, or start a new job_id with a new checkpointLocation"
        )
    if theirs is None and job_side is None:
        committed = ChangelogStorage(storage).manifest_ids()
        if committed:
            raise ConfigurationError(
                f"state job {storage.job_id!r} in {storage.layout.checkpoint_dir} has "
                f"committed batches {committed[0]}..{committed[-1]} but is bound to no Spark "
                f"checkpointLocation, and checkpointLocation {location} is bound to no job: "
                f"a query would take those batches for its own. Restore the query's "
                f"checkpointLocation and the job's {SPARK_BINDING_FILE} if they were deleted; "
                f"else, to go on from that state, start the query with a new job_id and "
                f"restore_from a savepoint of it (statebackend savepoint create --from "
                f"{storage.layout.job_dir}/latest --to DIR)"
            )
    if job_side is None:  # toDF() may have recorded the job's first start
        first_start = _read_json(storage.fs, storage.layout.first_start_path)
        _check_same_start(storage, "toDF()", first_start, restored_from)
    created = theirs is None
    if theirs is None:
        theirs = {**ours, "binding_id": uuid.uuid4().hex}
        # First: a crash here leaves the job alone.
        if not _create_json(spark_fs, spark_path, theirs):
            return None
    binding_id = str(theirs["binding_id"])
    if job_side is None:
        won = False
        try:
            job_path = storage.layout.spark_binding_path
            job_binding = {
                "checkpoint_location": location,
                "binding_id": binding_id,
                RESTORED_FROM: restored_from,
            }
            won = _create_json(storage.fs, job_path, job_binding) or _holds_binding(
                storage.fs, job_path, binding_id
            )
        finally:
            # Unbind if the job's storage cannot be written (a missing bucket, no access),
            # so that a start with the storage corrected is not refused, or if another
            # driver bound the job first.
            if created and not won:
                with suppress(Exception):
                    spark_fs.delete(spark_path)
        if not won:
            return None
    elif job_side.get("binding_id") != binding_id:
        raise ConfigurationError(
            f"checkpointLocation {location} and state job {storage.job_id!r} were bound in "
            f"different runs: use a new checkpointLocation and a new job_id"
        )
    else:
        _check_same_start(storage, f"checkpointLocation {location}", job_side, restored_from)
    return binding_id


class BatchCommitter:
    """The driver's side of one job's batches: reconcile, commit, read the outputs."""

    def __init__(self, storage: CheckpointStorage, operator_id: str) -> None:
        self.storage = storage
        self.changelog = ChangelogStorage(storage)
        self.operator_id = operator_id

    def newest_batch(self) -> int | None:
        """The newest committed batch, or None for a job without manifests."""
        ids = self.changelog.manifest_ids()
        return ids[-1] if ids else None

    def reconcile(self, batch_id: int) -> BatchManifest | None:
        """Manifest ``batch_id`` if the batch is committed already (Spark re-runs it),
        else None: the batch must run. Raises CheckpointError if our state is older than
        batch ``batch_id - 1`` (the Spark checkpoint is ahead of the job's state, or the
        job's state is gone)."""
        newest = self.newest_batch()
        if newest is None:
            if batch_id > 0:
                raise CheckpointError(
                    f"Spark runs batch {batch_id} but job {self.storage.job_id!r} has no "
                    f"committed batch in {self.storage.layout.job_dir}: its state is missing "
                    f"(deleted?); restore the job directory, or start a new job_id with a "
                    f"new checkpointLocation"
                )
            return None
        if newest >= batch_id:
            if batch_id not in self.changelog.manifest_ids():
                raise CheckpointError(
                    f"batch {batch_id} is committed (newest manifest {newest}) but its manifest "
                    f"is gone: the Spark checkpointLocation is older than the job's state; "
                    f"use the job's own checkpointLocation"
                )
            return self.changelog.load_manifest(batch_id)
        if newest < batch_id - 1:
            raise CheckpointError(
                f"Spark runs batch {batch_id} but job {self.storage.job_id!r} committed only up "
                f"to batch {newest}: its state is older than the Spark checkpointLocation; use "
                f"the job's own checkpointLocation and state directory"
            )
        return None

    def commit(
        self,
        batch_id: int,
        rows: Iterable[Row],
        parallelism: int,
        max_parallelism: int,
        times: BatchTimes,
        query: dict[str, Any],
        metrics: BatchMetrics,
    ) -> BatchManifest:
        """Write manifest ``batch_id`` accepting the subtask attempts of ``rows`` (the
        collected metadata rows, one per subtask), with the ``query`` that ran it
        (``check_same_query``) and its ``metrics``. Raises CheckpointError if a subtask's
        row is missing."""
        by_subtask = {int(row.subtask): row for row in rows}
        missing = sorted(set(range(parallelism)) - set(by_subtask))
        if missing:
            raise CheckpointError(
                f"batch {batch_id}: no result from keyed subtasks {missing}: retry the batch"
            )
        ordered = [by_subtask[i] for i in range(parallelism)]
        handles = [ChangelogHandle.from_json(json.loads(row.handle)) for row in ordered]
        properties = {
            "batch_timestamp_ms": times.batch_timestamp_ms,
            "late_events_watermark_ms": times.late_events_watermark_ms,
            "eviction_watermark_ms": times.eviction_watermark_ms,
            OUTPUTS_PROPERTY: [str(row.output) for row in ordered],
            OUTPUT_CHECKSUMS_PROPERTY: [str(row.output_checksum) for row in ordered],
            "rows": sum(int(row.rows) for row in ordered),
            QUERY_PROPERTY: query,
            METRICS_PROPERTY: record_to_json(metrics),
        }
        manifest = self.changelog.commit(
            batch_id,
            {self.operator_id: handles},
            max_parallelism=max_parallelism,
            properties=properties,
        )
        self._drop_outputs_before(self.changelog.manifest_ids()[0])
        return manifest

    def _drop_outputs_before(self, oldest_kept: int) -> None:
        """Staged outputs and publish markers of batches no retained manifest commits."""
        layout, fs = self.storage.layout, self.storage.fs
        for directory in (layout.outputs_dir, layout.published_dir):
            for old in batch_ids(fs.list_dir(directory)):
                if old < oldest_kept:
                    fs.delete(join(directory, str(old)), recursive=True)

    @staticmethod
    def outputs(manifest: BatchManifest) -> list[str]:
        """The staged output files of a committed batch, by subtask."""
        return [str(path) for path in manifest.properties.get(OUTPUTS_PROPERTY, [])]


def staged_output(storage: CheckpointStorage, manifest: BatchManifest, subtask: int) -> bytes:
    """The bytes of subtask ``subtask``'s staged output of a committed batch, checked
    against the checksum the manifest holds for it. Raises CheckpointCorruptedError
    naming the file if they differ, or if the job has a signing key and the manifest
    holds no SHA-256 for it (the file would not be protected by the signature)."""
    path = BatchCommitter.outputs(manifest)[subtask]
    checksums = manifest.properties.get(OUTPUT_CHECKSUMS_PROPERTY)
    expected = None if checksums is None else str(checksums[subtask])
    signed = storage.signing_key is not None
    if signed and (expected is None or algorithm_of(expected) != FILE_CHECKSUM):
        raise CheckpointCorruptedError(
            f"staged output {path} of batch {manifest.batch_id} has no signed "
            f"{FILE_CHECKSUM} checksum in its manifest, so its content is not protected: "
            f"do not publish it; run the query with the signing key from its first batch"
        )
    data = storage.fs.read_file(path)
    if expected is not None:
        algorithm = algorithm_of(expected)
        if algorithm is None or checksum(data, algorithm) != expected:
            raise CheckpointCorruptedError(
                f"staged output {path} does not match the {'signed ' if signed else ''}"
                f"checksum in manifest {manifest.batch_id} ({expected}): it was changed "
                f"after the batch ran; restore the file or do not publish the batch"
            )
    return data


def batch_output(
    spark: SparkSession, spec: StorageSpec, manifest: BatchManifest, schema: StructType
) -> DataFrame:
    """The output rows of a committed batch: one task per subtask reads its staged file
    through the job's storage (fsspec, with the job's storage options: Spark's own
    readers know neither ``s3://`` nor those options) and checks it (``staged_output``)."""
    subtasks = len(BatchCommitter.outputs(manifest))
    if not subtasks:
        return spark.createDataFrame([], schema)

    def read(ids: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        storage = spec.open()
        for batch in ids:
            for subtask in batch.column(0).to_pylist():
                data = staged_output(storage, manifest, subtask)
                yield from pq.read_table(pa.BufferReader(data)).to_batches()

    return spark.range(0, subtasks, 1, subtasks).mapInArrow(read, schema)


FILE_FORMATS = frozenset({"parquet", "json", "csv", "orc", "text", "avro"})
"""Sink formats that write files under a path: published exactly once by file names."""
STAGING_DIR = "_statebackend-staging"
"""Where ``publish_files`` lets Spark write a batch inside the sink's path: a name that
starts with '_' is skipped by every reader of the path, as Spark's ``_spark_metadata``."""
_PUBLISHED_NAME = re.compile(r"part-[0-9]+-[0-9]+(\.|$)")
"""The names of published files (``publish_parquet``, ``publish_files``)."""


def _sink_filesystem(
    storage: CheckpointStorage, path: str, options: dict[str, Any]
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec file system and root of a sink ``path``, opened with ``_options_for``
    it."""
    sink, root = fsspec.core.url_to_fs(path, **_options_for(path, storage, options))
    return sink, root.rstrip("/")


def _renames_atomically(sink: fsspec.AbstractFileSystem) -> bool:
    protocols = {sink.protocol} if isinstance(sink.protocol, str) else set(sink.protocol)
    return bool({"file", "local", "hdfs"} & protocols)


def publish_parquet(
    storage: CheckpointStorage, manifest: BatchManifest, path: str, options: dict[str, Any]
) -> None:
    """Copy a committed batch's staged files to ``<path>/part-<N>-<subtask>.parquet``; a
    re-run overwrites them with the same bytes. Where the file system renames atomically
    (local, HDFS) each is written to a hidden temp name first (readers skip names that
    start with '.'), on object stores with one PUT."""
    sink, root = _sink_filesystem(storage, path, options)
    renames = _renames_atomically(sink)
    if renames:
        sink.makedirs(root, exist_ok=True)
    for subtask in range(len(BatchCommitter.outputs(manifest))):
        name = f"part-{manifest.batch_id}-{subtask}.parquet"
        data = staged_output(storage, manifest, subtask)
        if renames:
            temporary = f"{root}/.{name}.{uuid.uuid4().hex}.tmp"
            sink.pipe_file(temporary, data)
            sink.mv(temporary, f"{root}/{name}")
        else:
            sink.pipe_file(f"{root}/{name}", data)


def _is_hidden(relative: str) -> bool:
    """True for a path Spark's readers skip: a part starting with '.' or '_' (its
    ``_SUCCESS``, checksum files)."""
    return any(part.startswith((".", "_")) for part in relative.split("/"))


def publish_files(
    storage: CheckpointStorage,
    batch_id: int,
    output: DataFrame,
    path: str,
    write: Callable[[DataFrame, str], None],
    options: dict[str, Any],
) -> list[str]:
    """Write a committed batch's rows under the file sink ``path`` exactly once, in any
    file format and partitioning: ``write(output, staging)`` saves them into a new
    directory under ``<path>/_statebackend-staging/`` (which readers of ``path`` skip),
    then each file it wrote moves to the same partition directory under ``path`` as
    ``part-<N>-<k>.<its suffix>``, and files named ``part-<N>-...`` that an earlier
    attempt left beside them and this one did not write are deleted. A re-run after a
    crash at any step therefore leaves the batch's rows exactly once. One query writes to
    a sink path (as with Spark's file sink). Returns the files published."""
    sink, root = _sink_filesystem(storage, path, options)
    staging = f"{STAGING_DIR}/{batch_id}-{uuid.uuid4().hex[:12]}"
    write(output, f"{path.rstrip('/')}/{staging}")
    staged_root = f"{root}/{staging}"
    staged = sorted(
        name
        for name in (file[len(staged_root) + 1 :] for file in sink.find(staged_root))
        if not _is_hidden(name)
    )
    published: list[str] = []
    renames = _renames_atomically(sink)
    for index, relative in enumerate(staged):
        directory, _, name = relative.rpartition("/")
        suffix = name.partition(".")[2]
        target_name = f"part-{batch_id}-{index:05d}" + (f".{suffix}" if suffix else "")
        target_dir = f"{root}/{directory}" if directory else root
        if renames:
            sink.makedirs(target_dir, exist_ok=True)
        target = f"{target_dir}/{target_name}"
        sink.mv(f"{staged_root}/{relative}", target)
        published.append(target)
    stale_prefix = f"part-{batch_id}-"
    kept = set(published)
    for directory in {target.rpartition("/")[0] for target in published} or {root}:
        for file in sink.ls(directory, detail=False):
            name = file.rstrip("/").rpartition("/")[2]
            if name.startswith(stale_prefix) and file not in kept:
                sink.rm_file(file)
    # This attempt's directory, and any an attempt that died before this step left.
    sink.rm(f"{root}/{STAGING_DIR}", recursive=True)
    return published


def check_sink_path_is_new(
    storage: CheckpointStorage, path: str, options: dict[str, Any], partition_columns: int = 0
) -> None:
    """ConfigurationError if the file sink ``path`` holds files a query published
    (``part-<N>-<k>...``, as ``publish_parquet`` and ``publish_files`` name them, in
    ``partition_columns`` levels of partition directories): for a query that has not run
    a batch yet, they are another query's (an old job that a ``restore_from`` job
    replaces, say), whose batch ids the new one counts again from 0, so it would replace
    or delete them."""
    sink, root = _sink_filesystem(storage, path, options)
    try:
        files = sink.find(root, maxdepth=partition_columns + 1)
    except FileNotFoundError:
        return
    names = [str(file).rstrip("/").rpartition("/")[2] for file in files]
    published = sorted(name for name in names if _PUBLISHED_NAME.match(name))
    if published:
        raise ConfigurationError(
            f"sink path {path} holds files another query published ({', '.join(published[:3])}"
            f"{', ...' if len(published) > 3 else ''}): this query numbers its batches from 0 "
            f"and would replace or delete them; give it a new path"
        )


def publish_once(storage: CheckpointStorage, batch_id: int, append: Callable[[], None]) -> None:
    """Run ``append`` unless batch ``batch_id`` was published already; mark it after."""
    marker = storage.layout.published_path(batch_id)
    if storage.fs.exists(marker):
        return
    append()
    storage.fs.write_atomic(marker, b"")
