"""Per-batch transformations of ``transform_with_state``'s output before its sink.

Spark's ``transformWithState`` returns a streaming DataFrame, which users go on with:
``.select(...)``, ``.withColumn("date", to_date("ts"))`` for a partitioned sink, a join
with a static table. Ours is a ``StatefulStream`` (a ``foreachBatch`` query underneath),
so these methods record a function that each committed batch's output goes through
before it is published, as ``DataFrame.transform`` would apply it to that batch:

    stateful.withColumn("date", F.to_date("ts")).writeStream.partitionBy("date")...

The function runs on the driver once per published batch (and again on a re-run of the
batch, which must give the same rows for the sink to hold each once: no
``current_timestamp()`` or random columns). It sees one batch's rows: a row-wise change
or a join with a static DataFrame is what the same query gives in Spark; an aggregation
or a ``dropDuplicates`` in it works within each batch only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from pyspark.sql import Column, DataFrame
from pyspark.sql.types import StructType

from statebackend.errors import ConfigurationError, UnavailableMethodError

if TYPE_CHECKING:
    from statebackend.spark.streaming import StatefulStream
    from statebackend.spark.streaming_writer import StatefulStreamWriter

_OUTER_ON_STATIC_SIDE = {"right", "rightouter", "outer", "full", "fullouter"}
"""The join types Spark refuses between a stream (left) and a static DataFrame."""

DATAFRAME_NAMES = frozenset(name for name in dir(DataFrame) if not name.startswith("_"))
"""The public methods and properties of a DataFrame: those the result lacks raise
``UnavailableMethodError`` (``unavailable``), any other name Python's AttributeError."""

STATEFUL_METHODS = frozenset(
    {
        "agg",
        "cube",
        "distinct",
        "dropDuplicates",
        "dropDuplicatesWithinWatermark",
        "drop_duplicates",
        "exceptAll",
        "groupBy",
        "groupby",
        "groupingSets",
        "intersect",
        "intersectAll",
        "limit",
        "offset",
        "rollup",
        "subtract",
        "transpose",
        "union",
        "unionAll",
        "unionByName",
        "withWatermark",
        "zip",
        "zipWithIndex",
    }
)
"""DataFrame methods that on a stream are stateful operators (or need one: a watermark,
a union with another stream), which cannot follow the result of transform_with_state."""

ROW_METHODS = frozenset(
    {
        "crossJoin",
        "hint",
        "lateralJoin",
        "mapInArrow",
        "mapInPandas",
        "melt",
        "observe",
        "orderBy",
        "repartitionById",
        "repartitionByRange",
        "sample",
        "sampleBy",
        "sort",
        "sortWithinPartitions",
        "to",
        "unpivot",
        "withMetadata",
    }
)
"""DataFrame methods returning a DataFrame that ``transform`` can apply to each batch's
output (a sort or a sample then orders or samples one batch's rows)."""

OutputFunction = Callable[[DataFrame], DataFrame]
"""A function of one batch's output DataFrame, returning the DataFrame to publish."""


def unavailable(name: str, streaming: bool) -> UnavailableMethodError:
    """The error of DataFrame method ``name`` on the result of transform_with_state of a
    streaming (or batch) DataFrame: what to do instead."""
    if not streaming:
        message = (
            f"{name} is not a method of transform_with_state's result: for a batch "
            f"DataFrame the result is the DataFrame toDF() returns; use toDF().{name}"
        )
    elif name in STATEFUL_METHODS:
        message = (
            f"{name} cannot follow transform_with_state's result: a stateful operator needs "
            f"a streaming DataFrame, and the result is a foreachBatch query's output; write "
            f"the output and read it as a new stream (or use {name} on each batch's "
            f"DataFrame in writeStream.foreachBatch)"
        )
    elif name in ROW_METHODS:
        message = (
            f"{name} is not a method of transform_with_state's result: apply it to each "
            f"batch's output with transform(lambda df: df.{name}(...)), or in "
            f"writeStream.foreachBatch"
        )
    else:
        message = (
            f"{name} is not a method of transform_with_state's streaming result, which is "
            f"a DataFrame only batch by batch: use {name} on each batch's DataFrame in "
            f"writeStream.foreachBatch(func)"
        )
    return UnavailableMethodError(message)


def no_column_objects(item: Any) -> UnavailableMethodError:
    """The error of ``result.<column>`` or ``result[item]`` (a DataFrame's Column): the
    result has no Columns of its own; what to write instead."""
    if isinstance(item, str):
        return UnavailableMethodError(
            f"{item} is a column of transform_with_state's result, which has no Column "
            f"objects of its own: name it, F.col({item!r}) (from pyspark.sql import "
            f"functions as F), in select, filter, withColumn..."
        )
    return UnavailableMethodError(
        f"transform_with_state's result cannot be indexed with {item!r}: use select(...) "
        f"for columns, filter(...) for a condition, F.col(name) (from pyspark.sql import "
        f"functions as F) for a column"
    )


class OutputTransforms(ABC):
    """``DataFrame``'s row-wise methods on a stateful stream's output, each returning a
    ``TransformedStream`` whose batches go through it (module docstring); any other
    DataFrame method is an ``UnavailableMethodError`` saying what to do."""

    def __getattr__(self, name: str) -> Any:
        """UnavailableMethodError for a DataFrame's method the result lacks; Python's
        AttributeError for any other name, but a column's (``no_column_objects``)."""
        if name not in DATAFRAME_NAMES:
            if not name.startswith("_") and name in self._column_names():
                raise no_column_objects(name)
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self
            )
        if any(name in vars(cls) for cls in type(self).__mro__):
            # One of ours (a property such as writeStream) raised an AttributeError, e.g.
            # from a transform function: raise that again, not "no such method".
            return object.__getattribute__(self, name)
        raise unavailable(name, bool(self.isStreaming))

    def __getitem__(self, item: Any) -> NoReturn:
        """Not a Column: UnavailableMethodError saying what to write (``no_column_objects``)."""
        raise no_column_objects(item)

    def _column_names(self) -> list[str]:
        """The output's columns, or none if a function applied to it fails (that error
        is raised where the output's schema is asked for)."""
        try:
            return self.columns
        except Exception:
            return []

    @abstractmethod
    def transform(
        self, func: Callable[..., DataFrame], *args: Any, **kwargs: Any
    ) -> TransformedStream:
        """A stream whose every batch's output is ``func(output, *args, **kwargs)``, as
        ``DataFrame.transform`` (``func`` must return a DataFrame)."""

    @property
    @abstractmethod
    def schema(self) -> StructType:
        """The schema of each batch's output rows, as ``DataFrame.schema``."""

    @property
    def columns(self) -> list[str]:
        """The names of the output's columns, as ``DataFrame.columns``."""
        return self.schema.fieldNames()

    @property
    def dtypes(self) -> list[tuple[str, str]]:
        """The output's column names and types, as ``DataFrame.dtypes``."""
        return [(field.name, field.dataType.simpleString()) for field in self.schema.fields]

    def printSchema(self, level: int | None = None) -> None:  # noqa: N802 - mirrors DataFrame
        """Print the output's schema as ``DataFrame.printSchema(level)`` does (``level``:
        the nesting depth printed; None or 0: all)."""
        print(self.schema.treeString(level) if level else self.schema.treeString())

    def select(self, *cols: Column | str | list[Column | str]) -> TransformedStream:
        """The output's ``select(*cols)``, batch by batch."""
        return self.transform(DataFrame.select, *cols)

    def selectExpr(self, *expr: str | list[str]) -> TransformedStream:  # noqa: N802
        """The output's ``selectExpr(*expr)``, batch by batch."""
        return self.transform(DataFrame.selectExpr, *expr)

    def filter(self, condition: Column | str) -> TransformedStream:
        """The output's rows for which ``condition`` holds, batch by batch."""
        return self.transform(DataFrame.filter, condition)

    where = filter

    def withColumn(self, colName: str, col: Column) -> TransformedStream:  # noqa: N802,N803
        """The output with column ``colName`` added or replaced, batch by batch."""
        return self.transform(DataFrame.withColumn, colName, col)

    def withColumns(self, colsMap: dict[str, Column]) -> TransformedStream:  # noqa: N802,N803
        """The output with the columns of ``colsMap`` added or replaced, batch by batch."""
        return self.transform(DataFrame.withColumns, colsMap)

    def withColumnRenamed(self, existing: str, new: str) -> TransformedStream:  # noqa: N802
        """The output with column ``existing`` renamed ``new``, batch by batch."""
        return self.transform(DataFrame.withColumnRenamed, existing, new)

    def drop(self, *cols: Column | str) -> TransformedStream:
        """The output without ``cols``, batch by batch."""
        return self.transform(DataFrame.drop, *cols)

    def withColumnsRenamed(self, colsMap: dict[str, str]) -> TransformedStream:  # noqa: N802,N803
        """The output with the columns of ``colsMap`` renamed, batch by batch."""
        return self.transform(DataFrame.withColumnsRenamed, colsMap)

    def alias(self, alias: str) -> TransformedStream:
        """The output under the name ``alias`` (for ``alias.column`` in a join), batch by
        batch."""
        return self.transform(DataFrame.alias, alias)

    def fillna(self, value: Any, subset: Any = None) -> TransformedStream:
        """The output with its nulls replaced by ``value``, as ``DataFrame.fillna``."""
        return self.transform(DataFrame.fillna, value, subset)

    def dropna(
        self, how: str = "any", thresh: int | None = None, subset: Any = None
    ) -> TransformedStream:
        """The output without the rows with nulls, as ``DataFrame.dropna``."""
        return self.transform(DataFrame.dropna, how, thresh, subset)

    def replace(self, *args: Any, **kwargs: Any) -> TransformedStream:
        """The output with values replaced, as ``DataFrame.replace(to_replace, value,
        subset)``."""
        return self.transform(DataFrame.replace, *args, **kwargs)

    @property
    def na(self) -> OutputNaFunctions:
        """``fill``, ``drop`` and ``replace`` of the output, as ``DataFrame.na``."""
        return OutputNaFunctions(self)

    def repartition(self, numPartitions: Any, *cols: Column | str) -> TransformedStream:  # noqa: N803
        """Each batch's output in ``numPartitions`` partitions (or by ``cols``), as
        ``DataFrame.repartition``: a file sink writes a file per partition."""
        return self.transform(DataFrame.repartition, numPartitions, *cols)

    def coalesce(self, numPartitions: int) -> TransformedStream:  # noqa: N803
        """Each batch's output in at most ``numPartitions`` partitions, as
        ``DataFrame.coalesce`` (``coalesce(1)``: a file per batch)."""
        return self.transform(DataFrame.coalesce, numPartitions)

    def join(
        self,
        other: DataFrame,
        on: str | list[str] | Column | list[Column] | None = None,
        how: str | None = None,
    ) -> TransformedStream:
        """The output joined with the static DataFrame ``other``, batch by batch, as
        ``DataFrame.join``; the joins Spark takes of a stream with a static DataFrame
        (inner, cross, left outer, semi, anti), as Spark refuses the others."""
        if other.isStreaming:
            raise ConfigurationError(
                "join of transform_with_state's output with a streaming DataFrame is not "
                "supported (a stateful operator cannot follow it): write the output and read "
                "it as a new stream"
            )
        if how is not None and how.lower().replace("_", "") in _OUTER_ON_STATIC_SIDE:
            raise ConfigurationError(
                f"join how={how!r} of transform_with_state's output with a static DataFrame "
                f"is not supported, as in Spark (the static side's rows would repeat every "
                f"batch): use inner, left, semi or anti"
            )
        return self.transform(DataFrame.join, other, on, how)


class OutputNaFunctions:
    """``DataFrame.na`` of a stateful stream's output: its ``fillna``, ``dropna`` and
    ``replace``."""

    def __init__(self, stream: OutputTransforms) -> None:
        self._stream = stream

    def fill(self, value: Any, subset: Any = None) -> TransformedStream:
        """The output's ``fillna(value, subset)``."""
        return self._stream.fillna(value, subset)

    def drop(
        self, how: str = "any", thresh: int | None = None, subset: Any = None
    ) -> TransformedStream:
        """The output's ``dropna(how, thresh, subset)``."""
        return self._stream.dropna(how, thresh, subset)

    def replace(self, *args: Any, **kwargs: Any) -> TransformedStream:
        """The output's ``replace(to_replace, value, subset)``."""
        return self._stream.replace(*args, **kwargs)


def no_writer_error(df: DataFrame) -> UnavailableMethodError:
    """What ``.write`` of a stateful stream of ``df`` raises: it says how to write the
    output (``toDF()`` runs a batch DataFrame's batch, which ``.write`` must not do
    unasked); an AttributeError too, as for any DataFrame method the result lacks."""
    if df.isStreaming:
        return UnavailableMethodError(
            "transform_with_state of a streaming DataFrame has no .write: use writeStream"
        )
    return UnavailableMethodError(
        "transform_with_state of a batch DataFrame has no .write: run the batch with "
        "toDF() and write its result (stateful.toDF().write...)"
    )


def _checked(
    func: Callable[..., DataFrame], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> OutputFunction:
    """``func`` bound to ``args``/``kwargs``; ConfigurationError naming it when a batch's
    result is not a DataFrame."""

    def apply(output: DataFrame) -> DataFrame:
        result = func(output, *args, **kwargs)
        if not isinstance(result, DataFrame):
            raise ConfigurationError(
                f"transform function {getattr(func, '__name__', func)!r} returned a "
                f"{type(result).__name__}, not a DataFrame: return the changed DataFrame"
            )
        return result

    return apply


class TransformedStream(OutputTransforms):
    """A ``StatefulStream`` whose batches' output goes through ``functions`` in order
    before the sink (or ``toDF()``); its state, job and metrics are the stream's."""

    def __init__(self, stream: StatefulStream, functions: tuple[OutputFunction, ...]) -> None:
        self.stream = stream
        self.functions = functions
        self.metrics = stream.metrics
        """The stream's metrics history (``StatefulStream.metrics``)."""

    def transform(
        self, func: Callable[..., DataFrame], *args: Any, **kwargs: Any
    ) -> TransformedStream:
        """This stream's output further transformed by ``func(output, *args, **kwargs)``."""
        return TransformedStream(self.stream, (*self.functions, _checked(func, args, kwargs)))

    def apply(self, output: DataFrame) -> DataFrame:
        """``output`` (one batch's rows) through the functions in order."""
        for function in self.functions:
            output = function(output)
        return output

    @property
    def schema(self) -> StructType:
        """The schema of the published rows: the functions applied to no rows of the
        stream's output schema (an error in a function, e.g. an unknown column, is raised
        here, before any batch runs)."""
        spark = self.stream.df.sparkSession
        return self.apply(spark.createDataFrame([], self.stream.output_schema)).schema

    @property
    def isStreaming(self) -> bool:  # noqa: N802 - mirrors DataFrame.isStreaming
        """Whether the stream's input is a streaming DataFrame."""
        return self.stream.isStreaming

    @property
    def writeStream(self) -> StatefulStreamWriter:  # noqa: N802 - mirrors DataFrame.writeStream
        """The stream's writer (``StatefulStream.writeStream``) publishing the transformed
        output."""
        self.schema  # noqa: B018 - a function that cannot apply fails here
        return self.stream.stream_writer(self)

    @property
    def write(self) -> NoReturn:
        """Not a writer: UnavailableMethodError saying how to write the output."""
        raise no_writer_error(self.stream.df)

    def toDF(self) -> DataFrame:  # noqa: N802 - mirrors Spark's naming
        """The stream's ``toDF()`` (runs a batch DataFrame as the next batch), transformed."""
        self.schema  # noqa: B018 - a function that cannot apply fails before the batch
        return self.apply(self.stream.toDF())
