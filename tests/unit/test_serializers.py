"""Serializers: round trips, errors that name the serializer, and the compatibility matrix."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statebackend.errors import IncompatibleStateError, SerializationError
from statebackend.serializers import (
    BoolSerializer,
    BytesSerializer,
    Compatibility,
    FloatSerializer,
    IntSerializer,
    JsonSerializer,
    PickleSerializer,
    Serializer,
    StrSerializer,
    TupleSerializer,
    migrate,
    resolve_serializer,
    serializer_from_config,
)
from statebackend.state.ttl import TtlSerializer, TtlValue

AS_IS = Compatibility.COMPATIBLE_AS_IS
MIGRATE = Compatibility.COMPATIBLE_AFTER_MIGRATION
NO = Compatibility.INCOMPATIBLE

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | FINITE | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
PICKLABLE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | FINITE
    | st.text()
    | st.binary()
    | st.complex_numbers(allow_nan=False),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.frozensets(st.integers() | st.text(), max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(), children, max_size=4)
    ),
    max_leaves=20,
)


def _round_trip(serializer: Serializer[Any], value: Any) -> Any:
    data = serializer.serialize(value)
    assert isinstance(data, bytes)
    # Deterministic: equal values give equal bytes.
    assert serializer.serialize(value) == data
    return serializer.deserialize(data)


# -- round trips --------------------------------------------------------------------------


@given(st.text())
def test_str_round_trip(value: str) -> None:
    assert _round_trip(StrSerializer(), value) == value
    assert StrSerializer().serialize(value) == value.encode("utf-8")


@given(INT64)
def test_int_round_trip(value: int) -> None:
    assert _round_trip(IntSerializer(), value) == value
    assert IntSerializer().serialize(value) == struct.pack(">q", value)


@given(st.floats())
def test_float_round_trip(value: float) -> None:
    result = _round_trip(FloatSerializer(), value)
    if math.isnan(value):
        assert math.isnan(result)
    else:
        assert result == value and math.copysign(1, result) == math.copysign(1, value)


@given(st.booleans())
def test_bool_round_trip(value: bool) -> None:
    assert _round_trip(BoolSerializer(), value) is value


@given(st.binary())
def test_bytes_round_trip(value: bytes) -> None:
    assert _round_trip(BytesSerializer(), value) == value
    assert BytesSerializer().serialize(bytearray(value)) == value  # type: ignore[arg-type]


@given(JSON_VALUES)
def test_json_round_trip(value: Any) -> None:
    assert _round_trip(JsonSerializer(), value) == value


def test_json_bytes_do_not_depend_on_dict_order() -> None:
    serializer = JsonSerializer()
    assert serializer.serialize({"a": 1, "b": [1, {"y": 2, "x": 3}]}) == serializer.serialize(
        {"b": [1, {"x": 3, "y": 2}], "a": 1}
    )


@pytest.mark.parametrize(
    ("value", "instead"),
    [
        ({1: "a"}, "use str keys"),
        ({"a": [{True: 1}]}, "use str keys"),
        ((1, 2), "give a list"),
        ({"a": [1, (2,)]}, "give a list"),
    ],
)
def test_json_refuses_what_would_read_back_changed(value: Any, instead: str) -> None:
    assert json.loads(json.dumps(value)) != value  # plain JSON changes it on the way
    with pytest.raises(SerializationError, match=f"json serializer.*{instead}"):
        JsonSerializer().serialize(value)


@given(PICKLABLE)
def test_pickle_round_trip(value: Any) -> None:
    assert _round_trip(PickleSerializer(), value) == value


@given(st.tuples(st.text(), INT64, st.tuples(st.booleans(), st.binary())))
def test_tuple_round_trip(value: tuple[Any, ...]) -> None:
    serializer = TupleSerializer(
        StrSerializer(), IntSerializer(), TupleSerializer(BoolSerializer(), BytesSerializer())
    )
    assert _round_trip(serializer, value) == value


@given(st.tuples(st.text(), st.text()))
def test_tuple_fields_are_length_prefixed(value: tuple[str, str]) -> None:
    # ("ab", "") and ("a", "b") must not collide.
    serializer = TupleSerializer(StrSerializer(), StrSerializer())
    first, second = (part.encode("utf-8") for part in value)
    expected = struct.pack(">I", len(first)) + first + struct.pack(">I", len(second)) + second
    assert serializer.serialize(value) == expected


@given(PICKLABLE, INT64)
def test_ttl_round_trip(value: Any, expires_at_ms: int) -> None:
    serializer = TtlSerializer(PickleSerializer())
    result = _round_trip(serializer, TtlValue(value, expires_at_ms))
    assert result == TtlValue(value, expires_at_ms)
    assert isinstance(result, TtlValue)


@given(INT64, INT64)
def test_ttl_bytes_are_expiry_then_inner(value: int, expires_at_ms: int) -> None:
    data = TtlSerializer(IntSerializer()).serialize(TtlValue(value, expires_at_ms))
    assert data == struct.pack(">q", expires_at_ms) + struct.pack(">q", value)


# -- errors -------------------------------------------------------------------------------

_UNENCODABLE: list[tuple[Serializer[Any], Any, str]] = [
    (StrSerializer(), 1, "str"),
    (StrSerializer(), b"bytes", "str"),
    (IntSerializer(), "1", "int"),
    (IntSerializer(), 1.5, "int"),
    (IntSerializer(), True, "int"),
    (IntSerializer(), 2**63, "int"),
    (IntSerializer(), -(2**63) - 1, "int"),
    (FloatSerializer(), "1.0", "float"),
    (FloatSerializer(), False, "float"),
    (BoolSerializer(), 1, "bool"),
    (BytesSerializer(), "text", "bytes"),
    (JsonSerializer(), {1, 2}, "json"),
    (JsonSerializer(), float("nan"), "json"),
    (JsonSerializer(), object(), "json"),
    (PickleSerializer(), lambda: None, "pickle"),
    (TupleSerializer(StrSerializer(), IntSerializer()), ("a",), "tuple"),
    (TupleSerializer(StrSerializer(), IntSerializer()), ["a", 1], "tuple"),
    (TupleSerializer(StrSerializer(), IntSerializer()), ("a", "b"), "int"),
    (TtlSerializer(IntSerializer()), TtlValue("x", 0), "int"),
    (TtlSerializer(IntSerializer()), 5, "ttl"),
]


@pytest.mark.parametrize(("serializer", "value", "named"), _UNENCODABLE)
def test_unencodable_value_raises_serialization_error_naming_the_serializer(
    serializer: Serializer[Any], value: Any, named: str
) -> None:
    with pytest.raises(SerializationError) as info:
        serializer.serialize(value)
    assert f"{named} serializer" in str(info.value)


@pytest.mark.parametrize(
    ("serializer", "data"),
    [
        (IntSerializer(), b"\x00\x01"),
        (FloatSerializer(), b"123"),
        (BoolSerializer(), b"\x02"),
        (StrSerializer(), b"\xff\xfe"),
        (JsonSerializer(), b"{not json"),
        (PickleSerializer(), b"not a pickle"),
        (TupleSerializer(IntSerializer()), struct.pack(">I", 8) + b"\x00" * 9),
        (TtlSerializer(IntSerializer()), b"\x00\x01"),
    ],
)
def test_undecodable_bytes_raise_serialization_error_naming_the_serializer(
    serializer: Serializer[Any], data: bytes
) -> None:
    with pytest.raises(SerializationError) as info:
        serializer.deserialize(data)
    assert f"{serializer.identity} serializer" in str(info.value)


@pytest.mark.parametrize(("serializer", "value", "named"), _UNENCODABLE)
def test_encoder_fails_where_serialize_raises(
    serializer: Serializer[Any], value: Any, named: str
) -> None:
    """The unwrapped ``encoder()`` that hot paths call raises too (any error: they then
    call ``serialize`` for the SerializationError)."""
    with pytest.raises(Exception):  # noqa: B017
        serializer.encoder()(value)


@given(st.one_of(INT64, st.integers(), st.booleans(), FINITE, st.text(), st.binary()))
def test_encoder_and_decoder_match_serialize_and_deserialize(value: Any) -> None:
    """For every value, ``encoder()`` gives ``serialize``'s bytes or fails where it
    raises, and ``decoder()`` reads them back as ``deserialize`` does."""
    for serializer in (IntSerializer(), StrSerializer(), FloatSerializer(), BytesSerializer()):
        try:
            expected = serializer.serialize(value)
        except SerializationError:
            with pytest.raises(Exception):  # noqa: B017
                serializer.encoder()(value)
            continue
        assert serializer.encoder()(value) == expected
        assert serializer.decoder()(expected) == serializer.deserialize(expected)


def test_tuple_serializer_needs_fields() -> None:
    with pytest.raises(ValueError):
        TupleSerializer()


# -- compatibility ------------------------------------------------------------------------

_ALL_PLAIN: list[Serializer[Any]] = [
    StrSerializer(),
    IntSerializer(),
    FloatSerializer(),
    BoolSerializer(),
    BytesSerializer(),
    JsonSerializer(),
    PickleSerializer(),
]

_S, _I, _F, _J = StrSerializer(), IntSerializer(), FloatSerializer(), JsonSerializer()
_T = TupleSerializer

# (new serializer, serializer that wrote the stored state, expected verdict), from the
# documented rules: same config as is; float takes over int; json takes over str, int,
# float, bool; pickle takes over anything but a TTL envelope; tuples field by field;
# TTL and non-TTL never mix.
_MATRIX: list[tuple[Serializer[Any], Serializer[Any], Compatibility]] = [
    *[(s, type(s)(), AS_IS) for s in _ALL_PLAIN],
    (FloatSerializer(), IntSerializer(), MIGRATE),
    (JsonSerializer(), StrSerializer(), MIGRATE),
    (JsonSerializer(), IntSerializer(), MIGRATE),
    (JsonSerializer(), FloatSerializer(), MIGRATE),
    (JsonSerializer(), BoolSerializer(), MIGRATE),
    *[(PickleSerializer(), s, MIGRATE) for s in _ALL_PLAIN if s.identity != "pickle"],
    (PickleSerializer(), TupleSerializer(IntSerializer()), MIGRATE),
    (StrSerializer(), IntSerializer(), NO),
    (IntSerializer(), StrSerializer(), NO),
    (IntSerializer(), FloatSerializer(), NO),
    (IntSerializer(), BoolSerializer(), NO),
    (BytesSerializer(), StrSerializer(), NO),
    (StrSerializer(), JsonSerializer(), NO),
    (IntSerializer(), PickleSerializer(), NO),
    (JsonSerializer(), BytesSerializer(), NO),
    (JsonSerializer(), PickleSerializer(), NO),
    # tuples, field-wise
    (_T(_S, _I), _T(_S, _I), AS_IS),
    (_T(_S, _F), _T(_S, _I), MIGRATE),
    (_T(_J, _F), _T(_S, _I), MIGRATE),
    (_T(_I, _I), _T(_S, _I), NO),
    (_T(_S, _F), _T(_I, _I), NO),
    (TupleSerializer(StrSerializer()), TupleSerializer(StrSerializer(), IntSerializer()), NO),
    (TupleSerializer(StrSerializer(), IntSerializer()), TupleSerializer(StrSerializer()), NO),
    (TupleSerializer(IntSerializer()), IntSerializer(), NO),
    (IntSerializer(), TupleSerializer(IntSerializer()), NO),
    # TTL
    (TtlSerializer(IntSerializer()), TtlSerializer(IntSerializer()), AS_IS),
    (TtlSerializer(FloatSerializer()), TtlSerializer(IntSerializer()), MIGRATE),
    (TtlSerializer(PickleSerializer()), TtlSerializer(StrSerializer()), MIGRATE),
    (TtlSerializer(IntSerializer()), TtlSerializer(StrSerializer()), NO),
    (TtlSerializer(IntSerializer()), IntSerializer(), NO),
    (TtlSerializer(PickleSerializer()), PickleSerializer(), NO),
    (IntSerializer(), TtlSerializer(IntSerializer()), NO),
    (PickleSerializer(), TtlSerializer(PickleSerializer()), NO),
    (PickleSerializer(), TtlSerializer(IntSerializer()), NO),
    (JsonSerializer(), TtlSerializer(StrSerializer()), NO),
]


@pytest.mark.parametrize(
    ("new", "stored", "expected"),
    _MATRIX,
    ids=[f"{n!r}<-{s!r}" for n, s, _ in _MATRIX],
)
def test_compatibility_matrix(
    new: Serializer[Any], stored: Serializer[Any], expected: Compatibility
) -> None:
    # The stored config goes through JSON as it does in a snapshot's metadata.
    stored_config = json.loads(json.dumps(stored.config()))
    assert new.compatibility_with(stored_config) is expected


def test_versions_and_unknown_identities() -> None:
    assert IntSerializer().compatibility_with({"identity": "int", "version": 0}) is MIGRATE
    assert IntSerializer().compatibility_with({"identity": "int", "version": 2}) is NO
    assert IntSerializer().compatibility_with({"identity": "int"}) is MIGRATE
    assert PickleSerializer().compatibility_with({"identity": "avro", "version": 1}) is NO
    assert JsonSerializer().compatibility_with({}) is NO


_MIGRATIONS: list[tuple[Serializer[Any], Serializer[Any], Any, Any]] = [
    (IntSerializer(), FloatSerializer(), 7, 7.0),
    (IntSerializer(), FloatSerializer(), -(2**40), float(-(2**40))),
    (StrSerializer(), JsonSerializer(), "héllo", "héllo"),
    (IntSerializer(), JsonSerializer(), 42, 42),
    (FloatSerializer(), JsonSerializer(), 2.5, 2.5),
    (BoolSerializer(), JsonSerializer(), True, True),
    (StrSerializer(), PickleSerializer(), "x", "x"),
    (BytesSerializer(), PickleSerializer(), b"\x00\x01", b"\x00\x01"),
    (JsonSerializer(), PickleSerializer(), {"a": [1, 2]}, {"a": [1, 2]}),
    (
        TupleSerializer(StrSerializer(), IntSerializer()),
        TupleSerializer(JsonSerializer(), FloatSerializer()),
        ("k", 3),
        ("k", 3.0),
    ),
    (TupleSerializer(StrSerializer(), IntSerializer()), PickleSerializer(), ("k", 3), ("k", 3)),
    (
        TtlSerializer(IntSerializer()),
        TtlSerializer(FloatSerializer()),
        TtlValue(5, 1234),
        TtlValue(5.0, 1234),
    ),
]


@pytest.mark.parametrize(("old", "new", "value", "expected"), _MIGRATIONS)
def test_migration_rewrites_bytes_for_the_new_serializer(
    old: Serializer[Any], new: Serializer[Any], value: Any, expected: Any
) -> None:
    resolved = resolve_serializer("s", new, json.loads(json.dumps(old.config())))
    assert resolved == old
    assert resolved is not None
    migrated = migrate(old.serialize(value), resolved, new)
    assert migrated == new.serialize(expected)
    result = new.deserialize(migrated)
    assert result == expected and type(result) is type(expected)


# -- configs and resolve ----------------------------------------------------------------------

_CONFIGURED: list[Serializer[Any]] = [
    *_ALL_PLAIN,
    TupleSerializer(StrSerializer(), IntSerializer()),
    TupleSerializer(TupleSerializer(BoolSerializer()), PickleSerializer()),
    TtlSerializer(IntSerializer()),
    TtlSerializer(TupleSerializer(FloatSerializer(), JsonSerializer())),
]


@pytest.mark.parametrize("serializer", _CONFIGURED, ids=repr)
def test_serializer_from_config_round_trip(serializer: Serializer[Any]) -> None:
    config = json.loads(json.dumps(serializer.config()))
    rebuilt = serializer_from_config(config)
    assert type(rebuilt) is type(serializer)
    assert rebuilt == serializer
    assert hash(rebuilt) == hash(serializer)
    assert rebuilt.config() == serializer.config()
    assert rebuilt.compatibility_with(serializer.config()) is AS_IS
    assert resolve_serializer("s", rebuilt, config) is None


def test_serializer_from_config_rejects_unknown_identity() -> None:
    with pytest.raises(IncompatibleStateError, match="avro"):
        serializer_from_config({"identity": "avro", "version": 1})
    with pytest.raises(IncompatibleStateError):
        serializer_from_config(
            {"identity": "tuple", "version": 1, "fields": [{"identity": "nope", "version": 1}]}
        )


def test_configs_name_identity_and_version() -> None:
    assert IntSerializer().config() == {"identity": "int", "version": 1}
    assert TupleSerializer(StrSerializer()).config() == {
        "identity": "tuple",
        "version": 1,
        "fields": [{"identity": "str", "version": 1}],
    }
    assert TtlSerializer(IntSerializer()).config() == {
        "identity": "ttl",
        "version": 1,
        "inner": {"identity": "int", "version": 1},
    }
    assert TupleSerializer(StrSerializer()) != TupleSerializer(IntSerializer())
    assert IntSerializer() != FloatSerializer()


@pytest.mark.parametrize(
    ("new", "stored"),
    [
        (IntSerializer(), StrSerializer()),
        (TtlSerializer(IntSerializer()), IntSerializer()),
        (PickleSerializer(), TtlSerializer(IntSerializer())),
        (TupleSerializer(IntSerializer()), TupleSerializer(StrSerializer())),
    ],
)
def test_resolve_serializer_names_the_state_when_incompatible(
    new: Serializer[Any], stored: Serializer[Any]
) -> None:
    with pytest.raises(IncompatibleStateError) as info:
        resolve_serializer("word-counts", new, stored.config())
    assert "'word-counts'" in str(info.value)
