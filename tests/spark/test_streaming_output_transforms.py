"""``select``/``withColumn``/``filter``/``transform``... on transform_with_state's output:
each committed batch's rows go through them before the sink, as the same methods on
Spark's transformWithState DataFrame give (compared with Spark's own operator and with
plain Python), into partitioned and plain parquet paths, ``toTable`` and ``toDF``;
a function that cannot apply to the output is an error before any batch."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark import cloudpickle
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from statebackend.errors import ConfigurationError, UnavailableMethodError
from statebackend.spark.streaming import transform_with_state
from tests.spark.jobs import streaming_session
from tests.spark.streaming_parity import ROCKSDB_PROVIDER, write_batches
from tests.spark.test_streaming_api import OUTPUT, Totals
from tests.spark.test_streaming_sinks import source

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BATCHES = [
    [{"user": "a", "amount": 1}, {"user": "b", "amount": 2}, {"user": "a", "amount": 4}],
    [{"user": "a", "amount": 5}, {"user": "c", "amount": 7}],
    [{"user": "b", "amount": 1}, {"user": "c", "amount": 3}],
]


def expected(keep: int) -> list[tuple[str, int, int]]:
    """Per batch, each user of the batch with its running total, its parity and twice the
    total, for totals above ``keep``: ``Totals``' Update-mode output, then the
    transformation of ``_transformed``, in plain Python."""
    totals: dict[str, int] = defaultdict(int)
    rows = []
    for batch in BATCHES:
        for user in sorted({event["user"] for event in batch}):
            totals[user] += sum(e["amount"] for e in batch if e["user"] == user)
            if totals[user] > keep:
                rows.append((user.upper(), totals[user] % 2, 2 * totals[user]))
    return sorted(rows)


def _transformed(output: DataFrame, keep: int) -> DataFrame:
    """The query's continuation, as a user writes it on Spark's transformWithState."""
    return (
        output.withColumn("parity", F.col("total") % 2)
        .where(F.col("total") > keep)
        .withColumnRenamed("total", "amount")
        .select(F.upper("user").alias("user"), "parity", (F.col("amount") * 2).alias("double"))
    )


@pytest.fixture
def spark(spark_local: SparkSession, tmp_path: Path) -> Iterator[SparkSession]:
    provider = ("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    with streaming_session(spark_local, tmp_path, provider) as session:
        write_batches(tmp_path / "input", BATCHES)
        yield session


def _rows(frame: DataFrame) -> list[tuple[str, int, int]]:
    return sorted((r.user, r.parity, r.double) for r in frame.collect())


@pytest.mark.parametrize("partition_by", [["parity"], []])
def test_output_transformed_before_a_parquet_sink_as_sparks_query_gives(
    spark: SparkSession, tmp_path: Path, partition_by: list[str]
) -> None:
    """Chained methods (partitioned by a column they add, or into a plain path, which
    then goes through Spark's writer, not the staged files) against Spark's own
    transformWithState with the same continuation, and plain Python."""
    ours, theirs = tmp_path / "ours-out", tmp_path / "spark-out"
    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "chained")
    chained = (
        stateful.withColumn("parity", F.col("total") % 2)
        .where(F.col("total") > 3)
        .withColumnRenamed("total", "amount")
        .select(F.upper("user").alias("user"), "parity", (F.col("amount") * 2).alias("double"))
    )
    writer = chained.writeStream.format("parquet")
    if partition_by:
        writer = writer.partitionBy(*partition_by)
    query = (
        writer.option("path", str(ours))
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()

    spark_query = (
        _transformed(
            source(spark, tmp_path)
            .groupBy("user")
            .transformWithState(Totals(), OUTPUT, "Update", "None"),
            3,
        )
        .writeStream.format("parquet")
        .partitionBy(*partition_by)
        .option("path", str(theirs))
        .option("checkpointLocation", str(tmp_path / "spark-ckpt"))
        .trigger(availableNow=True)
        .start()
    )
    spark_query.awaitTermination()

    assert _rows(spark.read.parquet(str(ours))) == _rows(spark.read.parquet(str(theirs)))
    assert _rows(spark.read.parquet(str(ours))) == expected(3)
    if partition_by:
        assert {p.name for p in ours.iterdir() if p.is_dir()} == {"parity=0", "parity=1"}


def test_transform_to_table_and_to_df(spark: SparkSession, tmp_path: Path) -> None:
    """``transform(func, *args)`` as ``DataFrame.transform``: a table sink is created with
    the transformed columns; on a batch DataFrame ``toDF()`` returns the transformed
    batch."""
    query = (
        transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "table")
        .transform(_transformed, 0)
        .writeStream.format("parquet")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .toTable("transformed_totals")
    )
    try:
        query.awaitTermination()
        assert spark.table("transformed_totals").columns == ["user", "parity", "double"]
        assert _rows(spark.table("transformed_totals")) == expected(0)
    finally:
        spark.sql("DROP TABLE IF EXISTS transformed_totals")

    batch = spark.createDataFrame(
        [(e["user"], e["amount"]) for e in BATCHES[0]], "user string, amount long"
    )
    frame = (
        transform_with_state(batch, "user", Totals(), OUTPUT, "batch")
        .transform(_transformed, 3)
        .toDF()
    )
    assert _rows(frame) == [("A", 1, 10)]


def test_schema_columns_and_print_schema_as_a_dataframe_gives_them(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "schema")
    chained = stateful.transform(_transformed, 3)
    like = _transformed(spark.createDataFrame([], OUTPUT), 3)
    assert stateful.columns == ["user", "total"] and stateful.isStreaming
    assert chained.schema == like.schema and chained.columns == like.columns
    assert chained.isStreaming
    like.printSchema()
    expected = capsys.readouterr().out
    chained.printSchema()
    assert capsys.readouterr().out == expected


def test_a_continuation_that_cannot_apply_is_an_error_before_any_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    """An unknown column is Spark's AnalysisException at ``writeStream``, a function
    returning no DataFrame our ConfigurationError naming it; no batch ran."""
    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "bad")
    with pytest.raises(AnalysisException, match="amount"):
        stateful.select("user", "amount").writeStream  # noqa: B018 - the property checks

    def count_rows(output: DataFrame) -> int:
        return output.count()

    with pytest.raises(ConfigurationError, match="'count_rows' returned a int, not a DataFrame"):
        stateful.transform(count_rows).writeStream  # noqa: B018
    assert not (tmp_path / "ours" / "bad" / "changelog").exists()
    with pytest.raises(ConfigurationError, match="has no .write: use writeStream"):
        stateful.select("user").write  # noqa: B018


@pytest.mark.parametrize("level", [1, 2, 0])
def test_print_schema_with_a_level_as_a_dataframe_prints_it(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str], level: int
) -> None:
    """``printSchema(level)`` prints the output's schema to that nesting depth, as
    ``DataFrame.printSchema(level)`` prints the same chain's."""

    def nested(output: DataFrame) -> DataFrame:
        return output.withColumn("pair", F.struct("user", F.struct("total").alias("inner")))

    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "level")
    nested(spark.createDataFrame([], OUTPUT)).printSchema(level)
    expected = capsys.readouterr().out
    stateful.transform(nested).printSchema(level)
    assert capsys.readouterr().out == expected


def test_join_with_a_static_dataframe_as_sparks_query_gives(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``join`` of the output with a static DataFrame, inner and left outer, against the
    same join of Spark's transformWithState DataFrame and plain Python; the joins Spark
    refuses on a stream are refused before any batch."""
    regions = {"a": "north", "c": "east", "z": "west"}
    static = spark.createDataFrame(sorted(regions.items()), "user string, region string")
    totals: dict[str, int] = defaultdict(int)
    outputs = []
    for batch in BATCHES:
        for user in sorted({event["user"] for event in batch}):
            totals[user] += sum(e["amount"] for e in batch if e["user"] == user)
            outputs.append((user, totals[user], regions.get(user)))
    for how in ("inner", "left"):
        ours, theirs = tmp_path / f"ours-{how}", tmp_path / f"spark-{how}"
        stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, how)
        queries = [
            stateful.join(static, "user", how)
            .writeStream.format("parquet")
            .option("path", str(ours))
            .option("checkpointLocation", str(tmp_path / f"ckpt-{how}")),
            source(spark, tmp_path)
            .groupBy("user")
            .transformWithState(Totals(), OUTPUT, "Update", "None")
            .join(static, "user", how)
            .writeStream.format("parquet")
            .option("path", str(theirs))
            .option("checkpointLocation", str(tmp_path / f"spark-ckpt-{how}")),
        ]
        for writer in queries:
            writer.trigger(availableNow=True).start().awaitTermination()
        got = sorted((r.user, r.total, r.region) for r in spark.read.parquet(str(ours)).collect())
        want = [row for row in outputs if how == "left" or row[2] is not None]
        assert got == sorted(want)
        assert got == sorted(
            (r.user, r.total, r.region) for r in spark.read.parquet(str(theirs)).collect()
        )

    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "outer")
    for how in ("right_outer", "full"):
        with pytest.raises(ConfigurationError, match=f"join how='{how}' .* use inner, left"):
            stateful.join(static, "user", how)
    with pytest.raises(ConfigurationError, match="with a streaming DataFrame is not supported"):
        stateful.join(source(spark, tmp_path), "user")


def _null_handling(output: Any, static: DataFrame) -> Any:
    """``alias`` (in a join with a static DataFrame), ``withColumnsRenamed``, ``na``,
    ``fillna``, ``dropna``, ``replace`` and ``coalesce`` after transformWithState: the
    same calls on our stream and on Spark's DataFrame."""
    total = F.col("total")
    return (
        output.alias("t")
        .join(static.alias("s"), F.col("t.user") == F.col("s.user"))
        .select("t.user", "t.total", "s.region")
        .withColumns(
            {
                "odd": F.when(total % 2 == 1, total),
                "low": F.when(total < 10, total),
                "size": F.when(total > 4, F.lit("big")),
            }
        )
        .na.fill(-1, ["odd"])
        .fillna("small", ["size"])
        .replace("big", "BIG", "size")
        .na.replace(-1, 0, ["odd"])
        .na.drop(subset=["low"])
        .dropna(how="all", subset=["odd", "size"])
        .withColumnsRenamed({"low": "under_ten"})
        .coalesce(1)
    )


def test_alias_null_handling_renames_and_coalesce_as_sparks_query_gives(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The row-wise methods beyond select/withColumn against the same chain on Spark's
    own transformWithState and plain Python; ``coalesce(1)`` writes a file per batch."""
    regions = {"a": "north", "b": "south", "z": "west"}
    static = spark.createDataFrame(sorted(regions.items()), "user string, region string")
    totals: dict[str, int] = defaultdict(int)
    want = []
    for batch in BATCHES:
        for user in sorted({event["user"] for event in batch}):
            totals[user] += sum(e["amount"] for e in batch if e["user"] == user)
            value = totals[user]
            if user in regions and value < 10:
                size = "BIG" if value > 4 else "small"
                want.append((user, value, regions[user], value if value % 2 else 0, value, size))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "na")
    spark_output = (
        source(spark, tmp_path)
        .groupBy("user")
        .transformWithState(Totals(), OUTPUT, "Update", "None")
    )
    for output, path in ((stateful, ours), (spark_output, theirs)):
        (
            _null_handling(output, static)
            .writeStream.format("parquet")
            .option("path", str(path))
            .option("checkpointLocation", str(tmp_path / f"{path.name}-ckpt"))
            .trigger(availableNow=True)
            .start()
            .awaitTermination()
        )

    def rows(path: Path) -> list[tuple[Any, ...]]:
        frame = spark.read.parquet(str(path))
        assert frame.columns == ["user", "total", "region", "odd", "under_ten", "size"]
        return sorted(tuple(row) for row in frame.collect())

    assert rows(ours) == sorted(want)
    assert rows(ours) == rows(theirs)
    for batch_id in range(len(BATCHES)):
        assert len(list(ours.glob(f"part-{batch_id}-*"))) <= 1  # coalesce(1)


def test_repartition_of_a_batch_output_as_dataframe_repartition(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``repartition(n)`` and ``repartition(n, col)`` give the batch's rows in ``n``
    partitions, as the same calls on a DataFrame of those rows; ``dtypes`` is the
    DataFrame's."""
    batch = spark.createDataFrame(
        [(e["user"], e["amount"]) for e in BATCHES[0]], "user string, amount long"
    )
    want = sorted(
        (user, sum(e["amount"] for e in BATCHES[0] if e["user"] == user))
        for user in {e["user"] for e in BATCHES[0]}
    )
    for job, repartitioned in [
        ("three", lambda stream: stream.repartition(3)),
        ("by-user", lambda stream: stream.repartition(3, "user")),
    ]:
        stateful = transform_with_state(batch, "user", Totals(), OUTPUT, job)
        like = repartitioned(spark.createDataFrame(want, OUTPUT))
        chained = repartitioned(stateful)
        assert chained.dtypes == like.dtypes == [("user", "string"), ("total", "bigint")]
        frame = chained.toDF()
        assert frame.rdd.getNumPartitions() == like.rdd.getNumPartitions() == 3
        assert sorted(tuple(row) for row in frame.collect()) == want


LACKING = ["dropDuplicates", "groupBy", "withWatermark", "unionByName", "limit", "toJSON"]
LACKING += ["explain", "count", "collect", "show", "sortWithinPartitions", "rdd"]


def test_dataframe_methods_the_result_lacks_say_what_to_do(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Each DataFrame method the result lacks is one UnavailableMethodError naming it and
    saying what to do: a ConfigurationError and an AttributeError, so ``hasattr`` is
    False and ``getattr`` with a default gives the default; a name no DataFrame has is
    Python's AttributeError, and an AttributeError a transform function raises in a
    property of ours is that error, not "no such method"."""
    like = spark.createDataFrame([], OUTPUT)
    assert all(hasattr(like, name) for name in LACKING)  # each is a DataFrame's
    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "lacks")
    for stream in (stateful, stateful.select("user", "total")):
        for name in LACKING:
            with pytest.raises(UnavailableMethodError, match=f"^{name} ") as caught:
                getattr(stream, name)
            assert isinstance(caught.value, ConfigurationError)
            assert isinstance(caught.value, AttributeError)
            assert "\n" not in str(caught.value)
            assert not hasattr(stream, name)
            assert getattr(stream, name, None) is None
        with pytest.raises(UnavailableMethodError, match="stateful operator .* new stream"):
            stream.groupBy  # noqa: B018
        with pytest.raises(UnavailableMethodError, match=r"use count on each .*foreachBatch"):
            stream.count  # noqa: B018
        with pytest.raises(UnavailableMethodError, match=r"transform\(lambda df: df\.sort"):
            stream.sortWithinPartitions  # noqa: B018
        with pytest.raises(AttributeError, match="no attribute 'user_total'") as plain:
            stream.user_total  # noqa: B018
        assert not isinstance(plain.value, ConfigurationError)
        assert getattr(stream, "user_total", 7) == 7

    batch = spark.createDataFrame([("a", 1)], "user string, amount long")
    batch_result = transform_with_state(batch, "user", Totals(), OUTPUT, "lacks-batch")
    with pytest.raises(UnavailableMethodError, match=r"^collect .* use toDF\(\)\.collect$"):
        batch_result.collect  # noqa: B018

    def misspelt(output: DataFrame) -> DataFrame:
        return output.selectt("user")  # type: ignore[attr-defined, no-any-return]

    with pytest.raises(AttributeError, match="selectt") as raised:
        stateful.transform(misspelt).writeStream  # noqa: B018
    assert not isinstance(raised.value, UnavailableMethodError)


def test_a_column_of_the_result_by_attribute_or_index_says_to_name_it(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``stateful.total`` and ``stateful["total"]``, a DataFrame's Columns, are one
    UnavailableMethodError saying to name the column with ``F.col``; the chain written so
    gives Spark's rows for the same DataFrame."""
    stateful = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "cols")
    like = spark.createDataFrame([("a", 5), ("b", 1)], OUTPUT)
    for stream in (stateful, stateful.withColumn("double", F.col("total") * 2)):
        for name in stream.columns:
            with pytest.raises(UnavailableMethodError, match=rf"^{name} .* F\.col\('{name}'\)"):
                getattr(stream, name)
            with pytest.raises(UnavailableMethodError, match=rf"F\.col\('{name}'\)") as caught:
                stream[name]  # noqa: B018
            assert "\n" not in str(caught.value)
            assert not hasattr(stream, name)
        with pytest.raises(AttributeError, match="no attribute 'user_total'"):
            stream.user_total  # noqa: B018
    batch = spark.createDataFrame([("a", 5), ("b", 1)], "user string, amount long")
    named = transform_with_state(batch, "user", Totals(), OUTPUT, "cols-batch")
    got = named.filter(F.col("total") > 3).select(F.col("user")).toDF().collect()
    assert got == like.filter(like.total > 3).select(like["user"]).collect()


def test_write_is_an_unavailable_method_so_hasattr_is_false(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``.write`` of the result (a DataFrame's writer, which Spark's streaming DataFrame
    refuses when it saves) is an UnavailableMethodError saying how to write the output,
    as any DataFrame method the result lacks: ``hasattr`` is False."""
    batch = spark.createDataFrame([("a", 1)], "user string, amount long")
    streaming = transform_with_state(source(spark, tmp_path), "user", Totals(), OUTPUT, "w")
    batched = transform_with_state(batch, "user", Totals(), OUTPUT, "w-batch")
    for result, says in [
        (streaming, r"^transform_with_state of a streaming DataFrame has no \.write: use "),
        (batched, r"^transform_with_state of a batch DataFrame has no \.write: run the batch"),
    ]:
        for stream in (result, result.select("user")):
            with pytest.raises(UnavailableMethodError, match=says):
                stream.write  # noqa: B018
            assert not hasattr(stream, "write")
            assert getattr(stream, "write", None) is None
