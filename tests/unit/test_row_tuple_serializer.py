"""RowTupleSerializer: tuples of a Spark schema, round trips, and schema identity."""

from __future__ import annotations

import datetime
import decimal
import functools
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
)

from statebackend.errors import ConfigurationError, IncompatibleStateError, SerializationError
from statebackend.serializers import (
    Compatibility,
    PickleSerializer,
    RowTupleSerializer,
    resolve_serializer,
    serializer_from_config,
)
from statebackend.state.ttl import TtlSerializer, TtlValue

SCHEMA = StructType(
    [
        StructField("name", StringType()),
        StructField("count", LongType()),
        StructField("small", IntegerType()),
        StructField("ratio", DoubleType()),
        StructField("flag", BooleanType()),
        StructField("raw", BinaryType()),
        StructField("day", DateType()),
        StructField("at", TimestampNTZType()),
        StructField("amount", DecimalType(10, 2)),
        StructField("tags", ArrayType(StringType())),
        StructField("scores", MapType(StringType(), LongType())),
        StructField("inner", StructType([StructField("a", LongType())])),
    ]
)

ROWS = st.tuples(
    st.none() | st.text(),
    st.none() | st.integers(-(2**63), 2**63 - 1),
    st.none() | st.integers(-(2**31), 2**31 - 1),
    st.none() | st.floats(allow_nan=False),
    st.none() | st.booleans(),
    st.none() | st.binary(),
    st.none() | st.dates(),
    st.none() | st.datetimes(min_value=datetime.datetime(1900, 1, 1)),
    st.none()
    | st.decimals(
        places=2, allow_nan=False, allow_infinity=False, min_value=-(10**6), max_value=10**6
    ),
    st.none() | st.lists(st.none() | st.text(max_size=5), max_size=4),
    st.none() | st.dictionaries(st.text(max_size=5), st.none() | st.integers(0, 99), max_size=4),
    st.none() | st.tuples(st.none() | st.integers(0, 10)),
)


@given(ROWS)
def test_round_trip_matches_the_value(row: tuple[Any, ...]) -> None:
    serializer = RowTupleSerializer(SCHEMA.json())
    data = serializer.serialize(row)
    assert serializer.serialize(row) == data
    assert serializer.deserialize(data) == row


ARRAY_KEYED = StructType(
    [
        StructField("m", MapType(ArrayType(IntegerType()), LongType())),
        StructField(
            "nested",
            MapType(
                StructType([StructField("path", ArrayType(ArrayType(StringType())))]), StringType()
            ),
        ),
    ]
)


@given(
    st.dictionaries(
        st.lists(st.none() | st.integers(-(2**31), 2**31 - 1), max_size=3).map(tuple),
        st.none() | st.integers(0, 99),
        max_size=4,
    ),
    st.dictionaries(
        st.tuples(
            st.none()
            | st.lists(st.lists(st.text(max_size=2), max_size=2).map(tuple), max_size=2).map(tuple)
        ),
        st.text(max_size=3),
        max_size=3,
    ),
)
def test_maps_with_array_keys_round_trip(m: dict[Any, Any], nested: dict[Any, Any]) -> None:
    """Arrays inside map keys (nested in arrays and structs too) read back as tuples, which
    a dict key must be."""
    serializer = RowTupleSerializer(ARRAY_KEYED.json())
    assert serializer.deserialize(serializer.serialize((m, nested))) == (m, nested)


def test_rows_lists_and_dicts_encode_like_tuples() -> None:
    from pyspark.sql import Row

    serializer = RowTupleSerializer(StructType([StructField("a", LongType())]).json())
    expected = serializer.serialize((5,))
    assert serializer.serialize(Row(a=5)) == expected
    assert serializer.serialize([5]) == expected
    assert serializer.serialize({"a": 5}) == expected


NUMBERS = StructType(
    [
        StructField("b", ByteType()),
        StructField("s", ShortType()),
        StructField("i", IntegerType()),
        StructField("l", LongType()),
        StructField("f", FloatType()),
        StructField("d", DoubleType()),
    ]
)
NUMBER_ROWS = st.tuples(
    st.none() | st.integers(-(2**7), 2**7 - 1),
    st.none() | st.integers(-(2**15), 2**15 - 1),
    st.none() | st.integers(-(2**31), 2**31 - 1),
    st.none() | st.integers(-(2**63), 2**63 - 1) | st.booleans(),
    st.none() | st.floats(width=32, allow_nan=False),
    st.none() | st.floats(allow_nan=False) | st.integers(-(2**53), 2**53),
)


@given(NUMBER_ROWS, st.none() | st.text(max_size=3))
def test_numeric_structs_encode_as_field_by_field(row: tuple[Any, ...], name: str | None) -> None:
    """A tuple of exact ints/floats takes a one-call path; its bytes (also nested, also
    of values with nulls, bools or ints in float fields) are those of the field-by-field
    encoding, which a list takes."""
    flat = RowTupleSerializer(NUMBERS.json())
    nested = RowTupleSerializer(
        StructType([StructField("name", StringType()), StructField("n", NUMBERS)]).json()
    )
    for serializer, value, as_list in (
        (flat, row, list(row)),
        (nested, (name, row), [name, list(row)]),
    ):
        try:
            expected = serializer.serialize(as_list)
        except SerializationError:
            with pytest.raises(SerializationError):
                serializer.serialize(value)
            continue
        data = serializer.serialize(value)
        assert data == expected
        decoded = serializer.deserialize(data)
        assert decoded == serializer.deserialize(expected)
        assert serializer.serialize(decoded) == data


def test_no_pickle_and_compact() -> None:
    serializer = RowTupleSerializer("""{"type":"struct","fields":[
        {"name":"n","type":"long","nullable":true,"metadata":{}}]}""")
    assert serializer.serialize((7,)) == b"\x01" + (7).to_bytes(8, "big")
    assert len(serializer.serialize((None,))) == 1


@pytest.mark.parametrize(
    "value",
    [("not a number",), (1, 2), "text", (2**63,)],
)
def test_values_that_do_not_fit_are_serialization_errors(value: Any) -> None:
    serializer = RowTupleSerializer(StructType([StructField("n", LongType())]).json())
    with pytest.raises(SerializationError, match="row-tuple"):
        serializer.serialize(value)


def test_schema_is_part_of_the_identity() -> None:
    longs = RowTupleSerializer(StructType([StructField("n", LongType())]).json())
    strings = RowTupleSerializer(StructType([StructField("n", StringType())]).json())
    renamed = RowTupleSerializer(StructType([StructField("m", LongType())]).json())
    with_metadata = RowTupleSerializer(
        StructType([StructField("n", LongType(), metadata={"comment": "x"})]).json()
    )
    not_null = RowTupleSerializer(StructType([StructField("n", LongType(), False)]).json())
    assert longs.compatibility_with(longs.config()) is Compatibility.COMPATIBLE_AS_IS
    assert with_metadata.compatibility_with(longs.config()) is Compatibility.COMPATIBLE_AS_IS
    # As Spark checks a state's schema on restart: names aside, none made nullable.
    assert longs.compatibility_with(renamed.config()) is Compatibility.COMPATIBLE_AS_IS
    assert not_null.compatibility_with(longs.config()) is Compatibility.COMPATIBLE_AS_IS
    for new, other, written in ((longs, strings, "n string"), (longs, not_null, "n long not null")):
        assert new.compatibility_with(other.config()) is Compatibility.INCOMPATIBLE
        # The message shows both schemas, as a StatefulProcessor declares them.
        expected = rf"'count' was written as RowTupleSerializer\({written}\), which "
        with pytest.raises(
            IncompatibleStateError, match=expected + r"RowTupleSerializer\(n long\)"
        ):
            resolve_serializer("count", new, other.config())
    assert longs.compatibility_with(PickleSerializer().config()) is Compatibility.INCOMPATIBLE

    def nested(name: str = "a", inner: Any = None, nullable: bool = True) -> str:
        """s struct<a>, l array<struct<a>>, m map<string, struct<a>> (a: ``inner``, int)."""
        row = StructType([StructField(name, inner or IntegerType(), nullable)])
        fields = [("s", row), ("l", ArrayType(row)), ("m", MapType(StringType(), row))]
        return StructType([StructField(n, t) for n, t in fields]).json()

    stored = RowTupleSerializer(nested()).config()
    for changed, verdict in (
        (nested(name="b"), Compatibility.COMPATIBLE_AS_IS),
        (nested(nullable=False), Compatibility.COMPATIBLE_AS_IS),
        (nested(inner=LongType()), Compatibility.INCOMPATIBLE),
        (longs.schema_json, Compatibility.INCOMPATIBLE),
    ):
        assert RowTupleSerializer(changed).compatibility_with(stored) is verdict
    rebuilt = serializer_from_config(longs.config())
    assert rebuilt == longs
    assert rebuilt.deserialize(longs.serialize((3,))) == (3,)


@pytest.mark.parametrize("schema", ["not json", '{"type": "array"}', "[1]"])
def test_a_schema_that_is_not_a_struct_is_a_configuration_error(schema: str) -> None:
    with pytest.raises(ConfigurationError, match="StructType.json"):
        RowTupleSerializer(schema)


def test_unsupported_type_is_a_configuration_error() -> None:
    schema = '{"type":"struct","fields":[{"name":"v","type":"variant","nullable":true}]}'
    with pytest.raises(ConfigurationError, match="variant"):
        RowTupleSerializer(schema)


def test_decimals_keep_their_digits() -> None:
    serializer = RowTupleSerializer(StructType([StructField("d", DecimalType(10, 2))]).json())
    value = (decimal.Decimal("12.30"),)
    assert serializer.deserialize(serializer.serialize(value)) == value


@pytest.mark.parametrize(
    ("data_type", "value", "data"),
    [
        # What existing checkpoints hold for values at the type's scale (as Spark gives them).
        (DecimalType(10, 2), "12.30", b"\x01\x00\x00\x00\x0512.30"),
        (DecimalType(10, 2), "-0.05", b"\x01\x00\x00\x00\x05-0.05"),
        (DecimalType(10, 8), "1E-8", b"\x01\x00\x00\x00\x041E-8"),
        (DecimalType(10, 8), "0E-8", b"\x01\x00\x00\x00\x040E-8"),
        (DecimalType(10, 0), "42", b"\x01\x00\x00\x00\x0242"),
        (
            DecimalType(38, 18),
            "-12345678901234567890.123456789012345678",
            b"\x01\x00\x00\x00(-12345678901234567890.123456789012345678",
        ),
    ],
)
def test_decimals_at_the_scale_keep_their_bytes(
    data_type: DecimalType, value: str, data: bytes
) -> None:
    serializer = RowTupleSerializer(StructType([StructField("d", data_type)]).json())
    assert serializer.serialize((decimal.Decimal(value),)) == data
    assert serializer.deserialize(data) == (decimal.Decimal(value),)


@pytest.mark.parametrize(
    "value",
    ["1.5", "1.50", "1.234", "1.235", "-1.235", "0.005", "-0.00", 7, 0.1, "99999999.994"],
)
def test_decimals_take_the_scale_of_their_type(value: Any) -> None:
    """As Spark stores a decimal(10,2): rounded half up to 2 places, so equal values (and
    values equal once rounded) have equal bytes."""
    serializer = RowTupleSerializer(StructType([StructField("d", DecimalType(10, 2))]).json())
    expected = decimal.Decimal(value).quantize(decimal.Decimal("0.01"), decimal.ROUND_HALF_UP)
    data = serializer.serialize((decimal.Decimal(value) if isinstance(value, str) else value,))
    assert data == serializer.serialize((expected,))
    (decoded,) = serializer.deserialize(data)
    assert decoded == expected and decoded.as_tuple().exponent == -2


def test_equal_decimals_have_equal_bytes() -> None:
    serializer = RowTupleSerializer(StructType([StructField("d", DecimalType(10, 2))]).json())
    for equal in (["1.5", "1.50", "1.500", "1.504"], ["0", "0.00", "-0.00", "-0.001"]):
        assert len({serializer.serialize((decimal.Decimal(v),)) for v in equal}) == 1, equal


@pytest.mark.parametrize("value", ["99999999.995", "-123456789", "NaN", "Infinity"])
def test_decimals_beyond_the_precision_are_refused(value: str) -> None:
    serializer = RowTupleSerializer(
        StructType(
            [StructField("d", DecimalType(10, 2)), StructField("ds", ArrayType(DecimalType(10, 2)))]
        ).json()
    )
    fits = decimal.Decimal("1.00")
    for row, field in (
        ((decimal.Decimal(value), []), "d"),
        ((fits, [fits, decimal.Decimal(value)]), "ds"),
    ):
        with pytest.raises(SerializationError, match=rf"field '{field}': .* decimal\(10,2\)"):
            serializer.serialize(row)


def test_ships_to_executors_with_cloudpickle() -> None:
    """Spark pickles a serializer captured by a task (e.g. ``read_state``'s decoder) with
    cloudpickle: a numeric-only struct, packed with a ``struct.Struct``, must survive."""
    from pyspark import cloudpickle

    schema = StructType([StructField("count", LongType()), StructField("total", LongType())])
    serializer = RowTupleSerializer(schema.json())
    shipped = cloudpickle.loads(cloudpickle.dumps(serializer))
    assert shipped.config() == serializer.config()
    assert shipped.deserialize(serializer.serialize((3, 40))) == (3, 40)


def _reference_bytes(fields: list[tuple[str, Any]], row: tuple[Any, ...]) -> bytes:
    """The row-tuple bytes of ``row``, computed field by field in plain Python: a tag
    byte per field, then a number in its big-endian format or a length-prefixed string."""
    parts = []
    for (fmt, _), item in zip(fields, row, strict=True):
        if item is None:
            parts.append(b"\x00")
        elif fmt == "string":
            data = item.encode("utf-8")
            parts.append(b"\x01" + len(data).to_bytes(4, "big") + data)
        else:
            parts.append(b"\x01" + struct.pack(">" + fmt, item))
    return b"".join(parts)


INT64S = st.integers(-(2**63), 2**63 - 1)

FAST_SHAPES = {
    "one long": ([("q", LongType())], st.tuples(INT64S)),
    "two longs": ([("q", LongType()), ("q", LongType())], st.tuples(INT64S, INT64S)),
    "numbers": (
        [("b", ByteType()), ("h", ShortType()), ("i", IntegerType()), ("f", FloatType())]
        + [("d", DoubleType())],
        st.tuples(
            st.integers(-(2**7), 2**7 - 1),
            st.integers(-(2**15), 2**15 - 1),
            st.integers(-(2**31), 2**31 - 1),
            st.floats(width=32, allow_nan=False),
            st.floats(allow_nan=False),
        ),
    ),
    "one string": ([("string", StringType())], st.tuples(st.text())),
}
"""The shapes ``encoder``/``decoder`` take in one call: schema fields as (format, Spark
type) and rows of exactly their types, none null."""

NEAR_MISSES = st.sampled_from(
    [None, True, 1.5, 2**63, -(2**63) - 1, 7, "x", b"x", "\ud800", [], {}]
)
"""Field values of other types or out of range: taken by the generic path (which
converts or rejects them), never packed as they are by a fast one."""


@functools.cache
def _serializers(shape: str) -> tuple[RowTupleSerializer, RowTupleSerializer]:
    """The row-tuple serializer of a fast shape, and one of a struct holding that struct
    as its only field, whose decoding of it is the field-by-field one."""
    fields, _ = FAST_SHAPES[shape]
    schema = StructType([StructField(f"f{i}", t) for i, (_, t) in enumerate(fields)])
    wrapped = StructType([StructField("inner", schema)])
    return RowTupleSerializer(schema.json()), RowTupleSerializer(wrapped.json())


def _generic_decode(wrapper: RowTupleSerializer, data: bytes) -> tuple[Any, ...]:
    return tuple(wrapper.deserialize(b"\x01" + data)[0])


@pytest.mark.parametrize("shape", sorted(FAST_SHAPES))
@settings(deadline=None)  # a shared machine's pauses are no failure of the codec
@given(data=st.data())
def test_fast_paths_give_the_generic_bytes(shape: str, data: st.DataObject) -> None:
    """``encoder()``/``decoder()`` of the common shapes (which ``serialize`` and
    ``deserialize`` use too) give the bytes of the plain-Python reference and of the
    field-by-field path (which a list takes), and round-trip; for near misses (a field of
    another type, a null, a Row, another arity) they give what the field-by-field path
    gives, or fail where it raises SerializationError; and they decode damaged bytes
    (another tag than 1, a wrong length, bad UTF-8) as that path does."""
    from pyspark.sql import Row

    serializer, wrapper = _serializers(shape)
    encode, decode = serializer.encoder(), serializer.decoder()
    row = data.draw(FAST_SHAPES[shape][1])
    expected = _reference_bytes(FAST_SHAPES[shape][0], row)
    assert encode(row) == serializer.serialize(row) == serializer.serialize(list(row)) == expected
    assert decode(expected) == serializer.deserialize(expected) == row
    assert _generic_decode(wrapper, expected) == row
    for damaged in (
        expected[:-1],
        expected + b"\x00",
        b"\x00" + expected[1:],
        b"\x02" + expected[1:],
        expected[:-1] + b"\xff",
    ):
        _assert_decodes_as_the_generic_path(serializer, wrapper, damaged)
    position = data.draw(st.integers(0, len(row) - 1))
    near = data.draw(NEAR_MISSES)
    for other in (
        row[:position] + (near,) + row[position + 1 :],
        Row(*row),
        row + (1,),
        row[:-1],
    ):
        try:
            generic = serializer.serialize(list(other))
        except SerializationError:
            with pytest.raises(Exception):  # noqa: B017 - any error: the caller retries
                encode(other)
            with pytest.raises(SerializationError, match="row-tuple"):
                serializer.serialize(other)
            continue
        assert encode(other) == serializer.serialize(other) == generic
        assert decode(generic) == _generic_decode(wrapper, generic)


@pytest.mark.parametrize("shape", sorted(FAST_SHAPES))
@settings(deadline=None)
@given(data=st.binary(max_size=40))
def test_fast_decoders_read_any_bytes_as_the_generic_path(shape: str, data: bytes) -> None:
    """On arbitrary bytes a fast decoder gives what the field-by-field decoding gives, or
    fails where it fails (and ``deserialize`` raises SerializationError)."""
    _assert_decodes_as_the_generic_path(*_serializers(shape), data)


def _assert_decodes_as_the_generic_path(
    serializer: RowTupleSerializer, wrapper: RowTupleSerializer, data: bytes
) -> None:
    try:
        expected = _generic_decode(wrapper, data)
    except SerializationError:
        with pytest.raises(Exception):  # noqa: B017 - any error: the caller retries
            serializer.decoder()(data)
        with pytest.raises(SerializationError, match="row-tuple"):
            serializer.deserialize(data)
        return
    # By repr: damaged float bytes decode to NaN, which is not equal to itself.
    assert repr(serializer.decoder()(data)) == repr(serializer.deserialize(data)) == repr(expected)


def _fields(*fields: tuple[str, Any, bool]) -> RowTupleSerializer:
    return RowTupleSerializer(StructType([StructField(*field) for field in fields]).json())


@pytest.mark.parametrize("ttl", [False, True])
def test_fields_added_removed_or_widened_migrate_by_name(ttl: bool) -> None:
    """As Spark's Avro state encoding evolves a state's schema: a nullable field added is
    None, a field removed is dropped, a number widened keeps its value, fields match by
    name; a field added not null, another type, or no field kept is incompatible."""
    stored = _fields(("n", IntegerType(), True), ("s", StringType(), True))
    value = (7, "x")
    evolved = [
        _fields(("n", LongType(), True)),
        _fields(("s", StringType(), True), ("n", DoubleType(), True), ("m", LongType(), True)),
        _fields(("n", IntegerType(), True), ("s", StringType(), True), ("b", BinaryType(), True)),
    ]
    refused = [  # with the reason the error names
        (
            _fields(("n", IntegerType(), True), ("m", LongType(), False)),
            "field 'm' is added and not nullable",
        ),
        (_fields(("n", StringType(), True)), "field 'n' was integer and is string"),
        (_fields(("n", ShortType(), True)), "field 'n' was integer and is short"),
        (_fields(("m", LongType(), True)), "no field of it keeps its name"),
    ]
    by_name = dict(zip(["n", "s"], value, strict=True))
    wrap = TtlSerializer if ttl else (lambda serializer: serializer)
    written = wrap(stored).serialize(TtlValue(value, 5) if ttl else value)
    for new in evolved:
        expected = tuple(by_name.get(name) for name in new.field_names)
        verdict = wrap(new).compatibility_with(wrap(stored).config())
        assert verdict is Compatibility.COMPATIBLE_AFTER_MIGRATION
        reader = resolve_serializer("state", wrap(new), wrap(stored).config())
        assert reader is not None
        migrated = wrap(new).deserialize(wrap(new).serialize(reader.deserialize(written)))
        assert migrated == (TtlValue(expected, 5) if ttl else expected)
    for new, reason in refused:
        with pytest.raises(IncompatibleStateError, match=rf"written as .* \({reason}\): "):
            resolve_serializer("state", wrap(new), wrap(stored).config())
    # TTL added or removed
    for new, written, reason in (
        (TtlSerializer(stored), stored, "it was stored without a TTL"),
        (stored, TtlSerializer(stored), "it was stored with a TTL"),
    ):
        with pytest.raises(IncompatibleStateError, match=rf"written as .* \({reason}\): "):
            resolve_serializer("state", new, written.config())
