"""The Arrow data path of one micro-batch, from Spark to our keyed subtasks and back.

``KeyedBatches.run`` runs a batch's input (and, in batch 0, the initial state) through the
processor, one metadata row per keyed subtask:

1. ``KeyedBatches.with_key_groups`` adds each row's key group and keyed subtask, once to
   the stream's DataFrame (so that Spark analyses it once per query): the key group is
   ``assign_to_key_group`` of the key serializer's (``RowTupleSerializer`` of the key
   columns) bytes, exactly as the backend computes it, as Spark SQL expressions for keys
   of fixed-width columns (``sql_key_groups``: no Python worker) and else vectorised
   in ``mapInArrow`` (``arrow_keys``);
2. input and initial-state rows share one schema (initial-state columns prefixed
   ``__sb_init_``) with a kind and an arrival sequence number;
3. one control row per subtask is added, so that a subtask without input still runs
   (its timers fire);
4. ``repartitionById(P, subtask)`` (Spark >= 4.1): partition id == subtask;
5. ``mapInArrow(keyed task)`` (its UDF made once per stream; the batch's own part of the
   plan travels in the ``BATCH_PROPERTY`` local property): the subtask sorts its rows
   by (key group, key, kind, sequence) with Arrow (``sorted_by_key``: it holds its
   batch's input in memory, as it holds its output), opens its local RocksDB (rebuilt
   from the newest batch manifest unless its marker says it is at batch N-1, left by the
   attempt manifest N-1 accepted), runs the processor
   (``processor_runner.run_keyed_subtask``) with the changelog on, writes its changes
   (``changelog/N/<op>-<i>-<attempt>``, the attempt being the run and Spark task
   attempt, ``tasks.record_attempt``, with the operator state of a processor that is
   a ``CheckpointedFunction``: ``function_state`` initializes it when the subtask
   (re)starts and the record holds its ``snapshot_state`` cut) and its output rows
   (``outputs/N/<op>-<i>-<attempt>.parquet``, with its checksum) durably; if the batch
   is a materialization, takes the checkpoint's synchronous cut of the state (and
   operator state) after the batch and leaves its upload and ack to the background
   (``tasks.snapshot_subtask``, as StatefulJob's keyed subtasks do); marks the local
   copy at N and yields one metadata row: ``streaming_commit`` commits and publishes
   them.

No record is pickled on the way: rows cross the JVM/Python boundary as Arrow.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark import TaskContext
from pyspark.sql import Column, DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.functions import pandas_udf
from pyspark.sql.types import (
    ArrayType,
    ByteType,
    DataType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StructField,
    StructType,
)
from pyspark.sql.udf import UserDefinedFunction
from pyspark.util import PythonEvalType

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.metrics import BatchMetrics, record_to_json, state_counts
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.checksums import checksum
from statebackend.errors import ProcessorFailedError, StateBackendError
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.arrow_keys import key_groups, serialized_keys
from statebackend.spark.function_state import (
    keep_function,
    restore_function_state,
    start_function,
)
from statebackend.spark.local_state import LocalKeyedState, LocalVersion, local_keyed_state
from statebackend.spark.processor_handle import BatchClock, BatchTimes
from statebackend.spark.processor_runner import (
    CONTROL,
    INITIAL,
    INITIAL_PREFIX,
    INPUT,
    KEY_GROUP_COLUMN,
    KIND_COLUMN,
    SEQUENCE_COLUMN,
    SUBTASK_COLUMN,
    ProcessorSpec,
    SubtaskCounts,
    checkpointed_part,
    output_arrow_schema,
    run_keyed_subtask,
    user_method,
)
from statebackend.spark.sql_key_groups import key_group_projections, quoted, sql_encodable
from statebackend.spark.streaming_commit import METADATA_SCHEMA
from statebackend.spark.tasks import StorageSpec, record_attempt, snapshot_subtask

OPERATOR_ID = "transform-with-state"


@dataclass(frozen=True)
class KeyedBatchPlan:
    """What the keyed subtasks of one batch need, shipped to the executors."""

    spec: ProcessorSpec
    key_schema_json: str
    parallelism: int
    max_parallelism: int
    batch_id: int
    times: BatchTimes
    version: LocalVersion
    """The binding (generation), parallelism and max parallelism of the local copies, and
    the subtask attempts manifest ``restore_batch`` accepted (``accepted``)."""
    restore_batch: int | None
    """The newest committed batch (N-1), or None for a job without manifests."""
    storage: StorageSpec
    local_dir: str
    checkpoint_id: int | None = None
    """The materialization to cut at the end of the batch, if the batch is one."""
    run_id: str = ""
    """The coordinator run that triggered ``checkpoint_id``: named in its files and acks."""
    wait_for_upload: bool = False
    """Upload the materialization before the task returns (no Python worker reuse)."""
    backend: str = "rocksdb"
    """The keyed state backend (``spark.statebackend.backend``: ``LOCAL_STATES``)."""


BATCH_PROPERTY = "statebackend.keyed.batch"
"""The Spark local property that carries a batch's own part of its ``KeyedBatchPlan``
(``batch_fields``) to the keyed subtasks: the keyed task's UDF holds the rest, the same
for every batch of a stream, and is pickled once per stream, not once per batch."""


def batch_fields(plan: KeyedBatchPlan) -> str:
    """The part of ``plan`` that is the batch's own (its id, times, local version with
    the attempts manifest ``restore_batch`` accepted, restore batch, materialization),
    as JSON."""
    return json.dumps(
        {
            "batch_id": plan.batch_id,
            "times": asdict(plan.times),
            "version": plan.version.to_json(),
            "restore_batch": plan.restore_batch,
            "checkpoint_id": plan.checkpoint_id,
            "run_id": plan.run_id,
        }
    )


def with_batch_fields(plan: KeyedBatchPlan, fields: str) -> KeyedBatchPlan:
    """``plan`` with the batch's own part read from ``batch_fields``' JSON."""
    decoded = json.loads(fields)
    return replace(
        plan,
        batch_id=decoded["batch_id"],
        times=BatchTimes(**decoded["times"]),
        version=LocalVersion.from_json(decoded["version"]),
        restore_batch=decoded["restore_batch"],
        checkpoint_id=decoded["checkpoint_id"],
        run_id=decoded["run_id"],
    )


def stream_part(plan: KeyedBatchPlan) -> KeyedBatchPlan:
    """``plan`` without the batch's own part (placeholders): the same for every batch
    of a stream."""
    return replace(
        plan,
        batch_id=-1,
        times=BatchTimes(0),
        version=LocalVersion("", None, None, plan.parallelism, plan.max_parallelism),
        restore_batch=None,
        checkpoint_id=None,
        run_id="",
    )


def _map_arrow_udf(
    function: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]],
    schema: StructType,
) -> UserDefinedFunction:
    """The UDF ``DataFrame.mapInArrow(function, schema)`` makes: made once and applied
    with ``_map_in_arrow``, its closure is pickled once, where mapInArrow pickles it at
    every call."""
    return pandas_udf(  # type: ignore[call-overload]
        function, returnType=schema, functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF
    )


def _has_floats(data_type: DataType) -> bool:
    """Whether a value of ``data_type`` holds floats (in it, in its fields or elements)."""
    if isinstance(data_type, (FloatType, DoubleType)):
        return True
    if isinstance(data_type, StructType):
        return any(_has_floats(field.dataType) for field in data_type.fields)
    if isinstance(data_type, ArrayType):
        return _has_floats(data_type.elementType)
    return False


def _normalized_floats(column: Column, data_type: DataType) -> Column:
    """``column`` (of a type ``_has_floats``) with -0.0 made 0.0 and every NaN one NaN,
    in struct fields and array elements too."""
    if isinstance(data_type, StructType):
        fields = [
            (
                _normalized_floats(column.getField(field.name), field.dataType)
                if _has_floats(field.dataType)
                else column.getField(field.name)
            ).alias(field.name)
            for field in data_type.fields
        ]
        return F.when(column.isNull(), F.lit(None).cast(data_type)).otherwise(F.struct(*fields))
    if isinstance(data_type, ArrayType):
        element = data_type.elementType
        return F.transform(column, lambda item: _normalized_floats(item, element))
    return (
        F.when(column == 0, F.lit(0.0).cast(data_type))
        .when(F.isnan(column), F.lit(float("nan")).cast(data_type))
        .otherwise(column)
    )


def _normalized_float_keys(df: DataFrame, key_columns: tuple[str, ...]) -> DataFrame:
    """``df`` with -0.0 made 0.0 and every NaN one NaN in its float and double key
    columns, and in the fields of struct key columns: Spark's grouping normalizes
    floating-point keys so, and their bytes would otherwise make -0.0, and each NaN bit
    pattern, a key of its own."""
    types = {field.name: field.dataType for field in df.schema.fields}
    floats = [name for name in key_columns if _has_floats(types[name])]
    if not floats:
        return df
    return df.withColumns(
        {name: _normalized_floats(F.col(quoted(name)), types[name]) for name in floats}
    )


def _map_in_arrow(df: DataFrame, udf: UserDefinedFunction) -> DataFrame:
    """``df.mapInArrow`` of the function of ``udf`` (``_map_arrow_udf``)."""
    column = udf(*[df[quoted(name)] for name in df.columns])
    return DataFrame(df._jdf.mapInArrow(column._jc, False, None), df.sparkSession)


def _key_groups(
    key_columns: tuple[str, ...], key_schema_json: str, parallelism: int, max_parallelism: int
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A mapInArrow function appending each row's key group and keyed subtask."""

    def assign(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            groups = key_groups(batch, key_columns, key_schema_json, max_parallelism)
            # compute_operator_index_for_key_group, vectorised
            subtasks = groups * parallelism // max_parallelism
            yield pa.RecordBatch.from_arrays(
                [*batch.columns, pa.array(groups, pa.int32()), pa.array(subtasks, pa.int32())],
                names=[*batch.schema.names, KEY_GROUP_COLUMN, SUBTASK_COLUMN],
            )

    return assign


SORTED_BATCH_ROWS = 10_000
"""Rows per record batch handed to the processor after the subtask sorted its input."""
KEY_BYTES_COLUMN = "__sb_key_bytes"
"""The serialized key, as a sort column for keys Arrow cannot sort by their columns."""


def _arrow_sortable(data_type: pa.DataType) -> bool:
    """Whether Arrow's ``sort_indices`` orders a column of this type (lists and maps it
    does not)."""
    if pa.types.is_struct(data_type):
        return all(_arrow_sortable(data_type.field(i).type) for i in range(data_type.num_fields))
    return not (
        pa.types.is_list(data_type)
        or pa.types.is_large_list(data_type)
        or pa.types.is_fixed_size_list(data_type)
        or pa.types.is_map(data_type)
    )


def sorted_by_key(
    batches: list[pa.RecordBatch], key_columns: tuple[str, ...], key_schema_json: str
) -> list[pa.RecordBatch]:
    """The subtask's rows ordered by (key group, key, kind, sequence): each key's rows
    together, its initial state before its input, each in arrival order (a total order,
    so a retried task sees the same). Sorted here, in memory by Arrow, and not by
    Spark before the rows reach Python: Spark's sort must take in the whole partition
    before it gives the first row and costs several times more. Keys Arrow cannot
    order by their columns (arrays, maps) are ordered by their serialized bytes: equal
    exactly when the backend's keys are."""
    table = pa.Table.from_batches(batches).combine_chunks()
    if all(_arrow_sortable(table.schema.field(name).type) for name in key_columns):
        key_names = list(key_columns)
    else:
        keys = pa.chunked_array(
            [serialized_keys(batch, key_columns, key_schema_json) for batch in batches],
            pa.binary(),
        )
        table = table.append_column(KEY_BYTES_COLUMN, keys)
        key_names = [KEY_BYTES_COLUMN]
    order = [KEY_GROUP_COLUMN, *key_names, KIND_COLUMN, SEQUENCE_COLUMN]
    indices = pc.sort_indices(table.select(order), [(name, "ascending") for name in order])
    ordered = table.take(indices)
    if KEY_BYTES_COLUMN in ordered.column_names:
        ordered = ordered.drop_columns([KEY_BYTES_COLUMN])
    return ordered.to_batches(max_chunksize=SORTED_BATCH_ROWS)


def _local_root(plan: KeyedBatchPlan) -> Path:
    """The directory of the job's local copies (and the key of its live functions)."""
    return Path(plan.local_dir) / plan.storage.job_id / OPERATOR_ID


def _local_version(plan: KeyedBatchPlan) -> LocalVersion:
    """What the subtasks' local state must be at: the end of batch ``plan.restore_batch``,
    held by its manifest (none yet: the version's ``restore_dir``, if any)."""
    return replace(
        plan.version,
        previous_batch=plan.restore_batch,
        restore_manifest=plan.restore_batch,
    )


@contextmanager
def _current_state(
    plan: KeyedBatchPlan, subtask: int, storage: CheckpointStorage
) -> Iterator[LocalKeyedState]:
    """The subtask's local state at the end of batch ``plan.restore_batch``: the local
    copy if its marker says so (same binding, key groups and batch, left by the attempt
    manifest ``restore_batch`` accepted), else rebuilt from
    manifest ``restore_batch`` (base checkpoint + changelog, any old parallelism), or
    empty for a job without manifests."""
    key_serializer = RowTupleSerializer(plan.key_schema_json)
    version = _local_version(plan)
    root = _local_root(plan)
    with local_keyed_state(
        root, subtask, version, storage, OPERATOR_ID, key_serializer, plan.backend
    ) as local:
        yield local


def _parquet_bytes(batches: list[pa.RecordBatch], schema: pa.Schema) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_batches(batches, schema=schema), sink)
    return bytes(sink.getvalue().to_pybytes())


def _metadata_batch(
    subtask: int,
    handle: str,
    output: str,
    output_checksum: str,
    metrics: BatchMetrics,
    restored_bytes: int,
    restore_seconds: float,
    entries: int | None,
) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [
            pa.array([subtask], pa.int32()),
            pa.array([handle], pa.string()),
            pa.array([output], pa.string()),
            pa.array([metrics.records_out], pa.int64()),
            pa.array([json.dumps(record_to_json(metrics))], pa.string()),
            pa.array([output_checksum], pa.string()),
            pa.array([restored_bytes], pa.int64()),
            pa.array([restore_seconds], pa.float64()),
            pa.array([entries], pa.int64()),
        ],
        names=METADATA_SCHEMA.names,
    )


def _processor_failed(
    plan: KeyedBatchPlan, subtask: int, method: str, exc: Exception
) -> ProcessorFailedError:
    """The error of ``method`` of the processor raising ``exc`` in a keyed subtask."""
    return ProcessorFailedError(
        f"processor {user_method(plan.spec.processor, method)} raised "
        f"{type(exc).__name__}: {exc} in batch {plan.batch_id} "
        f"(keyed subtask {subtask}); the batch is not committed: fix the processor and "
        f"restart the query with the same checkpointLocation to run it again"
    )


def _keyed_task(
    stream: KeyedBatchPlan,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The mapInArrow function of the keyed subtasks of a stream (``stream_part`` of its
    plans): run the batch (its own part read from ``BATCH_PROPERTY``), write its changes
    and output rows durably, yield one metadata row (``METADATA_SCHEMA``)."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        context = TaskContext.get()
        fields = None if context is None else context.getLocalProperty(BATCH_PROPERTY)
        if fields is None:
            raise StateBackendError(
                f"a keyed subtask found no {BATCH_PROPERTY} property: run the keyed "
                f"subtasks through KeyedBatches.run"
            )
        plan = with_batch_fields(stream, fields)
        received = [batch for batch in batches if batch.num_rows]
        if not received:
            raise StateBackendError(
                "a keyed subtask got no control row: the shuffle lost rows; retry the batch"
            )
        subtask = int(received[0].column(SUBTASK_COLUMN)[0].as_py())
        if context is not None and context.partitionId() != subtask:
            raise StateBackendError(
                f"partition {context.partitionId()} got the rows of subtask {subtask}: "
                f"repartitionById must map subtask i to partition i (Spark >= 4.1)"
            )
        attempt = record_attempt(plan.run_id)
        storage = plan.storage.open()
        records_in = sum(batch.num_rows for batch in received) - 1  # not the control row
        ordered = sorted_by_key(received, plan.spec.key_columns, plan.key_schema_json)

        counts = SubtaskCounts(method="initialize_state")  # start_function restores it
        opening = time.perf_counter()
        with _current_state(plan, subtask, storage) as local:
            # Rebuilding from storage (not reusing the local copy) is a restore.
            restored_bytes = local.restored_bytes if local.rebuilt else 0
            restore_seconds = time.perf_counter() - opening if local.rebuilt else 0.0
            backend = local.backend
            assert backend is not None
            backend.clock = BatchClock(plan.times.batch_timestamp_ms)
            backend.enable_changelog()
            timers = backend.timer_service if plan.spec.time_mode != "None" else None
            version = _local_version(plan)
            started = time.perf_counter()
            try:
                function_run = start_function(
                    plan.spec.processor,
                    _local_root(plan),
                    subtask,
                    version,
                    local.reused,
                    lambda: restore_function_state(storage, version, OPERATOR_ID, subtask),
                    checkpointed_part,
                )
                output = list(
                    run_keyed_subtask(
                        replace(plan.spec, processor=function_run.function),
                        backend,
                        plan.times,
                        ordered,
                        timers,
                        counts,
                    )
                )
                counts.method = "snapshot_state"
                operator_state = function_run.snapshot(plan.batch_id)
            except StateBackendError:
                raise
            except Exception as exc:
                raise _processor_failed(plan, subtask, counts.method, exc) from exc
            keyed_seconds = time.perf_counter() - started
            changes = backend.drain_changelog()
            handle = ChangelogStorage(storage).write_record(
                plan.batch_id, OPERATOR_ID, subtask, attempt, changes, operator_state
            )
            changelog_seconds = time.perf_counter() - started - keyed_seconds
            state = state_counts(
                changes,
                backend,
                timers_registered=counts.timers_registered,
                timers_deleted=counts.timers_deleted,
                timers_fired=counts.timers_fired,
                late_rows=counts.late_rows,
                timer_seconds=counts.timer_seconds,
            )
            path = storage.layout.output_path(plan.batch_id, OPERATOR_ID, subtask, attempt)
            staged = _parquet_bytes(output, output_arrow_schema(plan.spec.output_schema))
            storage.fs.write_atomic(path, staged)
            sync_seconds, entries = 0.0, None
            if plan.checkpoint_id is not None:  # a materialization: cut the state after N
                sync_seconds = snapshot_subtask(
                    storage,
                    backend,
                    plan.checkpoint_id,
                    OPERATOR_ID,
                    subtask,
                    plan.parallelism,
                    plan.run_id,
                    plan.wait_for_upload,
                    operator_state,
                )
                entries = backend.estimated_entries()
            # A worker that outlives the task closes the DB after it (the batch is durable).
            local.commit(plan.batch_id, attempt, in_background=not plan.wait_for_upload)
            keep_function(function_run, _local_root(plan), subtask, version, plan.batch_id, attempt)
        metrics = BatchMetrics(
            batch_id=plan.batch_id,
            records_in=records_in,
            records_out=sum(batch.num_rows for batch in output),
            keys_touched=counts.keys,
            keyed_seconds=keyed_seconds,
            sync_cut_seconds=sync_seconds,
            changelog_bytes=handle.size,
            changelog_seconds=changelog_seconds,
            **state,
        )
        yield _metadata_batch(
            subtask,
            json.dumps(handle.to_json()),
            path,
            checksum(staged, storage.fs.checksum_algorithm),
            metrics,
            restored_bytes,
            restore_seconds,
            entries,
        )

    return run


def _typed_nulls(schema: StructType, names: list[str], prefix: str = "") -> list[Any]:
    fields = {field.name: field for field in schema.fields}
    return [F.lit(None).cast(fields[name].dataType).alias(prefix + name) for name in names]


def combined_input(
    batch_df: DataFrame,
    spec: ProcessorSpec,
    initial_state: DataFrame | None,
    with_key_groups: Callable[[DataFrame], DataFrame],
) -> DataFrame:
    """Input rows (and initial-state rows) in one schema with kind and sequence columns
    and their key group and subtask (``batch_df`` has them already, from the stream's
    plan; ``with_key_groups`` adds them to the initial-state rows); the initial-state
    columns exist only in a batch that has initial state (batch 0)."""
    routing = [quoted(KEY_GROUP_COLUMN), quoted(SUBTASK_COLUMN)]
    if initial_state is None:
        # SQL expressions: one JVM call, where Column objects take several per column.
        return batch_df.selectExpr(
            *[quoted(name) for name in spec.input_columns],
            f"CAST({INPUT} AS TINYINT) AS {quoted(KIND_COLUMN)}",
            f"monotonically_increasing_id() AS {quoted(SEQUENCE_COLUMN)}",
            *routing,
        )
    input_schema = batch_df.schema
    inputs = batch_df.select(
        *[F.col(quoted(name)) for name in spec.input_columns],
        *_typed_nulls(initial_state.schema, list(spec.initial_columns), INITIAL_PREFIX),
        F.lit(INPUT).cast(ByteType()).alias(KIND_COLUMN),
        F.monotonically_increasing_id().alias(SEQUENCE_COLUMN),
        *[F.col(name) for name in routing],
    )
    key_types = {field.name: field.dataType for field in input_schema.fields}
    others = [name for name in spec.input_columns if name not in spec.key_columns]
    sources = spec.initial_key_columns or spec.key_columns
    initial = initial_state.select(
        *[
            F.col(quoted(column)).cast(key_types[name]).alias(name)
            for name, column in zip(spec.key_columns, sources, strict=True)
        ],
        *_typed_nulls(input_schema, others),
        *[F.col(quoted(name)).alias(INITIAL_PREFIX + name) for name in spec.initial_columns],
        F.lit(INITIAL).cast(ByteType()).alias(KIND_COLUMN),
        F.monotonically_increasing_id().alias(SEQUENCE_COLUMN),
    )
    return inputs.unionByName(with_key_groups(initial))


class KeyedBatches:
    """Runs the keyed plan of each batch of one query (``run``), keeping what is the same
    from batch to batch: the control rows (per input schema and Spark session), the
    UDFs (pickled once) and the key-group expressions (parsed once)."""

    def __init__(self) -> None:
        self._control: dict[tuple[str, int], DataFrame] = {}
        self._key_group_udfs: dict[tuple[str, str, int, int], UserDefinedFunction] = {}
        self._keyed: tuple[KeyedBatchPlan, UserDefinedFunction] | None = None
        self._key_group_columns: dict[tuple[str, int, int], list[list[Column]]] = {}

    def control_rows(
        self, session: SparkSession, schema: StructType, parallelism: int
    ) -> DataFrame:
        """One control row per keyed subtask, in one partition (one task), in the columns
        of ``schema`` (the combined input's, with key group and subtask). Built once per
        JVM session: ``foreachBatch`` hands every batch a new Python session object
        around the stream's same JVM session, and building them costs ~100 py4j calls."""
        cache_key = (schema.json(), parallelism)
        control = self._control.get(cache_key)
        if control is None or not control.sparkSession._jsparkSession.equals(
            session._jsparkSession
        ):
            control = session.range(0, parallelism, 1, 1).select(
                *[
                    F.lit(None).cast(field.dataType).alias(field.name)
                    for field in schema.fields
                    if field.name
                    not in (KIND_COLUMN, SEQUENCE_COLUMN, KEY_GROUP_COLUMN, SUBTASK_COLUMN)
                ],
                F.lit(CONTROL).cast(ByteType()).alias(KIND_COLUMN),
                F.lit(0).cast(LongType()).alias(SEQUENCE_COLUMN),
                F.lit(-1).cast(IntegerType()).alias(KEY_GROUP_COLUMN),
                F.col("id").cast(IntegerType()).alias(SUBTASK_COLUMN),
            )
            self._control[cache_key] = control
        return control

    def with_key_groups(
        self,
        combined: DataFrame,
        key_columns: tuple[str, ...],
        key_schema_json: str,
        parallelism: int,
        max_parallelism: int,
    ) -> DataFrame:
        """``combined`` (a streaming or a batch DataFrame) with each row's key group and
        keyed subtask (``KEY_GROUP_COLUMN``, ``SUBTASK_COLUMN``): SQL expressions
        (``sql_key_groups``) where the key's types allow, so the stage runs no Python
        worker; else the vectorised Python of ``arrow_keys`` in ``mapInArrow``. Applied
        once to a stream's DataFrame, Spark analyses the expressions once per query, not
        once per batch. Float and double key columns have -0.0 made 0.0 first, as Spark
        groups them (one key, one key group)."""
        combined = _normalized_float_keys(combined, key_columns)
        if sql_encodable(key_schema_json):
            cache_key = (key_schema_json, parallelism, max_parallelism)
            levels = self._key_group_columns.get(cache_key)
            if levels is None:
                levels = self._key_group_columns[cache_key] = [
                    [F.expr(expression) for expression in level]
                    for level in key_group_projections(*cache_key, KEY_GROUP_COLUMN, SUBTASK_COLUMN)
                ]
            routed = combined
            for level in levels[:-1]:
                routed = routed.select("*", *level)
            names = combined.schema.names
            return routed.select(*[F.col(quoted(name)) for name in names], *levels[-1])
        schema = combined.schema
        udf_key = (schema.json(), key_schema_json, parallelism, max_parallelism)
        assign = self._key_group_udfs.get(udf_key)
        if assign is None:
            with_groups_schema = StructType(
                [
                    *schema.fields,
                    StructField(KEY_GROUP_COLUMN, IntegerType(), False),
                    StructField(SUBTASK_COLUMN, IntegerType(), False),
                ]
            )
            function = _key_groups(key_columns, key_schema_json, parallelism, max_parallelism)
            assign = self._key_group_udfs[udf_key] = _map_arrow_udf(function, with_groups_schema)
        return _map_in_arrow(combined, assign)

    def run(self, combined: DataFrame, plan: KeyedBatchPlan) -> list[Row]:
        """Run the batch (``combined_input``'s rows): one metadata row per keyed subtask
        (``METADATA_SCHEMA``), once the batch has run (see the module docstring)."""
        control = self.control_rows(combined.sparkSession, combined.schema, plan.parallelism)
        shuffled = combined.unionByName(control).repartitionById(plan.parallelism, SUBTASK_COLUMN)
        stream = stream_part(plan)
        if self._keyed is None or self._keyed[0] != stream:
            self._keyed = (stream, _map_arrow_udf(_keyed_task(stream), METADATA_SCHEMA))
        keyed = _map_in_arrow(shuffled, self._keyed[1])
        sc = combined.sparkSession.sparkContext
        sc.setLocalProperty(BATCH_PROPERTY, batch_fields(plan))
        try:
            return keyed.collect()
        finally:
            sc.setLocalProperty(BATCH_PROPERTY, None)  # type: ignore[arg-type] # None unsets
