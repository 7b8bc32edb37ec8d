"""Key groups computed in Spark SQL equal the backend's, and the stage runs no Python."""

from __future__ import annotations

import datetime
import random
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DateType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
)

from statebackend.keygroups import assign_to_key_group, compute_operator_index_for_key_group
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.arrow_path import KeyedBatches
from statebackend.spark.processor_runner import KEY_GROUP_COLUMN, SUBTASK_COLUMN

TYPES: dict[str, tuple[Any, list[Any]]] = {
    "l": (LongType(), [0, -1, 1, 2**63 - 1, -(2**63), 255, 256, -256, 2**31, -(2**31) - 1]),
    "i": (IntegerType(), [0, -1, 1, 2**31 - 1, -(2**31), 65535, -65536]),
    "h": (ShortType(), [0, -1, 1, 2**15 - 1, -(2**15)]),
    "b": (ByteType(), [0, -1, 1, 127, -128]),
    "d": (
        DateType(),
        [datetime.date(1970, 1, 1), datetime.date(1, 1, 1), datetime.date(9999, 12, 31)],
    ),
    "f": (BooleanType(), [True, False]),
}
RANDOM = {
    "l": lambda r: r.randrange(-(2**63), 2**63),
    "i": lambda r: r.randrange(-(2**31), 2**31),
    "h": lambda r: r.randrange(-(2**15), 2**15),
    "b": lambda r: r.randrange(-128, 128),
    "d": lambda r: datetime.date(1970, 1, 1) + datetime.timedelta(r.randrange(-719_162, 2_932_896)),
    "f": lambda r: r.random() < 0.5,
}


def _rows(names: tuple[str, ...], nulls: bool, count: int, seed: int) -> list[tuple[Any, ...]]:
    """Random rows with every edge value of each column (and nulls) among them."""
    rnd = random.Random(seed)

    def value(name: str) -> Any:
        choice = rnd.random()
        if nulls and choice < 0.15:
            return None
        if choice < 0.4:
            return rnd.choice(TYPES[name][1])
        return RANDOM[name](rnd)

    return [tuple(value(name) for name in names) for _ in range(count)]


def _with_key_groups(
    spark: SparkSession, names: tuple[str, ...], nulls: bool, parallelism: int, max_p: int
) -> tuple[DataFrame, list[tuple[Any, ...]], str]:
    schema = StructType([StructField(name, TYPES[name][0], nulls) for name in names])
    rows = _rows(names, nulls, 400, seed=max_p + parallelism)
    frame = spark.createDataFrame(rows, schema)
    routed = KeyedBatches().with_key_groups(frame, names, schema.json(), parallelism, max_p)
    return routed, rows, schema.json()


@pytest.mark.parametrize(
    ("names", "nulls", "parallelism", "max_parallelism"),
    [
        (("l",), True, 2, 128),
        (("i",), False, 3, 32768),
        (("l", "i"), False, 5, 7),
        (("h", "b", "f"), True, 4, 128),
        (("d", "l", "i"), True, 1, 1),
        (("b", "l", "f", "d"), False, 7, 4096),
    ],
)
def test_sql_key_groups_equal_the_backends(
    spark_local: SparkSession,
    names: tuple[str, ...],
    nulls: bool,
    parallelism: int,
    max_parallelism: int,
) -> None:
    routed, rows, key_schema = _with_key_groups(
        spark_local, names, nulls, parallelism, max_parallelism
    )
    plan = routed._jdf.queryExecution().executedPlan().toString()
    assert "Python" not in plan and "Arrow" not in plan  # no Python worker in the stage
    serializer = RowTupleSerializer(key_schema)
    expected = []
    for row in rows:
        group = assign_to_key_group(serializer.serialize(row), max_parallelism)
        subtask = compute_operator_index_for_key_group(max_parallelism, parallelism, group)
        expected.append((*row, group, subtask))
    got = [tuple(row) for row in routed.collect()]
    assert routed.columns == [*names, KEY_GROUP_COLUMN, SUBTASK_COLUMN]
    assert sorted(got, key=repr) == sorted(expected, key=repr)


def test_other_keys_keep_the_python_key_groups(spark_local: SparkSession) -> None:
    """A string key (and one of four nullable columns) goes through mapInArrow, with the
    same key groups as the backend."""
    keyed = KeyedBatches()
    strings = StructType([StructField("s", StringType()), StructField("l", LongType())])
    frame = spark_local.createDataFrame([("a", 1), (None, 2), ("é", None)], strings)
    routed = keyed.with_key_groups(frame, ("s", "l"), strings.json(), 2, 128)
    assert "MapInArrow" in routed._jdf.queryExecution().executedPlan().toString()
    serializer = RowTupleSerializer(strings.json())
    assert sorted((tuple(row) for row in routed.collect()), key=repr) == sorted(
        (
            (s, n, g, g * 2 // 128)
            for s, n in [("a", 1), (None, 2), ("é", None)]
            for g in [assign_to_key_group(serializer.serialize((s, n)), 128)]
        ),
        key=repr,
    )
    four = StructType([StructField(name, LongType()) for name in "wxyz"])
    wide = spark_local.createDataFrame([(1, None, 3, 4)], four)
    routed = keyed.with_key_groups(wide, tuple("wxyz"), four.json(), 2, 128)
    assert "MapInArrow" in routed._jdf.queryExecution().executedPlan().toString()
    group = assign_to_key_group(RowTupleSerializer(four.json()).serialize((1, None, 3, 4)), 128)
    assert [tuple(row) for row in routed.collect()] == [(1, None, 3, 4, group, group * 2 // 128)]
