"""Exactly-once ``toTable`` for file-source catalog tables (``parquet``, ``json``, ``csv``,
``orc``, ``text``, ``avro``): a committed batch's rows go into the table's location by
``streaming_commit.publish_files``, named after the batch, so a re-run leaves each row
once; then new partitions are registered and the table's cached listing is refreshed.

A table of another provider (Delta, Hive-format, a V2 catalog's), a bucketed or a
clustered one is appended to with Spark's ``saveAsTable`` instead, guarded by the
``published/<N>`` marker (at-least-once between the append and the marker).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import ConfigurationError
from statebackend.spark.sql_key_groups import quoted
from statebackend.spark.streaming_commit import FILE_FORMATS, publish_files


@dataclass(frozen=True)
class FileTable:
    """What ``describe_file_table`` found of a catalog table its rows can be written to
    as files."""

    location: str
    provider: str
    columns: list[str]
    """Data columns first, in the table's order, then the partition columns."""
    partition_columns: list[str]
    catalog_partitions: bool
    """True if the catalog tracks the partitions (they must be registered)."""


def describe_file_table(spark: SparkSession, table: str) -> FileTable | None:
    """The location and layout of the existing ``table`` if it is a file-source table
    without buckets or clustering, else None."""
    columns = spark.catalog.listColumns(table)
    if any(column.isBucket or getattr(column, "isCluster", False) for column in columns):
        return None
    details = {
        str(row[0]): str(row[1]) for row in spark.sql(f"DESCRIBE TABLE EXTENDED {table}").collect()
    }
    provider = details.get("Provider", "").lower()
    location = details.get("Location")
    if provider not in FILE_FORMATS or not location:
        return None
    return FileTable(
        location=location,
        provider=provider,
        columns=[column.name for column in columns],
        partition_columns=[column.name for column in columns if column.isPartition],
        catalog_partitions=details.get("Partition Provider") == "Catalog",
    )


def _check_columns(
    spark: SparkSession, table: str, described: FileTable, schema: StructType
) -> None:
    """ConfigurationError unless the output ``schema`` has the table's columns (by name,
    as ``saveAsTable`` appends), with their types (nullability aside)."""
    table_types = {
        field.name.lower(): field.dataType.simpleString() for field in spark.table(table).schema
    }
    output_types = {field.name.lower(): field.dataType.simpleString() for field in schema}
    if table_types != output_types:
        raise ConfigurationError(
            f"table {table} has columns {described.columns} of other names or types than the "
            f"output schema {schema.simpleString()}: write to a table of the output schema"
        )


def check_table(
    spark: SparkSession, table: str, schema: StructType, sink_format: str | None
) -> None:
    """Before a query starts: ConfigurationError if ``table`` is a file-source table with
    other columns than the output ``schema``, or of another format than ``sink_format``
    (if given), as Spark's writer refuses them."""
    if not spark.catalog.tableExists(table):
        return
    described = describe_file_table(spark, table)
    if described is None:
        return
    if sink_format is not None and sink_format.lower() != described.provider:
        raise ConfigurationError(
            f"table {table} is a {described.provider} table, not {sink_format}: give its "
            f"format or none"
        )
    _check_columns(spark, table, described, schema)


def publish_to_table(
    storage: CheckpointStorage,
    batch_id: int,
    output: DataFrame,
    table: str,
    create: Callable[[DataFrame], None],
    options: dict[str, Any],
    storage_options: dict[str, Any],
) -> bool:
    """Publish a committed batch's rows into ``table`` exactly once if it is (or, created
    by ``create(empty output)``, becomes) a file-source table; False (nothing done) if it
    is not, for the caller to append. ``options`` are the sink's writer options. A
    partitioned table whose partitions the catalog tracks has them recovered after each
    batch (``ALTER TABLE ... RECOVER PARTITIONS``, a listing of its partition
    directories), as Spark's ``MSCK REPAIR`` would."""
    spark = output.sparkSession
    if not spark.catalog.tableExists(table):
        create(output.limit(0))
    described = describe_file_table(spark, table)
    if described is None:
        return False
    _check_columns(spark, table, described, output.schema)

    writer_options = {key: value for key, value in options.items() if key != "path"}

    def write(rows: DataFrame, target: str) -> None:
        columns = [F.col(quoted(name)) for name in described.columns]
        writer = rows.select(*columns).write.format(described.provider)
        if described.partition_columns:
            writer = writer.partitionBy(*described.partition_columns)
        writer.options(**writer_options).save(target)

    publish_files(storage, batch_id, output, described.location, write, storage_options)
    if described.partition_columns and described.catalog_partitions:
        spark.sql(f"ALTER TABLE {table} RECOVER PARTITIONS")
    spark.catalog.refreshTable(table)
    return True
