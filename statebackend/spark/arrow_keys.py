"""Key groups of Arrow rows, vectorised: the serialized keys and their murmur3.

``key_groups(batch, ...)`` gives each row's key group exactly as the backend computes
it, ``assign_to_key_group(RowTupleSerializer(key schema).serialize(key), M)``, but
column at a time: the ``RowTupleSerializer`` bytes of keys made of strings, binaries,
integers, floats, booleans and dates are built with Arrow kernels, and the unsigned
32-bit murmur3 (seed 0) runs over all keys at once in numpy. Keys of other types are
serialized row by row (same bytes), then hashed the same way.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from statebackend.serializers import RowTupleSerializer

_FIXED = {
    "byte": ">i1",
    "short": ">i2",
    "integer": ">i4",
    "long": ">i8",
    "float": ">f4",
    "double": ">f8",
    "boolean": ">u1",
    "date": ">i4",
}
"""Spark types whose RowTupleSerializer encoding is one big-endian numpy value."""

_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)


def _fixed_width_binary(values: np.ndarray) -> pa.Array:
    """Each element's bytes as a binary array (values already in their wire dtype)."""
    width = values.dtype.itemsize
    fixed = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), len(values), [None, pa.py_buffer(values.tobytes())]
    )
    return fixed.cast(pa.binary())


def _encoded_field(column: pa.Array, spark_type: Any) -> pa.Array | None:
    """The field's RowTupleSerializer bytes per row (tag byte included), or None if the
    type has no vectorised encoding."""
    present = pc.is_valid(column)
    if spark_type in ("string", "binary"):
        data = column.cast(pa.binary())
        lengths = pc.fill_null(pc.binary_length(data), 0).to_numpy(zero_copy_only=False)
        prefix = _fixed_width_binary(lengths.astype(">u4"))
        value = pc.binary_join_element_wise(prefix, pc.fill_null(data, b""), b"")
    elif isinstance(spark_type, str) and spark_type in _FIXED:
        if spark_type == "date":
            column = column.cast(pa.int32())
        elif spark_type == "boolean":
            column = column.cast(pa.uint8())
        filled = pc.fill_null(column, pa.scalar(0, column.type))
        value = _fixed_width_binary(
            filled.to_numpy(zero_copy_only=False).astype(_FIXED[spark_type])
        )
    else:
        return None
    tagged = pc.binary_join_element_wise(pa.scalar(b"\x01"), value, b"")
    return pc.if_else(present, tagged, pa.scalar(b"\x00"))


def serialized_keys(
    batch: pa.RecordBatch, key_columns: tuple[str, ...], key_schema_json: str
) -> pa.Array:
    """The RowTupleSerializer bytes of every row's key (a binary array)."""
    fields = json.loads(key_schema_json)["fields"]
    encoded = [
        _encoded_field(batch.column(name), field["type"])
        for name, field in zip(key_columns, fields, strict=True)
    ]
    if all(part is not None for part in encoded):
        if len(encoded) == 1:
            return encoded[0]
        return pc.binary_join_element_wise(*encoded, b"")
    serialize = RowTupleSerializer(key_schema_json).serialize
    columns = [batch.column(name).to_pylist() for name in key_columns]
    return pa.array([serialize(key) for key in zip(*columns, strict=True)], pa.binary())


def _rotl(values: np.ndarray, bits: int) -> np.ndarray:
    return (values << np.uint32(bits)) | (values >> np.uint32(32 - bits))


def murmur3_32(keys: pa.Array) -> np.ndarray:
    """Unsigned 32-bit murmur3 (seed 0) of each element of a binary array: equal to
    ``mmh3.hash(key, 0, signed=False)`` element by element."""
    keys = keys.cast(pa.binary())
    count = len(keys)
    offsets = np.frombuffer(keys.buffers()[1], dtype=np.int32)[
        keys.offset : keys.offset + count + 1
    ]
    data_buffer = keys.buffers()[2]
    data = (
        np.frombuffer(data_buffer, dtype=np.uint8)
        if data_buffer is not None
        else np.zeros(0, np.uint8)
    )
    starts = offsets[:-1].astype(np.int64)
    lengths = (offsets[1:] - offsets[:-1]).astype(np.int64)
    blocks = lengths // 4
    hashes = np.zeros(count, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for block in range(int(blocks.max()) if count else 0):
            rows = np.nonzero(blocks > block)[0]
            at = starts[rows] + 4 * block
            k = (
                data[at].astype(np.uint32)
                | (data[at + 1].astype(np.uint32) << np.uint32(8))
                | (data[at + 2].astype(np.uint32) << np.uint32(16))
                | (data[at + 3].astype(np.uint32) << np.uint32(24))
            )
            k = _rotl(k * _C1, 15) * _C2
            h = _rotl(hashes[rows] ^ k, 13)
            hashes[rows] = h * np.uint32(5) + np.uint32(0xE6546B64)
        tail = lengths & 3
        tail_start = starts + blocks * 4
        k1 = np.zeros(count, dtype=np.uint32)
        for extra, shift in ((3, 16), (2, 8), (1, 0)):
            rows = np.nonzero(tail >= extra)[0]
            k1[rows] ^= data[tail_start[rows] + extra - 1].astype(np.uint32) << np.uint32(shift)
        rows = np.nonzero(tail > 0)[0]
        hashes[rows] ^= _rotl(k1[rows] * _C1, 15) * _C2
        hashes ^= lengths.astype(np.uint32)
        hashes ^= hashes >> np.uint32(16)
        hashes *= np.uint32(0x85EBCA6B)
        hashes ^= hashes >> np.uint32(13)
        hashes *= np.uint32(0xC2B2AE35)
        hashes ^= hashes >> np.uint32(16)
    return hashes


def key_groups(
    batch: pa.RecordBatch, key_columns: tuple[str, ...], key_schema_json: str, max_parallelism: int
) -> np.ndarray:
    """Each row's key group (int64), as ``assign_to_key_group`` of its serialized key."""
    hashes = murmur3_32(serialized_keys(batch, key_columns, key_schema_json))
    return hashes.astype(np.int64) % max_parallelism
