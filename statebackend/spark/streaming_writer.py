"""``StatefulStreamWriter``: ``transform_with_state(...).writeStream``, which mirrors Spark's
``DataStreamWriter`` and starts a ``foreachBatch`` query that runs each micro-batch on the
keyed subtasks and publishes its committed output to the sink exactly once."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from pyspark.sql import DataFrame
from pyspark.sql.streaming import DataStreamWriter, StreamingQuery
from pyspark.sql.streaming.listener import StreamingQueryProgress

from statebackend.checkpoint.manifest import BatchManifest
from statebackend.errors import ConfigurationError
from statebackend.spark.batch_times import BatchTimesReader
from statebackend.spark.conf import TICK_INTERVAL_KEY
from statebackend.spark.job_groups import current_job_group
from statebackend.spark.query_stop import stop_interruption
from statebackend.spark.streaming_commit import (
    FILE_FORMATS,
    RESTORED_FROM,
    bind,
    check_sink_path_is_new,
    is_bound,
    location_filesystem,
    publish_files,
    publish_once,
    publish_parquet,
)
from statebackend.spark.streaming_tables import check_table, publish_to_table
from statebackend.spark.streaming_ticks import with_ticks, without_ticks

if TYPE_CHECKING:
    from statebackend.spark.streaming import StatefulStream
    from statebackend.spark.streaming_output import TransformedStream

OUTPUT_MODES = {"update": "Update", "append": "Append"}
DEFAULT_SOURCE_KEY = "spark.sql.sources.default"
"""Spark's format for a sink given a path and no format."""


def _column_names(cols: tuple[Any, ...], method: str, none_ok: bool = False) -> list[str]:
    """Column names given as Spark's writer takes them: names, or one list of names (none
    only if ``none_ok``)."""
    names = list(cols[0]) if len(cols) == 1 and isinstance(cols[0], (list, tuple)) else list(cols)
    if (not names and not none_ok) or not all(isinstance(name, str) and name for name in names):
        raise ConfigurationError(f"{method} {cols!r} is invalid: give column names")
    return names


class StatefulStreamingQuery(StreamingQuery):
    """Spark's ``StreamingQuery`` of a ``transform_with_state`` query, whose ``stop()``
    then waits for a materialization still uploading (``settle_materialization``): left
    pending, it would never complete, and a restart would replay from the older base.
    Its ``lastProgress`` and ``recentProgress`` have the batches' state operator
    (``streaming_progress``)."""

    def __init__(self, query: StreamingQuery, stream: StatefulStream) -> None:
        super().__init__(query._jsq)
        self._stream = stream

    @property
    def lastProgress(self) -> StreamingQueryProgress | None:  # noqa: N802 - Spark's name
        """Spark's newest progress report, with the batch's ``stateOperators``."""
        progress = super().lastProgress
        return None if progress is None else self._stream.progress.with_state(progress)

    @property
    def recentProgress(self) -> list[StreamingQueryProgress]:  # noqa: N802 - Spark's name
        """Spark's recent progress reports, each with its batch's ``stateOperators``."""
        return [self._stream.progress.with_state(p) for p in super().recentProgress]

    def stop(self) -> None:
        """Stop the query, then settle its pending materialization if it was running (a
        stop of a query that ended already must not poll the stream's tracker: a query
        started again on the same stream may be using it)."""
        running = self.isActive
        super().stop()
        if running:
            self._stream.settle_materialization()


class StatefulStreamWriter:
    """Mirrors ``DataStreamWriter`` (format, option, options, outputMode, partitionBy,
    clusterBy, trigger, queryName, foreach, foreachBatch, start, toTable); the query
    itself is a ``foreachBatch`` query that publishes each committed batch to the sink
    (``streaming_commit``), through ``transformed``'s functions if given."""

    def __init__(self, stream: StatefulStream, transformed: TransformedStream | None) -> None:
        self._stream = stream
        self._transformed = transformed
        self._format: str | None = None
        self._options: dict[str, str] = {}
        self._trigger: dict[str, Any] = {}
        self._query_name: str | None = None
        self._foreach_batch: Callable[[DataFrame, int], None] | None = None
        self._foreach: Callable[[Any, Any], Any] | None = None
        self._partition_by: list[str] = []
        self._cluster_by: list[str] = []

    def format(self, source: str) -> StatefulStreamWriter:
        """The sink's format (any batch-writable format, or "console")."""
        self._format = source
        return self

    def option(self, key: str, value: Any) -> StatefulStreamWriter:
        """A sink option; ``checkpointLocation`` is the query's checkpoint directory."""
        self._options[key] = str(value)
        return self

    def options(self, **options: Any) -> StatefulStreamWriter:
        """Several sink options."""
        for key, value in options.items():
            self.option(key, value)
        return self

    def outputMode(self, outputMode: str) -> StatefulStreamWriter:  # noqa: N802,N803
        """Accepted as Spark's writer takes it, but the output mode is
        ``transform_with_state``'s ``output_mode``: another one is a ConfigurationError."""
        given = OUTPUT_MODES.get(str(outputMode).lower())
        if given != self._stream.output_mode:
            raise ConfigurationError(
                f"outputMode {outputMode!r} differs from transform_with_state's output_mode "
                f"{self._stream.output_mode!r}: give the mode to transform_with_state"
            )
        return self

    def partitionBy(self, *cols: str | list[str]) -> StatefulStreamWriter:  # noqa: N802
        """Partition a file or table sink's output by ``cols``, as Spark's writer does (no
        columns: not partitioned, also after an earlier ``partitionBy``)."""
        self._partition_by = _column_names(cols, "partitionBy", none_ok=True)
        return self

    def clusterBy(self, *cols: str | list[str]) -> StatefulStreamWriter:  # noqa: N802
        """Cluster a table sink's output by ``cols`` (``toTable`` only), as Spark's writer."""
        self._cluster_by = _column_names(cols, "clusterBy")
        return self

    def trigger(self, **given: Any) -> StatefulStreamWriter:
        """The query's trigger, as ``DataStreamWriter.trigger`` takes it: exactly one
        kind, a keyword given as None counting as not given."""
        trigger = {kind: value for kind, value in given.items() if value is not None}
        if len(trigger) != 1:
            raise ConfigurationError(
                f"trigger({', '.join(f'{k}={v!r}' for k, v in given.items())}) is invalid: "
                f"give exactly one of processingTime, once or availableNow"
            )
        if "continuous" in trigger or "realTime" in trigger:
            raise ConfigurationError(
                f"trigger {trigger} is not supported: use processingTime, once or availableNow"
            )
        self._trigger = trigger
        return self

    def queryName(self, queryName: str) -> StatefulStreamWriter:  # noqa: N802,N803
        """The query's name."""
        self._query_name = queryName
        return self

    def foreachBatch(  # noqa: N802
        self, func: Callable[[DataFrame, int], None]
    ) -> StatefulStreamWriter:
        """Give each batch's output to ``func(df, batch_id)`` instead of a sink format."""
        self._foreach_batch = func
        return self

    def foreach(self, f: Any) -> StatefulStreamWriter:
        """Give each output row to ``f``: a function of the row, or an object with
        ``process(row)`` and optional ``open(partition_id, epoch_id)`` and ``close(error)``,
        called as Spark's ``foreach`` sink calls them (epoch_id: the batch id; a re-run
        batch has the same rows in the same partitions, so the pair can deduplicate)."""
        self._foreach = DataStreamWriter._construct_foreach_function(f)
        return self

    def _publish(self, manifest: BatchManifest, table: str | None) -> None:
        """Publish committed batch N to the sink, idempotently by N (module docstring of
        ``streaming_commit``)."""
        stream = self._stream
        batch_id = manifest.batch_id
        output = stream.output(manifest)
        if self._transformed is not None:
            output = self._transformed.apply(output)
        if self._foreach_batch is not None:
            self._foreach_batch(output, batch_id)
            return
        if self._foreach is not None:
            output.rdd.mapPartitionsWithIndex(self._foreach).count()
            return
        if self._format_name() == "console":
            # As Spark's console sink prints a batch, with its numRows and truncate options.
            rule = "-" * 43
            print(f"{rule}\nBatch: {batch_id}\n{rule}")
            rows = int(self._options.get("numRows", "20"))
            output.show(rows, self._options.get("truncate", "true").lower() != "false")
            return
        storage = stream.committer.storage
        options = {k: v for k, v in self._options.items() if k != "checkpointLocation"}
        sink_format = self._format or str(
            output.sparkSession.conf.get(DEFAULT_SOURCE_KEY, "parquet")
        )
        file_format = sink_format.lower()  # Spark takes its formats' names in any case
        # Untransformed, the staged parquet files are the batch's output as they are.
        if (
            table is None
            and file_format == "parquet"
            and not self._partition_by
            and self._transformed is None
        ):
            publish_parquet(storage, manifest, options["path"], stream.conf.storage_options)
            return
        if table is None and file_format in FILE_FORMATS:
            path = options.pop("path")

            def write(rows: DataFrame, target: str) -> None:
                self._writer(rows, sink_format, options).save(target)

            publish_files(storage, batch_id, output, path, write, stream.conf.storage_options)
            return
        writer = self._writer(output, self._format, options).mode("append")
        if table is not None and self._cluster_by:
            writer = writer.clusterBy(*self._cluster_by)
        if table is not None:
            create = partial(self._create_table, table)
            conf = stream.conf
            if publish_to_table(
                storage, batch_id, output, table, create, options, conf.storage_options
            ):
                return
        save = (lambda: writer.saveAsTable(table)) if table is not None else writer.save
        publish_once(storage, batch_id, save)

    def _create_table(self, table: str, empty: DataFrame) -> None:
        """Create ``table`` for the rows of ``empty`` (none, of the output's schema) with
        the sink's format, options, partitioning and clustering."""
        options = {k: v for k, v in self._options.items() if k != "checkpointLocation"}
        creator = self._writer(empty, self._format, options)
        if self._cluster_by:
            creator = creator.clusterBy(*self._cluster_by)
        creator.saveAsTable(table)

    def _publishes_files(self, table: str | None) -> bool:
        """Whether batches are published as files into the sink's ``path``."""
        if table is not None or self._foreach_batch is not None or self._foreach is not None:
            return False
        name = self._format_name()
        return "path" in self._options and (name is None or name in FILE_FORMATS)

    def _format_name(self) -> str | None:
        """The sink's format as Spark matches short names: in lower case."""
        return None if self._format is None else self._format.lower()

    def _writer(self, rows: DataFrame, sink_format: str | None, options: dict[str, str]) -> Any:
        """A ``DataFrameWriter`` of ``rows`` with the sink's format, options and partitioning."""
        writer = rows.write.options(**options)
        if sink_format is not None:
            writer = writer.format(sink_format)
        if self._partition_by:
            writer = writer.partitionBy(*self._partition_by)
        return writer

    def _start(self, table: str | None) -> StreamingQuery:
        stream = self._stream
        stream.check_settings_unchanged()
        if self._format_name() == "memory":
            raise ConfigurationError(
                "format 'memory' is not supported: use foreachBatch or a file format"
            )
        if self._cluster_by and table is None:
            raise ConfigurationError(
                f"clusterBy{tuple(self._cluster_by)} needs a table sink: use toTable(name)"
            )
        if (
            self._foreach_batch is None
            and self._foreach is None
            and table is None
            and self._format_name() != "console"
            and ("path" not in self._options)
        ):
            raise ConfigurationError(
                "no sink: give .format(...).option('path', ...), toTable(name), foreachBatch "
                "or foreach"
            )
        spark = stream.df.sparkSession
        no_rows = spark.createDataFrame([], stream.output_schema)
        if self._transformed is not None:
            no_rows = self._transformed.apply(no_rows)
        if table is not None:
            check_table(spark, table, no_rows.schema, self._format)
        checkpoint = self._options.get("checkpointLocation")
        if not checkpoint:
            raise ConfigurationError(
                "no checkpointLocation: set .option('checkpointLocation', dir); the batch "
                "times are read from its offsets/ log"
            )
        tick = stream.conf.tick_interval
        trigger = self._trigger or ({} if tick is None else {"processingTime": f"{tick} seconds"})
        if tick is not None and "processingTime" not in trigger:
            raise ConfigurationError(
                f"trigger {trigger} ends the query, so {TICK_INTERVAL_KEY} has nothing to "
                f"tick: use trigger(processingTime=...) or unset {TICK_INTERVAL_KEY}"
            )
        storage, options = stream.committer.storage, stream.conf.storage_options
        first_start = not is_bound(storage, checkpoint, options)
        if first_start and self._publishes_files(table) and stream.committer.newest_batch() is None:
            path = self._options["path"]
            check_sink_path_is_new(storage, path, options, len(self._partition_by))
        stream.binding_id = bind(storage, checkpoint, options, stream.query[RESTORED_FROM])
        stream.ends_when_caught_up = "processingTime" not in trigger and bool(trigger)
        offsets = BatchTimesReader(location_filesystem(checkpoint, storage, options), checkpoint)

        def run(batch_df: DataFrame, batch_id: int) -> None:
            try:
                times = offsets.read(batch_id)
                if tick is not None:
                    batch_df = without_ticks(batch_df)
                self._publish(stream.run_batch(batch_df, batch_id, times), table)
            except Exception as exc:
                group = current_job_group(batch_df.sparkSession.sparkContext)
                stopped = stop_interruption(exc, batch_id, group)
                if stopped is None:
                    raise
                raise stopped from None

        if table is not None and not spark.catalog.tableExists(table):
            # As Spark's toTable does, before any batch: not inside one a kill can cut short.
            self._create_table(table, no_rows)
        keyed = stream.with_key_groups(stream.df)
        source = keyed if tick is None else with_ticks(keyed, tick)
        writer = source.writeStream.foreachBatch(run).option("checkpointLocation", checkpoint)
        if trigger:
            writer = writer.trigger(**trigger)
        if self._query_name is not None:
            writer = writer.queryName(self._query_name)
        return StatefulStreamingQuery(writer.start(), stream)

    def start(
        self,
        path: str | None = None,
        format: str | None = None,  # noqa: A002 - Spark's keyword
        outputMode: str | None = None,  # noqa: N803
        partitionBy: str | list[str] | None = None,  # noqa: N803
        queryName: str | None = None,  # noqa: N803
        **options: Any,
    ) -> StreamingQuery:
        """Start the query; the arguments as Spark's ``DataStreamWriter.start`` takes them
        (``path``: the sink's path, as ``option("path", ...)``)."""
        if path is not None:
            self._options["path"] = path
        self._apply(format, outputMode, partitionBy, queryName, options)
        return self._start(None)

    def toTable(  # noqa: N802
        self,
        tableName: str,  # noqa: N803
        format: str | None = None,  # noqa: A002 - Spark's keyword
        outputMode: str | None = None,  # noqa: N803
        partitionBy: str | list[str] | None = None,  # noqa: N803
        queryName: str | None = None,  # noqa: N803
        **options: Any,
    ) -> StreamingQuery:
        """Start the query appending each batch's output to table ``tableName``; the other
        arguments as Spark's ``DataStreamWriter.toTable`` takes them."""
        self._apply(format, outputMode, partitionBy, queryName, options)
        return self._start(tableName)

    def _apply(
        self,
        sink_format: str | None,
        output_mode: str | None,
        partition_by: str | list[str] | None,
        query_name: str | None,
        options: dict[str, Any],
    ) -> None:
        """The keyword arguments of ``start``/``toTable``, as their methods take them."""
        if sink_format is not None:
            self.format(sink_format)
        if output_mode is not None:
            self.outputMode(output_mode)
        if partition_by is not None:
            self.partitionBy(partition_by)
        if query_name is not None:
            self.queryName(query_name)
        self.options(**options)
