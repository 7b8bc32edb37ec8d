"""transform_with_state's writer beyond parquet paths: every file format and partitioning
published exactly once (also when Spark re-runs a committed batch after a crash that left
files of an earlier attempt), Spark's default format for a bare path, ``foreach`` sinks
with Spark's (partition_id, epoch_id), and ``outputMode``/``clusterBy`` checks."""

from __future__ import annotations

import json
import shutil
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.sql import DataFrame, Row, SparkSession

from statebackend.errors import ConfigurationError
from statebackend.spark.streaming import transform_with_state
from statebackend.spark.streaming_commit import STAGING_DIR
from tests.spark.jobs import streaming_session
from tests.spark.streaming_parity import ROCKSDB_PROVIDER, write_batches
from tests.spark.test_streaming_api import OUTPUT, Totals

cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROVIDER_KEY = "spark.sql.streaming.stateStore.providerClass"
BATCHES = [
    [{"user": "a", "amount": 1}, {"user": "b", "amount": 2}, {"user": "a", "amount": 4}],
    [{"user": "a", "amount": 5}, {"user": "c", "amount": 7}],
    [{"user": "b", "amount": 1}],
]


def expected_rows() -> list[tuple[str, int]]:
    """Per batch, each user of the batch with the running total after it: Update mode's
    output of ``Totals``, computed in plain Python."""
    totals: dict[str, int] = defaultdict(int)
    rows = []
    for batch in BATCHES:
        for user in sorted({event["user"] for event in batch}):
            totals[user] += sum(e["amount"] for e in batch if e["user"] == user)
            rows.append((user, totals[user]))
    return sorted(rows)


@pytest.fixture
def spark(spark_local: SparkSession, tmp_path: Path) -> Iterator[SparkSession]:
    with streaming_session(spark_local, tmp_path) as session:
        write_batches(tmp_path / "input", BATCHES)
        yield session


def source(spark: SparkSession, tmp_path: Path) -> DataFrame:
    return (
        spark.readStream.schema("user string, amount long")
        .option("maxFilesPerTrigger", 1)
        .json(str(tmp_path / "input"))
    )


def read_back(spark: SparkSession, sink_format: str, out: Path) -> list[tuple[str, int]]:
    reader = spark.read.schema("user string, total long")
    if sink_format == "csv":
        reader = reader.option("header", "true")
    return sorted(
        (row.user, row.total) for row in reader.format(sink_format).load(str(out)).collect()
    )


@pytest.mark.parametrize(
    ("sink_format", "partition_by"),
    [("JSON", ["user"]), ("csv", []), ("parquet", ["user"])],  # Spark takes "JSON" too
)
def test_file_sinks_hold_each_row_once_also_after_a_rerun_over_a_dead_attempt(
    spark: SparkSession, tmp_path: Path, sink_format: str, partition_by: list[str]
) -> None:
    out, checkpoint = tmp_path / "out", tmp_path / "ckpt"

    def run() -> None:
        writer = transform_with_state(
            source(spark, tmp_path), "user", Totals(), OUTPUT, "files"
        ).writeStream.format(sink_format)
        if partition_by:
            writer = writer.partitionBy(*partition_by)
        if sink_format == "csv":
            writer = writer.option("header", "true")
        query = (
            writer.options(path=str(out), checkpointLocation=str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()

    run()
    assert read_back(spark, sink_format, out) == expected_rows()
    files = [p for p in out.rglob("*") if p.is_file() and not p.name.startswith((".", "_"))]
    assert {p.name.split("-")[1] for p in files} == {"0", "1", "2"}  # part-<N>-<k>
    assert not (out / STAGING_DIR).exists()

    # What a driver killed while publishing batch 2 (after our commit, before Spark's
    # commits/2) leaves: an earlier attempt's file the re-run will not write again, and
    # its staging directory. Spark then runs batch 2 again and we publish it again.
    last = sorted(p for p in files if p.name.startswith("part-2-"))[0]
    shutil.copy(last, last.with_name("part-2-00099." + last.name.partition(".")[2]))
    leftover = out / STAGING_DIR / "2-deadbeef" / last.name
    leftover.parent.mkdir(parents=True)
    shutil.copy(last, leftover)
    for name in ("2", ".2.crc"):  # Spark's commit of batch 2 and its checksum file
        (checkpoint / "commits" / name).unlink(missing_ok=True)
    run()
    assert read_back(spark, sink_format, out) == expected_rows()
    assert not last.with_name("part-2-00099." + last.name.partition(".")[2]).exists()
    assert not (out / STAGING_DIR).exists()


def test_a_bare_path_gets_spark_default_format(spark: SparkSession, tmp_path: Path) -> None:
    out = tmp_path / "out"
    spark.conf.set("spark.sql.sources.default", "json")
    try:
        query = (
            transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "bare")
            .writeStream.option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start(str(out))
        )
        query.awaitTermination()
    finally:
        spark.conf.unset("spark.sql.sources.default")
    assert read_back(spark, "json", out) == expected_rows()


class FileWriter:
    """A foreach writer that appends its rows to a JSON-lines file per (partition, epoch)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def open(self, partition_id: int, epoch_id: int) -> bool:
        self.path = Path(self.directory) / f"{epoch_id}-{partition_id}.jsonl"
        self.rows: list[Any] = []
        return True

    def process(self, row: Row) -> None:
        self.rows.append([row.user, row.total])

    def close(self, error: BaseException | None) -> None:
        self.path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))


def test_foreach_writer_gets_every_row_with_its_batch_id(
    spark: SparkSession, tmp_path: Path
) -> None:
    written = tmp_path / "written"
    written.mkdir()
    query = (
        transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "each")
        .writeStream.foreach(FileWriter(str(written)))
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    by_batch: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for path in written.glob("*.jsonl"):
        epoch = int(path.name.split("-")[0])
        by_batch[epoch] += [tuple(json.loads(line)) for line in path.read_text().splitlines()]
    totals: dict[str, int] = defaultdict(int)
    for batch_id, batch in enumerate(BATCHES):
        expected = []
        for user in sorted({event["user"] for event in batch}):
            totals[user] += sum(e["amount"] for e in batch if e["user"] == user)
            expected.append((user, totals[user]))
        assert sorted(by_batch[batch_id]) == expected


def test_writer_mode_checks_are_one_clear_error_each(spark: SparkSession, tmp_path: Path) -> None:
    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "modes")
    assert stateful.writeStream.outputMode("UPDATE") is not None
    with pytest.raises(ConfigurationError, match="outputMode 'append' differs from .* 'Update'"):
        stateful.writeStream.outputMode("append")
    with pytest.raises(ConfigurationError, match="outputMode 'complete' differs"):
        stateful.writeStream.outputMode("complete")
    with pytest.raises(ConfigurationError, match=r"clusterBy\('user',\) needs a table sink"):
        (
            stateful.writeStream.clusterBy("user")
            .format("parquet")
            .options(path=str(tmp_path / "out"), checkpointLocation=str(tmp_path / "ckpt"))
            .start()
        )


@pytest.mark.parametrize("way", ["no columns", "an empty list", "start(partitionBy=[])"])
def test_partition_by_no_columns_writes_unpartitioned_as_sparks_writer(
    spark: SparkSession, tmp_path: Path, way: str
) -> None:
    """``partitionBy()``, ``partitionBy([])`` and ``start(partitionBy=[])`` partition by
    nothing, also after an earlier ``partitionBy("user")``, as Spark's DataStreamWriter
    takes them on its file sink (run on Spark's own transformWithState here): every row
    in the path itself, no ``user=`` directory."""
    out, theirs = tmp_path / "out", tmp_path / "spark-out"

    def start(writer: Any, path: Path, checkpoint: Path) -> None:
        writer = writer.format("parquet").partitionBy("user").trigger(availableNow=True)
        writer = writer.option("checkpointLocation", str(checkpoint))
        if way == "no columns":
            query = writer.partitionBy().start(str(path))
        elif way == "an empty list":
            query = writer.partitionBy([]).start(str(path))
        else:
            query = writer.start(str(path), partitionBy=[])
        query.awaitTermination()

    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "flat")
    start(stateful.writeStream, out, tmp_path / "ckpt")
    spark.conf.set(PROVIDER_KEY, ROCKSDB_PROVIDER)  # Spark's transformWithState needs it
    try:
        theirs_df = source(spark, tmp_path).groupBy("user")
        theirs_df = theirs_df.transformWithState(Totals(), OUTPUT, "Update", "None")
        start(theirs_df.writeStream, theirs, tmp_path / "spark-ckpt")
    finally:
        spark.conf.unset(PROVIDER_KEY)
    assert read_back(spark, "parquet", out) == expected_rows()
    assert read_back(spark, "parquet", theirs) == expected_rows()
    for path in (out, theirs):
        assert [p.name for p in path.iterdir() if p.is_dir() and "=" in p.name] == []


def test_start_and_to_table_take_sparks_keyword_arguments(
    spark: SparkSession, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    query = (
        transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "keywords")
        .writeStream.trigger(availableNow=True)
        .start(
            path=str(out),
            format="json",
            outputMode="update",
            partitionBy="user",
            queryName="keywords",
            checkpointLocation=str(tmp_path / "ckpt"),
        )
    )
    assert query.name == "keywords"
    query.awaitTermination()
    assert read_back(spark, "json", out) == expected_rows()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("_")) == [
        "user=a",
        "user=b",
        "user=c",
    ]

    table = "keyword_totals"
    query = (
        transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "table")
        .writeStream.trigger(availableNow=True)
        .toTable(
            table,
            format="parquet",
            outputMode="Update",
            checkpointLocation=str(tmp_path / "table-ckpt"),
        )
    )
    query.awaitTermination()
    try:
        assert sorted(tuple(row) for row in spark.table(table).collect()) == expected_rows()
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {table}")


class DottedTotals(Totals):
    """Totals of the column named ``a.b`` (a dot in the name, not a nested field)."""

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        yield Row(user=key[0], total=self._add(sum(row["a.b"] for row in rows)))


def test_columns_with_dots_in_their_names(spark: SparkSession, tmp_path: Path) -> None:
    """Spark's own transformWithState fails on such a column; ours takes it."""
    renamed = source(spark, tmp_path).withColumnRenamed("amount", "a.b")
    collected: list[tuple[str, int]] = []

    def collect(df: DataFrame, batch_id: int) -> None:
        collected.extend((row.user, row.total) for row in df.collect())

    query = (
        transform_with_state(renamed, "user", DottedTotals(), OUTPUT, "dots")
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert sorted(collected) == expected_rows()


@pytest.mark.parametrize(("provider", "partition_by"), [("parquet", []), ("json", ["user"])])
def test_file_tables_hold_each_row_once_also_after_a_rerun_over_a_dead_attempt(
    spark: SparkSession, tmp_path: Path, provider: str, partition_by: list[str]
) -> None:
    table, checkpoint = f"totals_{provider}", tmp_path / "ckpt"

    def run() -> None:
        writer = transform_with_state(
            source(spark, tmp_path), "user", Totals(), OUTPUT, "tables"
        ).writeStream.format(provider)
        if partition_by:
            writer = writer.partitionBy(*partition_by)
        query = (
            writer.option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .toTable(table)
        )
        query.awaitTermination()

    def rows() -> list[tuple[str, int]]:
        return sorted((row.user, row.total) for row in spark.table(table).collect())

    try:
        run()
        assert rows() == expected_rows()
        location = Path(
            next(
                str(row[1])
                for row in spark.sql(f"DESCRIBE TABLE EXTENDED {table}").collect()
                if row[0] == "Location"
            ).removeprefix("file:")
        )
        # A driver killed while publishing batch 2 left a file of its attempt that the
        # re-run does not write, and its staging directory; Spark runs batch 2 again.
        published = [p for p in location.rglob("part-2-*") if p.is_file()]
        with_rows = max(published, key=lambda p: p.stat().st_size)  # not a 0-row file
        stale = with_rows.with_name("part-2-00099." + with_rows.name.partition(".")[2])
        shutil.copy(with_rows, stale)
        (location / STAGING_DIR / "2-deadbeef").mkdir(parents=True)
        for name in ("2", ".2.crc"):
            (checkpoint / "commits" / name).unlink(missing_ok=True)
        spark.catalog.refreshTable(table)
        assert len(rows()) > len(expected_rows())  # the stale file duplicates rows now
        run()
        assert rows() == expected_rows()
        assert not stale.exists() and not (location / STAGING_DIR).exists()
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {table}")


def test_to_table_creates_a_missing_table_before_any_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    """As Spark's ``toTable``: the table exists (empty, of the output's columns and the
    sink's format) once ``toTable`` returns, with no input for a batch (it is not created
    inside a batch, where a kill can leave its directory without its catalog entry)."""
    (tmp_path / "empty" / "input").mkdir(parents=True)
    query = (
        transform_with_state(source(spark, tmp_path / "empty"), "user", Totals(), OUTPUT, "eager")
        .writeStream.format("json")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="1 hour")
        .toTable("eager_totals")
    )
    try:
        assert spark.catalog.tableExists("eager_totals")
        provider = next(
            row[1]
            for row in spark.sql("DESCRIBE TABLE EXTENDED eager_totals").collect()
            if row[0] == "Provider"
        )
        assert provider == "json"
        assert spark.table("eager_totals").columns == ["user", "total"]
    finally:
        query.stop()
        spark.sql("DROP TABLE IF EXISTS eager_totals")


def test_a_table_of_other_columns_or_format_is_one_clear_error_before_any_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    spark.sql("CREATE TABLE other_totals (user STRING, amount DOUBLE) USING parquet")
    spark.sql("CREATE TABLE parquet_totals (user STRING, total BIGINT) USING parquet")
    writer = (
        transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "other")
        .writeStream.option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
    )
    try:
        with pytest.raises(ConfigurationError, match="table other_totals has columns"):
            writer.toTable("other_totals")
        with pytest.raises(ConfigurationError, match="parquet_totals is a parquet table, not json"):
            writer.toTable("parquet_totals", format="json")
        assert spark.table("other_totals").count() == spark.table("parquet_totals").count() == 0
        assert not (tmp_path / "ours" / "other").exists()  # no batch ran
    finally:
        spark.sql("DROP TABLE IF EXISTS other_totals")
        spark.sql("DROP TABLE IF EXISTS parquet_totals")


@pytest.mark.parametrize("options", [{}, {"truncate": "false", "numRows": "0"}])
def test_the_console_sink_prints_each_batch_as_sparks_console_sink(
    spark: SparkSession,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    options: dict[str, str],
) -> None:
    """Each batch under Spark's header (a rule, ``Batch: N``, a rule), then its rows as
    ``DataFrame.show(numRows, truncate)`` prints them (default 20 rows, values cut to 20
    characters), as Spark's console sink prints them."""
    users = ["a-user-whose-name-is-longer-than-twenty", "b-another-rather-long-user-name"]
    batches = [[{"user": user, "amount": n}] for n, user in enumerate(users, start=1)]
    shutil.rmtree(tmp_path / "input")
    write_batches(tmp_path / "input", batches)
    rule = "-" * 43
    show = (int(options.get("numRows", 20)), options.get("truncate", "true") == "true")
    expected = []
    for batch_id, batch in enumerate(batches):
        rows = [(event["user"], event["amount"]) for event in batch]
        spark.createDataFrame(rows, OUTPUT).show(*show)
        expected.append(f"{rule}\nBatch: {batch_id}\n{rule}\n{capsys.readouterr().out}")
    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "console")
    writer = stateful.writeStream.format("console").options(**options)
    query = (
        writer.option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert capsys.readouterr().out == "".join(expected)
