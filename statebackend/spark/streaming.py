"""``transform_with_state``: Spark's transformWithState on our keyed state backend.

    stateful = transform_with_state(df, key_by="user", processor=MyProcessor(),
                                    output_schema=schema, job_id="user-totals")
    query = stateful.writeStream.format("parquet").option("path", out) \\
        .option("checkpointLocation", spark_ckpt).start()

An unmodified ``pyspark.sql.streaming.StatefulProcessor`` (or our ``KeyedFunction``)
runs over a RocksDB per keyed subtask instead of Spark's state store: every micro-batch
goes through ``foreachBatch``, where ``arrow_path.KeyedBatches`` shuffles its rows by key
group to P keyed subtasks over Arrow and runs the processor there. Each row's key group
is part of the streaming query's own plan (``with_key_groups``: SQL expressions for
fixed-width keys), so Spark analyses it once per query and the stage that reads the
source runs no Python worker for it. Arguments are checked up front, one clear
ConfigurationError each; ``init`` runs once on the driver (Spark's PRE_INIT) to parse the
states' DDL schemas. A processor (or KeyedFunction) that is also a ``CheckpointedFunction``
(or ``ListCheckpointed``) keeps operator state per keyed subtask, as StatefulJob's
functions do (``function_state``).

Exactly-once (``streaming_commit``): the query's Spark ``checkpointLocation`` is bound
to the job's state directory; each keyed subtask writes its state changes and output rows
of batch N durably, the driver commits manifest N, then publishes the output read back
from the staged files, idempotently by N. A driver killed at any moment and restarted
with the same ``checkpointLocation`` (at any ``parallelism``: the key groups are
redistributed, which is how to rescale a query) yields the same state and output rows as
a run without failure. State lives in an executor-local RocksDB per (job, subtask) under
``spark.statebackend.local.dir``, reused while its marker says it is at batch N-1, else
rebuilt from the newest manifest in storage (base checkpoint + changelog). A new job
may start from a savepoint of another (``restore_from``, ``streaming_restore``).

Materialization: every ``spark.statebackend.changelog.materialize-every`` batches the
driver triggers a checkpoint (``CheckpointTracker``, as StatefulJob's) that the keyed
subtasks cut at the end of the batch and upload in the background. The batch never waits
for it: while one is pending, the next is postponed, and the driver only polls its acks
before and after each batch; only a run that may end after any batch (``availableNow``,
``once``, ``toDF``) waits for it in its batch, ``query.stop()`` waits for one still
pending (``settle_materialization``), and a restart adopts one that completed after a
run's last batch. Once it completes, ``ChangelogStorage.materialized`` makes
it the base of the next manifests and the records at or below it are deleted; one that
stalls, times out or fails is aborted and the manifests keep their old base. Checkpoint
retention keeps every checkpoint a retained manifest builds on.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, GroupedData, Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessor
from pyspark.sql.types import StructType, _parse_datatype_string

from statebackend.backends.keyed import stored_reader
from statebackend.checkpoint.changelog_restore import stored_keyed_states
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.layout import validate_id
from statebackend.checkpoint.manifest import BatchManifest
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.metrics import (
    BatchMetrics,
    MetricsHistory,
    RestoreMetrics,
    combine_batches,
    read_history,
    record_from_json,
    records_of,
    with_job_seconds,
)
from statebackend.errors import (
    CheckpointError,
    ConfigurationError,
    ProcessorFailedError,
    StateBackendError,
)
from statebackend.keygroups import check_parallelism, compute_default_max_parallelism
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.api import KeyedFunction
from statebackend.spark.arrow_path import (
    OPERATOR_ID,
    KeyedBatches,
    KeyedBatchPlan,
    combined_input,
)
from statebackend.spark.checkpoint_tracker import CheckpointTracker, TrackedCheckpoint
from statebackend.spark.conf import (
    StateBackendConf,
    check_max_parallelism_setting,
    parse_byte_size,
)
from statebackend.spark.job_groups import job_group
from statebackend.spark.local_state import LocalVersion, accepted_attempts
from statebackend.spark.processor_handle import (
    BatchTimes,
    ProcessorHandle,
    SchemaCatalog,
    parse_time_mode,
)
from statebackend.spark.processor_runner import (
    KeyedFunctionProcessor,
    ProcessorSpec,
    user_method,
)
from statebackend.spark.streaming_commit import (
    METRICS_PROPERTY,
    QUERY_PROPERTY,
    RESTORED_FROM,
    BatchCommitter,
    batch_output,
    bound_restore,
    check_bound_restore,
    check_recorded_restore,
    check_same_query,
    record_first_start,
)
from statebackend.spark.streaming_output import (
    OutputTransforms,
    TransformedStream,
    no_writer_error,
)
from statebackend.spark.streaming_progress import DEFAULT_KEPT, BatchProgress
from statebackend.spark.streaming_restore import restore_location, restore_point
from statebackend.spark.streaming_writer import OUTPUT_MODES, StatefulStreamWriter
from statebackend.spark.tasks import StorageSpec, attempt_name
from statebackend.state.descriptors import StateDescriptor

_log = logging.getLogger(__name__)

CASE_SENSITIVE_KEY = "spark.sql.caseSensitive"
WATERMARK_METADATA = "spark.watermarkDelayMs"
NON_REPLAYABLE_SOURCES = frozenset({"socket"})
"""Spark's streaming sources that keep no data to run a batch again (``sourceName``)."""
STREAMING_RELATIONS = frozenset({"StreamingRelation", "StreamingRelationV2"})
"""The analyzed plan's leaves that are streaming sources (they have a ``sourceName``)."""


def _parse_struct(schema: object, what: str) -> StructType:
    """``schema`` (a StructType or a DDL string) as a StructType; ConfigurationError
    naming ``what`` (``output_schema``, ``state 'totals': schema``) and the first line of
    Spark's parse error otherwise."""
    if isinstance(schema, StructType):
        return schema
    if isinstance(schema, str):
        try:
            parsed = _parse_datatype_string(schema)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ConfigurationError(
                f"{what} {schema!r} is not a valid DDL schema: {reason}; write 'name type, ...'"
            ) from exc
        if isinstance(parsed, StructType):
            return parsed
    raise ConfigurationError(
        f"{what} {schema!r} is invalid: give a StructType or a DDL string like 'user string'"
    )


def _key_columns(df: DataFrame, key_by: object) -> tuple[str, ...]:
    """The DataFrame's own names of the ``key_by`` columns, matched as Spark's
    ``groupBy`` matches them (ignoring case unless ``spark.sql.caseSensitive``)."""
    names = [key_by] if isinstance(key_by, str) else key_by
    if not isinstance(names, (list, tuple)) or not names:
        raise ConfigurationError(
            f"key_by {key_by!r} is invalid: give a column name or a list of column names"
        )
    case_sensitive = df.sparkSession.conf.get(CASE_SENSITIVE_KEY, "false") == "true"
    resolved = []
    for name in names:
        matches = [
            column
            for column in df.columns
            if isinstance(name, str)
            and (column == name if case_sensitive else column.lower() == name.lower())
        ]
        if name in matches:
            matches = [name]
        if len(matches) != 1:
            problem = "ambiguous" if matches else "unknown"
            raise ConfigurationError(
                f"{problem} key column {name!r}: the DataFrame has columns {df.columns}"
            )
        resolved.append(matches[0])
    return tuple(resolved)


def _initial_state_frame(
    initial_state: object, key_columns: tuple[str, ...]
) -> tuple[DataFrame, tuple[str, ...]] | None:
    """The initial-state DataFrame and its columns holding the key columns, in key order.
    A groupBy's grouping columns pair with the keys by position, as in Spark, unless they
    are the key columns in another order (Spark would then mix up the key's parts); a
    DataFrame holds the key columns by name."""
    if initial_state is None:
        return None
    frame = initial_state._df if isinstance(initial_state, GroupedData) else initial_state
    if not isinstance(frame, DataFrame):
        raise ConfigurationError(
            f"initial_state {initial_state!r} is invalid: give a DataFrame with the key "
            f"columns {list(key_columns)} (or its groupBy of them)"
        )
    if isinstance(initial_state, GroupedData):
        grouping = tuple(initial_state.count().columns[:-1])  # the grouping columns' names
        if sorted(grouping) != sorted(key_columns):
            if len(grouping) != len(key_columns):
                raise ConfigurationError(
                    f"initial_state is grouped by {list(grouping)} and the input by "
                    f"{list(key_columns)}: group it by one column per key column"
                )
            unknown = [name for name in grouping if name not in frame.columns]
            if unknown:
                raise ConfigurationError(
                    f"initial_state is grouped by {unknown[0]!r}, not a column of its "
                    f"DataFrame {frame.columns}: group it by columns"
                )
            return frame, grouping
    missing = [name for name in key_columns if name not in frame.columns]
    if missing:
        raise ConfigurationError(
            f"initial_state has no key column {missing[0]!r}: it has {frame.columns}"
        )
    return frame, key_columns


def _check_replayable(df: DataFrame) -> None:
    """ConfigurationError if a streaming source of ``df`` cannot replay a batch: after a
    failure Spark runs the last uncommitted batch again from the same offsets."""
    if not df.isStreaming:
        return
    leaves = df._jdf.queryExecution().analyzed().collectLeaves()
    for index in range(leaves.size()):
        leaf = leaves.apply(index)
        relation = str(leaf.getClass().getSimpleName()) in STREAMING_RELATIONS
        name = str(leaf.sourceName()) if relation else ""
        if name.lower() in NON_REPLAYABLE_SOURCES:
            raise ConfigurationError(
                f"streaming source {name!r} cannot replay a batch after a failure, so "
                f"exactly-once is impossible: read a replayable source (files, Kafka, rate, "
                f"a table) instead"
            )


def _watermark_column(df: DataFrame) -> str | None:
    """The column ``df.withWatermark`` was called with, if any."""
    for field in df.schema.fields:
        if WATERMARK_METADATA in (field.metadata or {}):
            return str(field.name)
    return None


MAX_RECORDS_PER_BATCH = "spark.sql.execution.arrow.maxRecordsPerBatch"
MAX_BYTES_PER_BATCH = "spark.sql.execution.arrow.maxBytesPerBatch"
INT_TO_DECIMAL = "spark.sql.execution.pythonUDF.pandas.intToDecimalCoercionEnabled"
SAFE_CONVERSION = "spark.sql.execution.pandas.convertToArrowArraySafely"
INT_EXTENSION = "spark.sql.execution.pythonUDF.pandas.preferIntExtensionDtype"
BY_NAME = "spark.sql.legacy.execution.pandas.groupedMap.assignColumnsByName"


def _max_records_per_batch(spark: Any) -> int:
    """The session's ``maxRecordsPerBatch`` (Spark's default 10,000): the most rows of a key
    in one DataFrame a pandas processor gets, as Spark chunks them (0 or less: no limit)."""
    value = spark.conf.get(MAX_RECORDS_PER_BATCH, "10000")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"{MAX_RECORDS_PER_BATCH} {value!r} is not an int: set it to a number of rows"
        ) from None


def _recent_progress_updates(spark: Any) -> int:
    """Spark's ``spark.sql.streaming.numRecentProgressUpdates``: the progress reports a
    query keeps."""
    value = spark.conf.get("spark.sql.streaming.numRecentProgressUpdates", None)
    try:
        return int(value) if value is not None else DEFAULT_KEPT
    except ValueError:
        return DEFAULT_KEPT


def _event_time_column(df: DataFrame, time_mode: str) -> str | None:
    if time_mode != "EventTime":
        return None
    column = _watermark_column(df)
    if column is not None:
        return column
    raise ConfigurationError(
        "time_mode 'EventTime' needs an event-time column: call df.withWatermark(column, "
        "delay) before transform_with_state"
    )


def _batch_metrics(
    batch_id: int, rows: list[Row], parts: Sequence[object], seconds: float
) -> BatchMetrics:
    """Batch ``batch_id``'s metrics from its subtasks' rows and ``parts`` (their metrics):
    the Spark job's ``seconds`` beyond its slowest subtask count as source and shuffle."""
    subtasks = [
        (part, float(row.restore_seconds or 0.0))
        for part, row in zip(parts, rows, strict=True)
        if isinstance(part, BatchMetrics)
    ]
    return with_job_seconds(combine_batches(batch_id, [p for p, _ in subtasks]), seconds, subtasks)


class StatefulStream(OutputTransforms):
    """A DataFrame transformed with state: write it with ``writeStream`` (streaming
    input) or get one batch's output with ``toDF()`` (batch input); ``select``,
    ``withColumn``, ``transform``... change each batch's output before its sink
    (``streaming_output``)."""

    def __init__(
        self,
        df: DataFrame,
        spec: ProcessorSpec,
        *,
        job_id: str,
        output_mode: str,
        initial_state: DataFrame | None,
        parallelism: int,
        max_parallelism: int,
        conf: StateBackendConf,
        declared_states: Sequence[StateDescriptor] = (),
        restore_from: str | None = None,
    ) -> None:
        self.df = df
        self.spec = spec
        self.job_id = job_id
        self.output_mode = output_mode
        self.initial_state = initial_state
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.conf = conf
        key_fields = {field.name: field for field in df.schema.fields}
        key_schema = StructType([key_fields[name] for name in spec.key_columns])
        self.key_schema_json = str(key_schema.json())
        self.query: dict[str, Any] = {
            "time_mode": spec.time_mode,
            "output_mode": output_mode,
            "key": [[f.name, f.dataType.simpleString()] for f in key_schema.fields],
        }
        """What a restart must keep (``check_same_query``), committed with every batch."""
        self._generation = uuid.uuid4().hex
        self._previous_batch: int | None = None
        self.output_schema = spec.output_schema
        self.storage_spec = StorageSpec(
            conf.require_checkpoint_dir(),
            job_id,
            conf.storage_options,
            conf.transfer_threads,
            conf.compression,
            incremental=conf.incremental,
            rocksdb_memory=conf.rocksdb_memory,
            signing_key=conf.checkpoint_signing_key(),
        )
        self.committer = BatchCommitter(self.storage_spec.open(), OPERATOR_ID)
        storage = self.committer.storage
        storage.check_job_id_case()
        requested = None if restore_from is None else restore_location(storage, restore_from)
        newest = self.committer.newest_batch()
        bound = bound_restore(storage) if newest is None else None
        if bound is not None:  # a start before the first batch committed: as first started
            requested = check_bound_restore(job_id, bound, requested)
            if restore_from is None and requested is not None:
                check_recorded_restore(storage, bound)
        self.query[RESTORED_FROM] = requested
        self.restore_dir: str | None = None
        """The savepoint or checkpoint the job's first batch restores (``restore_from``
        on a job without batches)."""
        self._materialized_batch = -1
        """The batch cut by the newest materialization triggered (or the base's)."""
        self.metrics = MetricsHistory(storage.fs, storage.layout.job_dir, self._generation[:12])
        """The query's metrics history: a record per batch (``metrics.latest`` is the
        newest of each kind, as ``StreamingQuery.lastProgress``)."""
        self.progress = BatchProgress(_recent_progress_updates(df.sparkSession))
        """The recent batches' state counts, for Spark's progress reports."""
        if newest is not None:
            committed = self.committer.changelog.load_manifest(newest)
            if OPERATOR_ID not in committed.operators:
                raise ConfigurationError(
                    f"state job {job_id!r} holds batches of a StatefulJob (operators "
                    f"{', '.join(sorted(committed.operators)) or 'none'}), not of "
                    f"transform_with_state: a query cannot take its state, nor a savepoint "
                    f"of it; give the query another job_id"
                )
            check_same_query(committed, self.query, job_id)
            started = committed.properties.get(QUERY_PROPERTY, {}).get(RESTORED_FROM)
            self.query[RESTORED_FROM] = started
            stored = stored_keyed_states(self.committer.changelog, committed, OPERATOR_ID)
            for descriptor in declared_states:
                if descriptor.name in stored:
                    stored_reader(stored[descriptor.name], descriptor)
            # Key groups are fixed for the job's life: a restart at another parallelism
            # keeps them.
            check_max_parallelism_setting(
                conf.max_parallelism,
                committed.max_parallelism,
                f"state job {job_id!r}",
                ", or start a new job_id with a new checkpointLocation",
            )
            self.max_parallelism = committed.max_parallelism
            check_parallelism(parallelism, self.max_parallelism)
        elif requested is not None:
            if initial_state is not None:
                # As Spark: initial state seeds a query that starts without state.
                raise ConfigurationError(
                    f"job {job_id!r} starts from restore_from {requested}, and initial_state "
                    f"seeds only a job that starts without state: drop initial_state (or "
                    f"write those keys into a savepoint with `statebackend savepoint "
                    f"bootstrap` and start from that)"
                )
            metadata = restore_point(
                storage,
                requested,
                RowTupleSerializer(self.key_schema_json),
                declared_states,
                conf.max_parallelism,
            )
            self.max_parallelism = metadata.max_parallelism
            check_parallelism(parallelism, self.max_parallelism)
            self.committer.changelog.restart(-1, metadata.checkpoint_id, requested)
            self.restore_dir = requested
            # Materialize at the first batch: the job stops depending on the savepoint.
            self._materialized_batch = -conf.materialize_every
        self.binding_id: str | None = None
        """The id of the binding to a Spark checkpointLocation, once a query started."""
        reuse = df.sparkSession.sparkContext.getConf().get("spark.python.worker.reuse", "true")
        self._wait_for_uploads = reuse.lower() != "true"
        """Without Python worker reuse an upload would die with its task's worker."""
        self._tracker: CheckpointTracker | None = None
        self._keyed_batches = KeyedBatches()
        self._cut_attempts: dict[int, tuple[str, ...] | None] = {}
        """Per pending materialization, the subtask attempts its batch's manifest accepted
        (that manifest may be deleted by the time the materialization completes)."""
        self.ends_when_caught_up = False
        """Whether the run may end after any batch (``toDF``, an ``availableNow`` or
        ``once`` trigger): a materialization is then waited for in its own batch, as
        none may follow to poll it, and one left pending would never complete."""

    def check_settings_unchanged(self) -> None:
        """ConfigurationError if a ``spark.statebackend.*`` setting of the session changed
        since ``transform_with_state`` read them (the query would run without it)."""
        changed = self.conf.keys_changed_in(StateBackendConf.from_session(self.df.sparkSession))
        if changed:
            raise ConfigurationError(
                f"{', '.join(changed)} changed after transform_with_state read the settings, "
                f"so the query would run without the change: set spark.statebackend.* "
                f"before calling transform_with_state (or call it again)"
            )

    @property
    def schema(self) -> StructType:
        """The output schema (``output_schema``), as ``DataFrame.schema``."""
        return self.output_schema

    @property
    def isStreaming(self) -> bool:  # noqa: N802 - mirrors DataFrame.isStreaming
        """Whether the input is a streaming DataFrame (then write with ``writeStream``)."""
        return bool(self.df.isStreaming)

    @property
    def writeStream(self) -> StatefulStreamWriter:  # noqa: N802 - mirrors DataFrame.writeStream
        """A writer mirroring DataStreamWriter; each micro-batch runs through our backend."""
        return self.stream_writer(None)

    def stream_writer(self, transformed: TransformedStream | None) -> StatefulStreamWriter:
        """The writer of ``writeStream``, publishing the output through ``transformed``'s
        functions if given."""
        if not self.df.isStreaming:
            raise ConfigurationError(
                "writeStream needs a streaming DataFrame: for a batch DataFrame use toDF()"
            )
        return StatefulStreamWriter(self, transformed)

    def transform(
        self, func: Callable[..., DataFrame], *args: Any, **kwargs: Any
    ) -> TransformedStream:
        """A stream whose every batch's output is ``func(output, *args, **kwargs)`` before
        its sink, as ``DataFrame.transform`` (``streaming_output``)."""
        return TransformedStream(self, ()).transform(func, *args, **kwargs)

    @property
    def write(self) -> NoReturn:
        """Not a writer: UnavailableMethodError saying how to write the output."""
        raise no_writer_error(self.df)

    def toDF(self) -> DataFrame:  # noqa: N802 - mirrors Spark's naming
        """Run the (batch) input as the job's next batch and return its output, read
        from the batch's staged files."""
        if self.df.isStreaming:
            raise ConfigurationError(
                "toDF() runs a batch DataFrame: start a streaming one with writeStream"
            )
        self.check_settings_unchanged()
        storage = self.committer.storage
        if storage.fs.exists(storage.layout.spark_binding_path):
            raise ConfigurationError(
                f"state job {storage.job_id!r} is the state of a streaming query "
                f"({storage.layout.spark_binding_path}): a batch of toDF() would be one that "
                f"query takes for its own and skips; run toDF() with another job_id"
            )
        previous = self._previous_batch
        if previous is None:
            previous = self.committer.newest_batch()
        if previous is None:  # a restart before the first commit goes on from it
            record_first_start(storage, self.query[RESTORED_FROM])
        batch_id = 0 if previous is None else previous + 1
        now = int(time.time() * 1000)
        self.ends_when_caught_up = True
        batch = self.with_key_groups(self.df)
        return self.output(self.run_batch(batch, batch_id, BatchTimes(now)))

    def with_key_groups(self, df: DataFrame) -> DataFrame:
        """``df`` (the stream's input, or a batch of it) with each row's key group and
        keyed subtask: ``run_batch`` takes batches of it."""
        return self._keyed_batches.with_key_groups(
            df, self.spec.key_columns, self.key_schema_json, self.parallelism, self.max_parallelism
        )

    def run_batch(self, batch_df: DataFrame, batch_id: int, times: BatchTimes) -> BatchManifest:
        """Run micro-batch ``batch_id`` (rows of ``with_key_groups``) through the keyed
        subtasks and commit it; its manifest. A batch committed already (Spark re-running
        it after a failure) is not run again: its manifest is returned as it is."""
        committed = self.committer.reconcile(batch_id)
        if committed is not None:
            if _watermark_column(batch_df) is not None:
                # Spark sets the next batch's watermark from the event times this batch's
                # plan sees: it must see them again, or the watermark stands still.
                batch_df.write.format("noop").mode("overwrite").save()
            self._record_if_missing(committed)
            self._previous_batch = batch_id
            return committed
        restore_batch = self.committer.newest_batch()
        accepted = None
        if restore_batch is not None:  # cached after its commit: no read per batch
            restored = self.committer.changelog.load_manifest(restore_batch)
            accepted = accepted_attempts(restored, OPERATOR_ID)
        tracker = self._materializations()
        checkpoint_id = self._materialization_due(tracker, batch_id)
        initial = self.initial_state if batch_id == 0 else None  # as Spark: batch 0 only
        plan = KeyedBatchPlan(
            spec=self.spec,
            key_schema_json=self.key_schema_json,
            parallelism=self.parallelism,
            max_parallelism=self.max_parallelism,
            batch_id=batch_id,
            times=times,
            version=LocalVersion(
                self.binding_id or self._generation,
                restore_batch,
                self.restore_dir if restore_batch is None else None,
                self.parallelism,
                self.max_parallelism,
                accepted=accepted,
            ),
            restore_batch=restore_batch,
            storage=self.storage_spec,
            local_dir=self.conf.local_dir,
            checkpoint_id=checkpoint_id,
            run_id=tracker.coordinator.run_id,
            wait_for_upload=self._wait_for_uploads,
            backend=self.conf.backend,
        )
        sc = self.df.sparkSession.sparkContext
        try:
            started = time.perf_counter()
            with job_group(sc, self.job_id, OPERATOR_ID, "keyed subtasks", batch_id):
                combined = combined_input(batch_df, self.spec, initial, self.with_key_groups)
                rows = self._keyed_batches.run(combined, plan)
            seconds = time.perf_counter() - started
            parts = [record_from_json(json.loads(row.metrics)) for row in rows]
            batch = _batch_metrics(batch_id, rows, parts, seconds)
            started = time.perf_counter()
            manifest = self.committer.commit(
                batch_id, rows, self.parallelism, self.max_parallelism, times, self.query, batch
            )
            batch = dataclasses.replace(batch, manifest_seconds=time.perf_counter() - started)
        except BaseException as exc:
            if checkpoint_id is not None:  # it would cut no committed state
                tracker.abort(f"batch {batch_id} failed: {exc}")
            raise
        self._record_batch(batch, rows, checkpoint_id, restore_batch)
        if checkpoint_id is not None:
            # One materialization is pending at a time: an aborted one's entry goes.
            attempts = accepted_attempts(manifest, OPERATOR_ID)
            self._cut_attempts = {checkpoint_id: attempts}
            tracker.uploads_started(attempts)
            pending = tracker.pending
            if self.ends_when_caught_up or (pending and pending.savepoint_request):
                tracker.wait()  # nothing may poll it later; a savepoint's requester waits
        tracker.poll()
        self._previous_batch = batch_id
        return manifest

    def settle_materialization(self) -> None:
        """After the query stopped: wait for the materialization still uploading, if any
        (nothing else would poll it), until it completes (it becomes the base when the
        query starts again) or is aborted (``checkpoint.timeout``, an upload stalled)."""
        if self._tracker is not None:
            self._tracker.wait()

    def _materializations(self) -> CheckpointTracker:
        """The tracker of the stream's materializations, made at its first batch (its
        coordinator claims the job's leader epoch at its first trigger)."""
        if self._tracker is None:
            storage = self.committer.storage
            changelog = self.committer.changelog
            coordinator = CheckpointCoordinator(
                storage,
                max_parallelism=self.max_parallelism,
                retained=self.conf.retained,
                timeout_seconds=self.conf.timeout_seconds,
                run_id=self._generation[:12],
                pinned=changelog.referenced_checkpoints,
            )
            self._tracker = CheckpointTracker(
                storage,
                coordinator,
                OPERATOR_ID,
                self.conf.upload_stall_seconds,
                self._materialized,
            )
            newest = changelog.latest_manifest()
            if newest is not None:
                self._materialized_batch = self._adopt_materialization(newest)
        return self._tracker

    def _adopt_materialization(self, newest: BatchManifest) -> int:
        """Make the job's newest completed checkpoint the base of the next manifests if an
        earlier run completed it after its last batch (so that no manifest of that run
        could build on it) and it cut batch b <= ``newest``'s with the attempts manifest
        b accepted (one whose ``_metadata`` cannot be read is not: the manifests hold the
        state without it); the batch of the base the next manifests build on."""
        base = -1 if newest.base is None else newest.base.batch_id
        storage, changelog = self.committer.storage, self.committer.changelog
        completed = storage.completed_checkpoint_ids()
        if not completed:
            return base
        try:
            metadata = storage.load(completed[-1])
        except CheckpointError as exc:  # the manifests hold the state without it
            _log.warning(
                "%s is not adopted as the base of the next manifests: %s",
                storage.layout.checkpoint_path(completed[-1]),
                str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc),
            )
            return base
        batch_id = metadata.properties.get("batch_id")
        if (
            not isinstance(batch_id, int)
            or not base < batch_id <= newest.batch_id
            or batch_id not in changelog.manifest_ids()
        ):
            return base
        accepted = accepted_attempts(changelog.load_manifest(batch_id), OPERATOR_ID)
        adopted = self._make_base(completed[-1], batch_id, metadata, accepted)
        return batch_id if adopted else base

    def _materialization_due(self, tracker: CheckpointTracker, batch_id: int) -> int | None:
        """Trigger the materialization that cuts the end of batch ``batch_id`` if it is
        due (``materialize-every`` batches after the last one) and none is pending, or if
        a savepoint was requested (``statebackend savepoint trigger``: the materialization
        is also copied to the savepoint, after the pending one completed); its checkpoint
        id. A pending one is polled first, and waited for only by a savepoint (whose
        batch then waits for it too)."""
        idle = tracker.idle()  # first: a savepoint it completes answers its request
        request = tracker.savepoint_request()
        due = idle and batch_id - self._materialized_batch >= self.conf.materialize_every
        if request is None and not due:
            return None
        self._materialized_batch = batch_id
        properties = {
            "batch_id": batch_id,
            "operator": OPERATOR_ID,
            "key_by": list(self.spec.key_columns),
        }
        return tracker.trigger({OPERATOR_ID: self.parallelism}, batch_id, request, properties)

    def _materialized(self, pending: TrackedCheckpoint, metadata: CheckpointMetadata) -> None:
        """A materialization completed: its metrics; the next manifests build on it
        (``_make_base``)."""
        assert self._tracker is not None
        self.metrics.record(self._tracker.metrics(pending, metadata))
        accepted = self._cut_attempts.pop(pending.checkpoint_id)
        self._make_base(pending.checkpoint_id, pending.batch_id, metadata, accepted)

    def _make_base(
        self,
        checkpoint_id: int,
        batch_id: int,
        metadata: CheckpointMetadata,
        accepted: tuple[str, ...] | None,
    ) -> bool:
        """Make completed materialization N (``metadata``), cut at the end of batch b, the
        base of the next manifests if it cut the subtask attempts ``accepted`` (those
        manifest b accepted: another attempt, e.g. a speculative copy, ran the same batch
        but need not have left the same state); whether it did."""
        cut = tuple(
            attempt_name(ack.run, ack.attempt) for ack in metadata.operators[OPERATOR_ID].subtasks
        )
        if cut != accepted:
            _log.warning(
                "materialization %s cut task attempts %s of batch %s, whose manifest "
                "accepted %s: it does not become the base",
                checkpoint_id,
                cut,
                batch_id,
                accepted,
            )
            return False
        self.committer.changelog.materialized(checkpoint_id, batch_id)
        return True

    def _record_batch(
        self,
        batch: BatchMetrics,
        rows: list[Row],
        checkpoint_id: int | None,
        restore_batch: int | None,
    ) -> None:
        """Record the batch's metrics, and a restore if subtasks rebuilt from storage
        (from manifest ``restore_batch``)."""
        self.metrics.record(batch)
        self.progress.add(batch, self.parallelism)
        if checkpoint_id is not None and self._tracker is not None:
            self._tracker.cut_taken(
                checkpoint_id,
                batch.sync_cut_seconds,
                {(OPERATOR_ID, r.subtask): int(r.entries) for r in rows if r.entries is not None},
            )
        rebuilt = [row for row in rows if row.restored_bytes]
        restored_from = (
            self.restore_dir
            if restore_batch is None
            else self.committer.changelog.layout.manifest_path(restore_batch)
        )
        if rebuilt and restored_from is not None:
            self.metrics.record(
                RestoreMetrics(
                    restored_from,
                    sum(int(row.restored_bytes) for row in rebuilt),
                    max(float(row.restore_seconds) for row in rebuilt),
                    len(rebuilt),
                )
            )

    def _record_if_missing(self, manifest: BatchManifest) -> None:
        """Record the metrics of a committed batch Spark runs again, which the manifest
        holds, if the run that committed it died before recording them."""
        recorded = manifest.properties.get(METRICS_PROPERTY)
        batch = None if recorded is None else record_from_json(recorded)
        if not isinstance(batch, BatchMetrics):
            return
        self.progress.add(batch, manifest.parallelism(OPERATOR_ID))
        storage = self.committer.storage
        history = read_history(storage.fs, storage.layout.job_dir)
        if all(b.batch_id != batch.batch_id for b in records_of(history, BatchMetrics)):
            self.metrics.record(batch)

    def output(self, manifest: BatchManifest) -> DataFrame:
        """The output rows of a committed batch, read from its staged files."""
        return batch_output(self.df.sparkSession, self.storage_spec, manifest, self.output_schema)


def transform_with_state(
    df: DataFrame,
    key_by: str | list[str],
    processor: StatefulProcessor | KeyedFunction,
    output_schema: StructType | str,
    job_id: str,
    output_mode: str = "Update",
    time_mode: str = "None",
    use_pandas: bool = False,
    initial_state: DataFrame | GroupedData | None = None,
    parallelism: int | None = None,
    restore_from: str | None = None,
) -> StatefulStream:
    """Spark's ``groupBy(key_by).transformWithState`` (``use_pandas``:
    ``transformWithStateInPandas``) with state in our backend under
    ``<spark.statebackend.checkpoint.dir>/<job_id>``; see the module docstring.
    ``restore_from`` (a savepoint or completed checkpoint of a ``transform_with_state``
    job) is the state a job without committed batches starts from
    (``streaming_restore``); a job that has committed batches resumes from its own."""
    if not isinstance(df, DataFrame):
        raise ConfigurationError(f"df {df!r} is not a pyspark DataFrame")
    spark = df.sparkSession
    keys = _key_columns(df, key_by)
    _check_replayable(df)
    if not isinstance(use_pandas, bool):  # "false" would be true
        raise ConfigurationError(f"use_pandas {use_pandas!r} is invalid: give True or False")
    if isinstance(processor, KeyedFunction):
        if use_pandas:
            raise ConfigurationError(
                "a KeyedFunction takes Rows: use use_pandas=False or a StatefulProcessor"
            )
        # Its key as StatefulJob gives it: key_by="user" is the user, not ("user",).
        processor = KeyedFunctionProcessor(processor, single_key=isinstance(key_by, str))
    if not isinstance(processor, StatefulProcessor):
        raise ConfigurationError(
            f"processor {processor!r} is a {type(processor).__name__}: give an instance of a "
            f"pyspark.sql.streaming.StatefulProcessor subclass or of a KeyedFunction"
        )
    schema = _parse_struct(output_schema, "output_schema")
    if not isinstance(output_mode, str) or output_mode.lower() not in OUTPUT_MODES:
        raise ConfigurationError(
            f"output_mode {output_mode!r} is invalid: choose one of {list(OUTPUT_MODES.values())}"
        )
    mode = parse_time_mode(time_mode)
    validate_id(job_id, "job_id")  # the name of its directory: before any user code runs
    initial_frame = _initial_state_frame(initial_state, keys)
    initial, initial_keys = initial_frame if initial_frame is not None else (None, ())
    # The session's conf holds the SparkConf's settings and those set at run time.
    conf = StateBackendConf.from_session(spark)
    conf.require_checkpoint_dir()
    if parallelism is None:
        parallelism = conf.parallelism or int(
            spark.conf.get("spark.sql.shuffle.partitions", "200") or 200
        )
    max_parallelism = conf.max_parallelism or compute_default_max_parallelism(parallelism)
    check_parallelism(parallelism, max_parallelism)

    catalog = SchemaCatalog()
    driver_handle = ProcessorHandle(time_mode=mode, catalog=catalog, parse_ddl=_parse_struct)
    # On a shallow copy, so the instance shipped to executors carries no driver-side states.
    probe = copy.copy(processor)
    for method, call in (("init", lambda: probe.init(driver_handle)), ("close", probe.close)):
        try:
            call()
        except (StateBackendError, PySparkException):  # ours and Spark's: they name the fault
            raise
        except Exception as exc:
            raise ProcessorFailedError(
                f"processor {user_method(processor, method)} raised {type(exc).__name__}: "
                f"{exc} on the driver, where transform_with_state declares its states; no "
                f"batch ran: fix the processor"
            ) from exc
    spec = ProcessorSpec(
        processor=processor,
        use_pandas=bool(use_pandas),
        time_mode=mode,
        key_columns=keys,
        input_columns=tuple(df.columns),
        initial_columns=tuple(initial.columns) if initial is not None else (),
        initial_key_columns=initial_keys,
        output_schema_json=str(schema.json()),
        catalog=catalog,
        event_time_column=_event_time_column(df, mode),
        time_zone=str(df.sparkSession.conf.get("spark.sql.session.timeZone")),
        max_records_per_batch=_max_records_per_batch(df.sparkSession),
        max_bytes_per_batch=parse_byte_size(
            MAX_BYTES_PER_BATCH, str(df.sparkSession.conf.get(MAX_BYTES_PER_BATCH))
        ),
        int_to_decimal=str(spark.conf.get(INT_TO_DECIMAL, "false")).lower() == "true",
        safe_conversion=str(spark.conf.get(SAFE_CONVERSION)).lower() == "true",
        int_extension=str(spark.conf.get(INT_EXTENSION, "false")).lower() == "true",
        output_by_name=str(spark.conf.get(BY_NAME, "true")).lower() == "true",
    )
    return StatefulStream(
        df,
        spec,
        job_id=job_id,
        output_mode=OUTPUT_MODES[output_mode.lower()],
        initial_state=initial,
        parallelism=parallelism,
        max_parallelism=max_parallelism,
        conf=conf,
        declared_states=list(driver_handle.declared.values()),
        restore_from=restore_from,
    )
