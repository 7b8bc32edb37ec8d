"""Vectorised key groups equal the backend's: RowTupleSerializer bytes + mmh3, per row."""

from __future__ import annotations

import datetime
import random
from typing import Any

import mmh3
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DateType,
    DoubleType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
)

from statebackend.keygroups import assign_to_key_group
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.arrow_keys import key_groups, murmur3_32, serialized_keys


@settings(deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=50))
def test_murmur3_equals_mmh3(keys: list[bytes]) -> None:
    hashes = murmur3_32(pa.array(keys, pa.binary()))
    assert hashes.tolist() == [mmh3.hash(key, 0, signed=False) for key in keys]


def test_murmur3_of_a_sliced_array() -> None:
    keys = pa.array([b"a", b"bcdef", b"", b"0123456789"], pa.binary()).slice(1, 2)
    assert murmur3_32(keys).tolist() == [mmh3.hash(k, 0, signed=False) for k in (b"bcdef", b"")]


COLUMNS = {
    "s": (StringType(), pa.string(), st.none() | st.text(max_size=12)),
    "b": (BinaryType(), pa.binary(), st.none() | st.binary(max_size=9)),
    "l": (LongType(), pa.int64(), st.none() | st.integers(-(2**63), 2**63 - 1)),
    "i": (IntegerType(), pa.int32(), st.none() | st.integers(-(2**31), 2**31 - 1)),
    "h": (ShortType(), pa.int16(), st.none() | st.integers(-(2**15), 2**15 - 1)),
    "d": (DoubleType(), pa.float64(), st.none() | st.floats(allow_nan=False)),
    "f": (BooleanType(), pa.bool_(), st.none() | st.booleans()),
    "t": (DateType(), pa.date32(), st.none() | st.dates()),
    "n": (
        TimestampNTZType(),
        pa.timestamp("us"),
        st.none() | st.datetimes(min_value=datetime.datetime(1970, 1, 2)),
    ),
}


@pytest.mark.parametrize(
    "names", [("s",), ("l",), ("s", "l"), ("b", "i", "h", "d", "f", "t"), ("s", "n")]
)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_key_groups_equal_the_backends(names: tuple[str, ...], data: Any) -> None:
    rows = data.draw(
        st.lists(st.tuples(*(COLUMNS[name][2] for name in names)), min_size=1, max_size=30)
    )
    schema = StructType([StructField(name, COLUMNS[name][0]) for name in names])
    batch = pa.RecordBatch.from_arrays(
        [pa.array([row[i] for row in rows], COLUMNS[name][1]) for i, name in enumerate(names)],
        names=list(names),
    )
    serializer = RowTupleSerializer(schema.json())
    expected_bytes = [serializer.serialize(row) for row in rows]
    assert serialized_keys(batch, names, schema.json()).to_pylist() == expected_bytes
    max_parallelism = random.Random(len(rows)).choice([1, 7, 128, 32768])
    assert key_groups(batch, names, schema.json(), max_parallelism).tolist() == [
        assign_to_key_group(key, max_parallelism) for key in expected_bytes
    ]


def test_key_groups_of_array_and_struct_keys_equal_the_backends() -> None:
    """Key types without a vectorised encoding (a JSON object in the schema, not a
    name) are serialized row by row, to the same bytes."""
    schema = StructType(
        [
            StructField("tags", ArrayType(LongType())),
            StructField("point", StructType([StructField("x", LongType())])),
        ]
    )
    tags = [[1, 2], [], None, [None, 3]]
    points = [{"x": 1}, None, {"x": None}, {"x": -5}]
    batch = pa.RecordBatch.from_arrays(
        [pa.array(tags, pa.list_(pa.int64())), pa.array(points, pa.struct([("x", pa.int64())]))],
        names=["tags", "point"],
    )
    serializer = RowTupleSerializer(schema.json())
    expected = [
        serializer.serialize((tag, None if point is None else (point["x"],)))
        for tag, point in zip(tags, points, strict=True)
    ]
    assert serialized_keys(batch, ("tags", "point"), schema.json()).to_pylist() == expected
    assert key_groups(batch, ("tags", "point"), schema.json(), 128).tolist() == [
        assign_to_key_group(key, 128) for key in expected
    ]
