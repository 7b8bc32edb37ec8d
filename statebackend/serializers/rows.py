"""``RowTupleSerializer``: tuples of a Spark schema's fields (StructType JSON), encoded field
by field, as transform_with_state keeps keys and state values."""

from __future__ import annotations

import calendar
import datetime
import decimal
import functools
import json
import numbers
import re
import struct
import time
from collections.abc import Callable, Iterable
from types import CodeType
from typing import Any, cast

from statebackend.errors import ConfigurationError
from statebackend.serializers.base import (
    LENGTH_PREFIX,
    Compatibility,
    Serializer,
    SerializerConfig,
    describe_value,
)

_Encoder = Callable[[Any, list[bytes]], None]
_Decoder = Callable[[memoryview, int], tuple[Any, int]]
_EPOCH_DATE = datetime.date(1970, 1, 1)
_FIXED_WIDTH_INTS = {"byte": "b", "short": "h", "integer": "i", "long": "q"}


def _fixed(fmt: str, convert: Callable[[Any], Any]) -> tuple[_Encoder, _Decoder]:
    packer = struct.Struct(">" + fmt)

    def encode(value: Any, out: list[bytes]) -> None:
        out.append(packer.pack(convert(value)))

    def decode(view: memoryview, position: int) -> tuple[Any, int]:
        return packer.unpack_from(view, position)[0], position + packer.size

    return encode, decode


def _integral(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{describe_value(value)} is not an integer")
    return int(value)


def _real(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{describe_value(value)} is not a number")
    return float(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{describe_value(value)} is not a bool")
    return value


def _sized(
    to_bytes: Callable[[Any], bytes], from_bytes: Callable[[bytes], Any]
) -> tuple[_Encoder, _Decoder]:
    def encode(value: Any, out: list[bytes]) -> None:
        data = to_bytes(value)
        out.append(LENGTH_PREFIX.pack(len(data)))
        out.append(data)

    def decode(view: memoryview, position: int) -> tuple[Any, int]:
        (length,) = LENGTH_PREFIX.unpack_from(view, position)
        start = position + LENGTH_PREFIX.size
        return from_bytes(bytes(view[start : start + length])), start + length

    return encode, decode


def _utf8(value: Any) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{describe_value(value)} is not a str")
    return value.encode("utf-8")


def _binary(value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{describe_value(value)} is not bytes")
    return bytes(value)


def _days(value: Any) -> int:
    if isinstance(value, datetime.datetime) or not isinstance(value, datetime.date):
        raise TypeError(f"{describe_value(value)} is not a datetime.date")
    return (value - _EPOCH_DATE).days


def _micros(value: Any) -> int:
    """Spark's internal timestamp: microseconds since the epoch (naive = local time)."""
    if not isinstance(value, datetime.datetime):
        raise TypeError(f"{describe_value(value)} is not a datetime.datetime")
    seconds = (
        calendar.timegm(value.utctimetuple()) if value.tzinfo else time.mktime(value.timetuple())
    )
    return int(seconds) * 1_000_000 + value.microsecond


def _from_micros(micros: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(micros // 1_000_000).replace(
        microsecond=micros % 1_000_000
    )


_DECIMAL_TYPE = re.compile(r"decimal(?:\((\d+),\s*(\d+)\))?")
"""Spark's decimal type in JSON form: ``decimal(precision,scale)``, or ``decimal`` alone
for Spark's default ``decimal(10,0)``."""


class _DoesNotFit(ValueError):
    """A value its field's type cannot hold (named by the struct)."""


def _decimal_codec(data_type: str) -> tuple[_Encoder, _Decoder]:
    """A decimal as the text of its value at the type's scale, rounded half up as Spark
    rounds; a value with more than ``precision`` digits there is refused (``_DoesNotFit``).
    A value already at the scale keeps the bytes it had before values were rounded."""
    match = _DECIMAL_TYPE.fullmatch(data_type)
    if match is None:
        raise ConfigurationError(
            f"Spark type {data_type!r} is not a decimal(precision,scale): give its JSON form"
        )
    precision, scale = (int(match[1]), int(match[2])) if match[1] else (10, 0)
    if not 0 <= scale <= precision:
        raise ConfigurationError(
            f"Spark type {data_type!r} has a scale outside 0..precision: fix the schema"
        )
    exponent = decimal.Decimal(1).scaleb(-scale)
    # quantize signals InvalidOperation when the result needs more than `prec` digits.
    context = decimal.Context(prec=precision, rounding=decimal.ROUND_HALF_UP)

    def to_text(value: Any) -> bytes:
        number = decimal.Decimal(value)
        try:
            scaled = number.quantize(exponent, context=context)
        except decimal.InvalidOperation:
            scaled = None
        if scaled is None or not scaled.is_finite():
            raise _DoesNotFit(
                f"{describe_value(value)} does not fit {data_type}: give a finite value with "
                f"at most {precision - scale} digits before the point, or widen the type"
            )
        return str(scaled.copy_abs() if scaled.is_zero() else scaled).encode("ascii")

    return _sized(to_text, lambda data: decimal.Decimal(data.decode("ascii")))


def _ntz_micros(value: Any) -> int:
    if not isinstance(value, datetime.datetime) or value.tzinfo is not None:
        raise TypeError(f"{describe_value(value)} is not a naive datetime.datetime")
    return (value - datetime.datetime(1970, 1, 1)) // datetime.timedelta(microseconds=1)


StructOf = Callable[[list[str]], Callable[[list[Any]], Any]]
"""Given a nested struct's field names, what makes its decoded value of its field values
(e.g. a pyspark ``Row``); without one a nested struct decodes to a tuple."""


def _field_codec(
    data_type: Any, struct_of: StructOf | None = None, in_key: bool = False
) -> tuple[_Encoder, _Decoder]:
    """Encoder and decoder of one value of a Spark data type (JSON form), without nulls;
    nested structs decode through ``struct_of`` if given. ``in_key``: the value is (part
    of) a map key, so arrays decode to tuples, which a dict key must be to be hashable."""
    if isinstance(data_type, dict):
        kind = data_type.get("type")
        if kind == "struct":
            return _struct_codec(data_type, struct_of, nested=True, in_key=in_key)
        if kind == "array":
            return _array_codec(data_type["elementType"], struct_of, in_key)
        if kind == "map":
            return _map_codec(data_type["keyType"], data_type["valueType"], struct_of)
        raise ConfigurationError(f"Spark type {data_type} has no row-tuple encoding")
    if data_type in _FIXED_WIDTH_INTS:
        return _fixed(_FIXED_WIDTH_INTS[data_type], _integral)
    if data_type == "double":
        return _fixed("d", _real)
    if data_type == "float":
        return _fixed("f", _real)
    if data_type == "boolean":
        return _fixed("?", _boolean)
    if data_type == "string":
        return _sized(_utf8, lambda data: data.decode("utf-8"))
    if data_type == "binary":
        return _sized(_binary, bytes)
    if data_type == "date":
        encode, decode_days = _fixed("i", _days)
        return encode, _mapped(decode_days, lambda days: _EPOCH_DATE + datetime.timedelta(days))
    if data_type == "timestamp":
        encode, decode_micros = _fixed("q", _micros)
        return encode, _mapped(decode_micros, _from_micros)
    if data_type == "timestamp_ntz":
        encode, decode_micros = _fixed("q", _ntz_micros)
        return encode, _mapped(
            decode_micros,
            lambda us: datetime.datetime(1970, 1, 1) + datetime.timedelta(microseconds=us),
        )
    if isinstance(data_type, str) and data_type.startswith("decimal"):
        return _decimal_codec(data_type)
    raise ConfigurationError(
        f"Spark type {data_type!r} has no row-tuple encoding: use a supported type "
        f"(numbers, boolean, string, binary, date, timestamp, decimal, struct, array, map)"
    )


def _mapped(decode: _Decoder, convert: Callable[[Any], Any]) -> _Decoder:
    def mapped(view: memoryview, position: int) -> tuple[Any, int]:
        value, position = decode(view, position)
        return convert(value), position

    return mapped


class _NotNullable(TypeError):
    """None given for a field its schema declares not nullable (named by the struct)."""


def _nullable(codec: tuple[_Encoder, _Decoder], nullable: bool = True) -> tuple[_Encoder, _Decoder]:
    """One tag byte (0 = null, 1 = a value) before the value; a field that is not
    ``nullable`` has the same bytes but refuses to encode None."""
    inner_encode, inner_decode = codec

    def encode(value: Any, out: list[bytes]) -> None:
        if value is None:
            if not nullable:
                raise _NotNullable
            out.append(b"\x00")
        else:
            out.append(b"\x01")
            inner_encode(value, out)

    def decode(view: memoryview, position: int) -> tuple[Any, int]:
        if view[position] == 0:
            return None, position + 1
        return inner_decode(view, position + 1)

    return encode, decode


_FLAT_FIELDS = {
    **{name: (fmt, int) for name, fmt in _FIXED_WIDTH_INTS.items()},
    "double": ("d", float),
    "float": ("f", float),
}
"""Fixed-width number types: format character and the Python type packed as it is."""


def _flat_struct(fields: list[dict[str, Any]]) -> tuple[struct.Struct, tuple[type, ...]] | None:
    """For a struct of fixed-width numbers only: one ``Struct`` packing every field with
    its not-null tag, and the exact Python type of each field it takes; else None."""
    if not fields or not all(
        isinstance(field["type"], str) and field["type"] in _FLAT_FIELDS for field in fields
    ):
        return None
    kinds = [_FLAT_FIELDS[field["type"]] for field in fields]
    return struct.Struct(">" + "".join("B" + fmt for fmt, _ in kinds)), tuple(
        kind for _, kind in kinds
    )


@functools.cache
def _flat_encoder_code(arity: int) -> CodeType:
    """The compiled source of ``_flat_encoder``'s function for structs of ``arity``
    fields (compiled once per arity: it names no types, only positions)."""
    names = [f"v{i}" for i in range(arity)]
    source = (
        "def encode(value):\n"
        f"    if type(value) is tuple and len(value) == {arity}:\n"
        f"        {', '.join(names)}, = value\n"
        f"        if {' and '.join(f'type({n}) is t{n}' for n in names)}:\n"
        f"            return pack({', '.join(f'1, {n}' for n in names)})\n"
        "    return fallback(value)\n"
    )
    return compile(source, f"<flat struct encoder of {arity} fields>", "exec")


def _flat_encoder(
    packer: struct.Struct, flat_types: tuple[type, ...], fallback: Callable[[Any], bytes]
) -> Callable[[Any], bytes]:
    """The bytes of a flat struct (``_flat_struct``) in one ``packer.pack`` call for a
    tuple of exactly ``flat_types``, else ``fallback(value)`` (nulls, lists, dicts, Rows,
    ints for floats, errors).

    Generated code, as ``collections.namedtuple`` generates its methods: a call with its
    arguments spelled out (``pack(1, v0, 1, v1)``) is about three times faster than one
    building them per value, and this is the hot path of numeric keys and values. Only
    field positions go into the source; the types and functions come in by name."""
    namespace: dict[str, Any] = {"pack": packer.pack, "fallback": fallback}
    namespace.update((f"tv{i}", kind) for i, kind in enumerate(flat_types))
    exec(_flat_encoder_code(len(flat_types)), namespace)
    return cast(Callable[[Any], bytes], namespace["encode"])


def _flat_decoder(
    packer: struct.Struct, flat_types: tuple[type, ...], fallback: Callable[[bytes], Any]
) -> Callable[[bytes], Any]:
    """The tuple of a flat struct's bytes in one ``unpack`` call when they are exactly
    its fields, none null; else ``fallback(data)``."""
    unpack, size, tags = packer.unpack, packer.size, (1,) * len(flat_types)

    def decode(data: bytes) -> Any:
        if len(data) == size:
            unpacked = unpack(data)
            if unpacked[0::2] == tags:
                return unpacked[1::2]
        return fallback(data)

    return decode


_TAG_LENGTH = struct.Struct(">BI")
"""A not-null tag then a length prefix, packed in one call."""


def _one_string_codec(
    fallback_encode: Callable[[Any], bytes], fallback_decode: Callable[[bytes], Any]
) -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
    """The bytes of a struct of one string field (a string key) and back, in one call
    each for a 1-tuple of a str; anything else through the fallbacks."""

    def encode(value: Any) -> bytes:
        if type(value) is tuple and len(value) == 1:
            text = value[0]
            if type(text) is str:
                data = text.encode()
                return _TAG_LENGTH.pack(1, len(data)) + data
        return fallback_encode(value)

    def decode(data: bytes) -> Any:
        if (
            len(data) >= _TAG_LENGTH.size
            and data[0] == 1
            and _TAG_LENGTH.unpack_from(data)[1] == len(data) - _TAG_LENGTH.size
        ):
            return (str(data[_TAG_LENGTH.size :], "utf-8"),)
        return fallback_decode(data)

    return encode, decode


def _struct_codec(
    struct_type: dict[str, Any],
    struct_of: StructOf | None = None,
    nested: bool = False,
    in_key: bool = False,
) -> tuple[_Encoder, _Decoder]:
    fields = struct_type.get("fields", [])
    names = [field["name"] for field in fields]
    codecs = [
        _nullable(
            _field_codec(field["type"], struct_of, in_key), field.get("nullable", True) is not False
        )
        for field in fields
    ]
    flat = _flat_struct(fields)
    tags = (1,) * len(fields)
    make = struct_of(names) if nested and struct_of is not None else None

    def encode_fields(value: Any, out: list[bytes]) -> None:
        if isinstance(value, dict):
            value = tuple(value.get(name) for name in names)
        if not isinstance(value, (tuple, list)) or len(value) != len(codecs):
            raise TypeError(
                f"{describe_value(value)} is not a tuple of {len(codecs)} fields {names}"
            )
        for (field_encode, _), item, name in zip(codecs, value, names, strict=True):
            try:
                field_encode(item, out)
            except _NotNullable:
                raise TypeError(f"field {name!r} is not nullable: it cannot be None") from None
            except _DoesNotFit as exc:
                raise TypeError(f"field {name!r}: {exc}") from None

    def decode_fields(view: memoryview, position: int) -> tuple[Any, int]:
        if flat is not None and len(view) - position >= flat[0].size:
            unpacked = flat[0].unpack_from(view, position)
            if unpacked[0::2] == tags:
                return unpacked[1::2], position + flat[0].size
        items = []
        for _, field_decode in codecs:
            item, position = field_decode(view, position)
            items.append(item)
        return tuple(items), position

    decode = decode_fields if make is None else _mapped(decode_fields, make)
    if flat is None:
        return encode_fields, decode

    def fields_bytes(value: Any) -> bytes:
        parts: list[bytes] = []
        encode_fields(value, parts)
        return b"".join(parts)

    flat_bytes = _flat_encoder(*flat, fields_bytes)

    def encode(value: Any, out: list[bytes]) -> None:
        out.append(flat_bytes(value))

    return encode, decode


def _struct_bytes_codec(
    struct_type: dict[str, Any],
    prepare: Callable[[Any], Any] | None = None,
    struct_of: StructOf | None = None,
) -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
    """The bytes of a whole struct value and back (``RowTupleSerializer``'s), with one-call
    fast paths for the common shapes of keys and values: every field a fixed-width
    number, or one string field. ``prepare`` (if given) turns a value into what is
    encoded, on every path but the fast ones, whose values it must leave as they are;
    nested structs decode through ``struct_of`` (if given)."""
    encode_struct, decode_struct = _struct_codec(struct_type, struct_of)

    def to_bytes(value: Any) -> bytes:
        parts: list[bytes] = []
        encode_struct(value if prepare is None else prepare(value), parts)
        return b"".join(parts)

    def from_bytes(data: bytes) -> tuple[Any, ...]:
        view = memoryview(data)
        value, position = decode_struct(view, 0)
        if position != len(view):
            raise ValueError("trailing bytes after the last field")
        return tuple(value)

    fields = struct_type.get("fields", [])
    flat = _flat_struct(fields)
    if flat is not None:
        return _flat_encoder(*flat, to_bytes), _flat_decoder(*flat, from_bytes)
    if [field["type"] for field in fields] == ["string"]:
        return _one_string_codec(to_bytes, from_bytes)
    return to_bytes, from_bytes


def _array_codec(
    element_type: Any, struct_of: StructOf | None, in_key: bool
) -> tuple[_Encoder, _Decoder]:
    """An array as its length then its elements; decoded as a list, or as a tuple
    ``in_key`` (``_field_codec``)."""
    element_encode, element_decode = _nullable(_field_codec(element_type, struct_of, in_key))

    def encode(value: Any, out: list[bytes]) -> None:
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
            raise TypeError(f"{describe_value(value)} is not a list")
        items = list(value)
        out.append(LENGTH_PREFIX.pack(len(items)))
        for item in items:
            element_encode(item, out)

    def decode(view: memoryview, position: int) -> tuple[Any, int]:
        (count,) = LENGTH_PREFIX.unpack_from(view, position)
        position += LENGTH_PREFIX.size
        items = []
        for _ in range(count):
            item, position = element_decode(view, position)
            items.append(item)
        return (tuple(items) if in_key else items), position

    return encode, decode


def _map_codec(
    key_type: Any, value_type: Any, struct_of: StructOf | None
) -> tuple[_Encoder, _Decoder]:
    key_encode, key_decode = _field_codec(key_type, struct_of, in_key=True)
    value_encode, value_decode = _nullable(_field_codec(value_type, struct_of))

    def encode(value: Any, out: list[bytes]) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"{describe_value(value)} is not a dict")
        out.append(LENGTH_PREFIX.pack(len(value)))
        # Sorted by encoded key, so that equal maps have equal bytes.
        entries = []
        for key, item in value.items():
            key_parts: list[bytes] = []
            key_encode(key, key_parts)
            entries.append((b"".join(key_parts), item))
        for key_bytes, item in sorted(entries, key=lambda entry: entry[0]):
            out.append(key_bytes)
            value_encode(item, out)

    def decode(view: memoryview, position: int) -> tuple[Any, int]:
        (count,) = LENGTH_PREFIX.unpack_from(view, position)
        position += LENGTH_PREFIX.size
        result = {}
        for _ in range(count):
            key, position = key_decode(view, position)
            result[key], position = value_decode(view, position)
        return result, position

    return encode, decode


def _parse_struct(schema_json: str) -> dict[str, Any]:
    try:
        schema = json.loads(schema_json)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"row-tuple schema {describe_value(schema_json)} is not JSON: give StructType.json()"
        ) from exc
    if not isinstance(schema, dict) or schema.get("type") != "struct":
        raise ConfigurationError(
            f"row-tuple schema {describe_value(schema_json)} is not a struct: "
            "give StructType.json()"
        )
    return schema


def _schema_identity(schema: dict[str, Any]) -> list[Any]:
    """What decides the bytes: field names, types and nullability (not field metadata)."""

    def of_type(data_type: Any) -> Any:
        if not isinstance(data_type, dict):
            return data_type
        if data_type.get("type") == "struct":
            return {"struct": _schema_identity(data_type)}
        if data_type.get("type") == "array":
            return {"array": of_type(data_type["elementType"])}
        if data_type.get("type") == "map":
            return {"map": [of_type(data_type["keyType"]), of_type(data_type["valueType"])]}
        return data_type

    return [
        [field["name"], of_type(field["type"]), bool(field.get("nullable", True))]
        for field in schema.get("fields", [])
    ]


def _fields_read_as(stored: Any, new: list[Any]) -> bool:
    """Whether values stored with the ``_schema_identity`` ``stored`` read as ``new``'s: the
    same types field by field, whatever the names, and no field nullable that was stored not
    null. Spark checks a state's schema so on restart, as its rows are positional; the bytes
    hold neither names nor nullability."""
    if not isinstance(stored, list) or len(stored) != len(new):
        return False
    for old_field, (_, new_type, new_nullable) in zip(stored, new, strict=True):
        if not isinstance(old_field, list) or len(old_field) != 3:
            return False
        _, old_type, old_nullable = old_field
        if (new_nullable and not old_nullable) or not _type_reads_as(old_type, new_type):
            return False
    return True


def _type_reads_as(stored: Any, new: Any) -> bool:
    """``_fields_read_as`` for one field's type (nested structs by the same rule)."""
    if isinstance(stored, dict) and isinstance(new, dict) and stored.keys() == new.keys():
        if "struct" in new:
            return _fields_read_as(stored["struct"], new["struct"])
        if "array" in new:
            return _type_reads_as(stored["array"], new["array"])
        if "map" in new:
            pairs = stored["map"], new["map"]
            return len(pairs[0]) == 2 and all(map(_type_reads_as, *pairs))
    return bool(stored == new)


_WIDER = {
    "byte": ("short", "integer", "long", "float", "double"),
    "short": ("integer", "long", "float", "double"),
    "integer": ("long", "float", "double"),
    "long": ("float", "double"),
    "float": ("double",),
}
"""The number types each one widens to, as Avro promotes them."""


def _evolution(stored: Any, new: list[Any]) -> list[int | None] | None:
    """How values stored with the ``_schema_identity`` ``stored`` evolve to ``new``'s, by
    field name, as Spark's transformWithState evolves them with Avro state encoding: for
    each new field, the stored field of its name (its type read as ``_type_reads_as``, or
    a number widened), or None for a nullable field the values lack; stored fields
    missing from ``new`` are dropped. None if they cannot evolve so, or if no field is
    kept (that replaces the values with nulls, which Avro would do silently)."""
    if not isinstance(stored, list) or not all(
        isinstance(field, list) and len(field) == 3 for field in stored
    ):
        return None
    positions = {field[0]: position for position, field in enumerate(stored)}
    evolution: list[int | None] = []
    for name, new_type, new_nullable in new:
        position = positions.get(name)
        if position is None:
            if not new_nullable:
                return None
            evolution.append(None)
            continue
        _, old_type, old_nullable = stored[position]
        if (new_nullable and not old_nullable) or not _evolves(old_type, new_type):
            return None
        evolution.append(position)
    return evolution if any(position is not None for position in evolution) else None


def _evolves(stored: Any, new: Any) -> bool:
    """Whether a field's stored type reads as (``_type_reads_as``) or widens to ``new``."""
    widened = isinstance(stored, str) and new in _WIDER.get(stored, ())
    return widened or _type_reads_as(stored, new)


def _refusal(stored: Any, new: list[Any]) -> str | None:
    """Why values stored with the ``_schema_identity`` ``stored`` cannot evolve to ``new``'s
    (``_evolution``), naming the first field at fault; None if not known."""
    if not isinstance(stored, list):
        return None
    by_name = {field[0]: field for field in stored if isinstance(field, list) and len(field) == 3}
    for name, new_type, new_nullable in new:
        if name not in by_name:
            if not new_nullable:
                return f"field {name!r} is added and not nullable"
            continue
        _, old_type, old_nullable = by_name[name]
        if new_nullable and not old_nullable:
            return f"field {name!r} was not null and is nullable"
        if not _evolves(old_type, new_type):
            return f"field {name!r} was {_type_text(old_type)} and is {_type_text(new_type)}"
    if not any(name in by_name for name, _, _ in new):
        return "no field of it keeps its name"
    return None


def _type_text(data_type: Any) -> str:
    """A type of a ``_schema_identity`` as DDL-like text: ``struct<sum long>``."""
    if not isinstance(data_type, dict):
        return str(data_type)
    if "struct" in data_type:
        return f"struct<{_fields_text(data_type['struct'])}>"
    if "array" in data_type:
        return f"array<{_type_text(data_type['array'])}>"
    if "map" in data_type:
        key, value = data_type["map"]
        return f"map<{_type_text(key)}, {_type_text(value)}>"
    return json.dumps(data_type)


def _fields_text(identity: list[Any]) -> str:
    """A ``_schema_identity`` as DDL-like text: ``count long, totals struct<sum long>``."""
    return ", ".join(
        f"{name} {_type_text(data_type)}{'' if nullable else ' not null'}"
        for name, data_type, nullable in identity
    )


def _decodes_immutable(data_type: Any) -> bool:
    """Whether the row-tuple decoding of a Spark data type (JSON form) is immutable: every
    type but arrays (lists) and maps (dicts), structs if all their fields are."""
    if not isinstance(data_type, dict):
        return True
    if data_type.get("type") == "struct":
        return all(_decodes_immutable(field["type"]) for field in data_type.get("fields", []))
    return False


class RowTupleSerializer(Serializer[tuple[Any, ...]]):
    """Tuples of a Spark schema's fields (``StructType.json()``), compactly, without pickle.

    Every field is a tag byte (null or not) then its value: integers in their Spark width
    big-endian, floats as IEEE-754, strings and binaries length-prefixed, dates as days and
    timestamps as microseconds since the epoch, decimals as their text at the type's scale
    (rounded half up as Spark rounds; a value with more digits than the precision is
    refused), structs as nested tuples, arrays as lists (as tuples inside map keys, so
    that they can be dict keys), maps as dicts. A tuple, list, ``Row`` or dict (by field
    name) is accepted; decoding gives a tuple (nested structs through ``struct_of``, if
    given). The schema (names, types, nullability) is part of ``config()``: state written
    with other types is never silently reinterpreted. As in Spark, other field names and a
    field made not nullable read it as it is (``_fields_read_as``); fields added (nullable)
    or removed, and numbers widened, migrate it by field name, as Spark's Avro state
    encoding evolves it (``_evolution``); any other change is incompatible.
    """

    identity = "row-tuple"

    def __init__(
        self,
        schema_json: str,
        prepare: Callable[[Any], Any] | None = None,
        struct_of: StructOf | None = None,
    ) -> None:
        """``prepare``, if given, turns each value into what is encoded (e.g. numpy
        scalars into Python ones); it must leave a tuple of exactly ``int``, ``float``,
        ``str``, ``bool``, ``bytes`` and None as it is, which the one-call fast paths
        encode without calling it. ``struct_of``, if given, makes the decoded value of a
        nested struct (``StructOf``). Neither is part of ``config()``: the bytes' format
        is the schema's."""
        schema = _parse_struct(schema_json)
        self.schema_json = schema_json
        self.prepare = prepare
        self.struct_of = struct_of
        self.field_names = [field["name"] for field in schema.get("fields", [])]
        self._schema = _schema_identity(schema)
        self._to_bytes, self._from_bytes = _struct_bytes_codec(schema, prepare, struct_of)
        self.decodes_immutable = _decodes_immutable(schema)

    def __reduce__(self) -> tuple[Any, ...]:
        # Its codecs are closures over struct.Struct packers, which cannot be pickled:
        # a copy (e.g. one Spark ships to executors) is built again from the schema.
        return (RowTupleSerializer, (self.schema_json, self.prepare, self.struct_of))

    def _encode(self, value: tuple[Any, ...]) -> bytes:
        return self._to_bytes(value)

    def _decode(self, data: bytes) -> tuple[Any, ...]:
        return cast(tuple[Any, ...], self._from_bytes(data))

    def encoder(self) -> Callable[[tuple[Any, ...]], bytes]:
        return self._to_bytes

    def decoder(self) -> Callable[[bytes], tuple[Any, ...]]:
        return self._from_bytes

    def config(self) -> SerializerConfig:
        return {**super().config(), "schema": self._schema, "schema_json": self.schema_json}

    def compatibility_with(self, stored: SerializerConfig) -> Compatibility:
        same = (stored.get("identity"), stored.get("version")) == (self.identity, self.version)
        if same and _fields_read_as(stored.get("schema"), self._schema):
            return Compatibility.COMPATIBLE_AS_IS
        if same and _evolution(stored.get("schema"), self._schema) is not None:
            return Compatibility.COMPATIBLE_AFTER_MIGRATION
        return Compatibility.INCOMPATIBLE

    def incompatibility(self, stored: SerializerConfig) -> str | None:
        if stored.get("identity") == "ttl":  # TtlSerializer's, around the values
            return "it was stored with a TTL"
        if stored.get("identity") != self.identity:
            return None
        return _refusal(stored.get("schema"), self._schema)

    def migration_loses(self, stored: SerializerConfig) -> bool:
        schema = stored.get("schema")
        if stored.get("identity") != self.identity or not isinstance(schema, list):
            return False
        evolution = _evolution(schema, self._schema)
        return evolution is not None and len(set(evolution) - {None}) < len(schema)

    def migration_reader(self, stored: SerializerConfig) -> Serializer[Any]:
        evolution = _evolution(stored.get("schema"), self._schema)
        if evolution is None or stored.get("identity") != self.identity:
            return super().migration_reader(stored)
        return _EvolvingReader(str(stored["schema_json"]), evolution)

    @classmethod
    def from_config(cls, config: SerializerConfig) -> RowTupleSerializer:
        return cls(str(config["schema_json"]))

    def __repr__(self) -> str:
        return f"RowTupleSerializer({_fields_text(self._schema)})"


class _EvolvingReader(RowTupleSerializer):
    """Decodes values stored with its schema into the fields of the schema they evolve to
    (``_evolution``: per new field, the position of its stored value, or None)."""

    def __init__(self, schema_json: str, evolution: list[int | None]) -> None:
        super().__init__(schema_json)
        self.evolution = evolution

    def __reduce__(self) -> tuple[Any, ...]:
        return (_EvolvingReader, (self.schema_json, self.evolution))

    def _decode(self, data: bytes) -> tuple[Any, ...]:
        values = self._from_bytes(data)
        return tuple(None if position is None else values[position] for position in self.evolution)

    def decoder(self) -> Callable[[bytes], tuple[Any, ...]]:
        return self._decode
