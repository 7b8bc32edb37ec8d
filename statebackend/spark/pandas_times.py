"""Timestamps in pandas mode, as Spark's ``transformWithStateInPandas`` hands them to a
processor and takes them back.

Spark carries a timestamp as an instant (Arrow: UTC microseconds with the session's time
zone). A pandas processor sees it as the wall time of the session time zone
(``spark.sql.session.timeZone``), without a zone: input columns are ``datetime64[ns]`` and a
key's timestamp is a naive ``pandas.Timestamp``. An output column of naive timestamps is
read as wall time of that zone (an ambiguous wall time as standard time, as Spark does); one
with a zone is converted. Row mode is not concerned: there Spark hands zone-aware datetimes,
as Arrow gives them. The key of ``handleExpiredTimer``, in both modes, Spark unpickles from
the JVM: its timestamps are naive ``datetime.datetime`` wall times of the session time zone
(``session_wall_time``).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from functools import partial
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np
import pandas as pd
import pyarrow as pa


def pandas_frame(table: pa.Table, time_zone: str, int_extension: bool = False) -> pd.DataFrame:
    """Rows of a group as Spark hands them to a pandas processor: timestamp columns as
    wall times of ``time_zone`` (``session_local_frame``), nested columns as
    ``nested_series`` makes them. Top-level integer columns with nulls stay ``float64``,
    as in Spark, and other columns have the dtypes of Spark's frames (``spark_types``).
    With ``int_extension`` (Spark's ``preferIntExtensionDtype``) integer columns keep
    their width, and one with nulls is of objects (``int_objects``)."""
    table = spark_types(table, widen_ints=not int_extension)
    special = [
        partial(nested_series, time_zone=time_zone)
        if pa.types.is_nested(field.type)
        else int_objects
        if int_extension and pa.types.is_integer(field.type) and column.null_count
        else None
        for field, column in zip(table.schema, table.columns, strict=True)
    ]
    if not any(special):
        return session_local_frame(table.to_pandas(), time_zone)
    # Each column converted once, nested ones as Spark converts them.
    columns = {
        name: column.to_pandas() if convert is None else convert(column)
        for name, column, convert in zip(table.column_names, table.columns, special, strict=True)
    }
    return session_local_frame(pd.DataFrame(columns), time_zone)


def int_objects(column: pa.ChunkedArray) -> pd.Series:
    """An integer column with nulls as Spark's frames hold it with
    ``preferIntExtensionDtype``: objects, NumPy scalars of the column's width and
    ``pandas.NA`` for null (Spark builds the frame from an ``Int8``... column's values)."""
    typed = column.fill_null(0).to_numpy()
    values = np.fromiter(typed, dtype=object, count=len(typed))  # NumPy scalars
    values[column.is_null().to_numpy(zero_copy_only=False)] = pd.NA
    return pd.Series(values, dtype=object)


def nested_series(column: pa.ChunkedArray, time_zone: str) -> pd.Series:
    """A nested column as Spark hands it to a pandas processor, converted by PySpark's
    own converter: maps and structs as dicts, integers in them as Python ints with None
    for null, timestamps in them as naive ``pandas.Timestamp`` (wall times of
    ``time_zone`` for timestamp, not timestamp_ntz), and an array of elements that need
    converting (structs, maps, timestamps) as ``numpy.array`` of the converted elements
    (``float64`` where it is empty)."""
    from pyspark.sql.pandas.types import from_arrow_type

    convert = _spark_converter(from_arrow_type(column.type, prefer_timestamp_ntz=True), time_zone)
    options = {"date_as_object": True, "coerce_temporal_nanoseconds": True}
    return convert(column.to_pandas(integer_object_nulls=True, **options))


def nested_value(data_type: Any, time_zone: str) -> Callable[[Any], Any]:
    """A function making a nested value of Spark type ``data_type`` (a struct as a dict,
    as Arrow gives it) what ``nested_series`` makes of it."""
    convert = _spark_converter(data_type, time_zone)
    return lambda value: value if value is None else convert(pd.Series([value], dtype=object))[0]


def _spark_converter(data_type: Any, time_zone: str) -> Callable[[pd.Series], pd.Series]:
    """PySpark's converter of a pandas column of ``data_type`` for a pandas processor."""
    from pyspark.sql.pandas.types import _create_converter_to_pandas

    return _create_converter_to_pandas(
        data_type,
        timezone=_zone(time_zone),
        struct_in_pandas="dict",
        error_on_duplicated_field_names=False,
    )


def sliceable_frame(
    table: pa.Table, time_zone: str, int_extension: bool = False
) -> pd.DataFrame | None:
    """``pandas_frame(table)``, made once for many groups of its rows, if every slice of
    it (with a fresh index: ``frame.iloc[a:b].reset_index(drop=True)``) equals
    ``pandas_frame`` of the same rows of ``table``; None where a group's frame depends
    on the group's own rows: integer and boolean columns with nulls (float64 and object
    only in the groups that have nulls), nested columns, and timestamp_ntz columns
    outside the years of datetime64[ns] (``spark_types`` keeps their unit)."""
    for field, column in zip(table.schema, table.columns, strict=True):
        if pa.types.is_nested(field.type):
            return None
        if column.null_count and (
            pa.types.is_integer(field.type) or pa.types.is_boolean(field.type)
        ):
            return None
    table = spark_types(table, widen_ints=not int_extension)
    if any(
        pa.types.is_timestamp(field.type) and field.type.tz is None and field.type.unit != "ns"
        for field in table.schema
    ):
        return None
    return session_local_frame(table.to_pandas(), time_zone)


_WIDER = {
    pa.int8(): pa.int64(),
    pa.int16(): pa.int64(),
    pa.int32(): pa.int64(),
    pa.float32(): pa.float64(),
}
"""Arrow's types whose pandas dtypes are narrower than pandas infers from Python values."""


def spark_types(table: pa.Table, widen_ints: bool = True) -> pa.Table:
    """``table`` with the types whose pandas dtypes Spark's frames have: Spark builds each
    DataFrame of a pandas processor from its rows' values, so pandas infers ``int64`` for
    byte, short and int columns, ``float64`` for float and ``datetime64[ns]`` for
    timestamp_ntz columns (Arrow's types give int8, int16, int32, float32,
    datetime64[us]). Cast in Arrow, before ``to_pandas``: a pandas ``astype`` of each
    key's frame costs more than making it. A timestamp_ntz column outside the years
    datetime64[ns] holds keeps its unit (Spark fails there). Without ``widen_ints``
    integer columns keep their type (as with ``preferIntExtensionDtype``)."""
    for position, field in enumerate(table.schema):
        kept = not widen_ints and pa.types.is_integer(field.type)
        wider = None if kept else _WIDER.get(field.type)
        if wider is None and pa.types.is_timestamp(field.type):
            if field.type.tz is not None or field.type.unit == "ns":
                continue
            wider = pa.timestamp("ns")
        if wider is None:
            continue
        try:
            column = table.column(position).cast(wider)
        except pa.ArrowInvalid:  # a timestamp outside the years of datetime64[ns]
            continue
        table = table.set_column(position, field.with_type(wider), column)
    return table


_OFFSET = re.compile(r"(?:UTC|GMT|UT)?([+-])(\d{1,2})(?::?(\d{2}))?(?::?(\d{2}))?")
"""A session time zone given as a fixed offset, as Spark takes it: ``+08:00``, ``-08``,
``+01:30:15``, ``UTC+8``, ``GMT+08:00``."""


def _zone(time_zone: str) -> Any:
    """The session time zone as a ``tzinfo``: a ``ZoneInfo`` (the time zone database's
    offsets, as Spark's; pandas takes a zone's name as a pytz zone, which knows no
    change before December 1901 and rounds local mean time to minutes), or a fixed
    ``datetime.timezone`` for an offset such as ``+08:00`` (no ``ZoneInfo`` has it);
    any other name is returned as it is, for pandas to read."""
    try:
        return ZoneInfo(time_zone)
    except (ValueError, ZoneInfoNotFoundError):
        pass
    if time_zone == "Z":
        return datetime.timezone.utc
    offset = _OFFSET.fullmatch(time_zone)
    if offset is None:
        return time_zone
    sign, hours, minutes, seconds = offset.groups()
    delta = datetime.timedelta(
        hours=int(hours), minutes=int(minutes or 0), seconds=int(seconds or 0)
    )
    return datetime.timezone(-delta if sign == "-" else delta)


def session_local_frame(frame: pd.DataFrame, time_zone: str) -> pd.DataFrame:
    """``frame`` with its zone-aware timestamp columns as naive ``datetime64[ns]`` wall
    times of ``time_zone`` (the same frame if it has none)."""
    aware = [name for name, dtype in frame.dtypes.items() if isinstance(dtype, pd.DatetimeTZDtype)]
    if not aware:
        return frame
    frame = frame.copy(deep=False)
    for name in aware:
        local = frame[name].dt.tz_convert(_zone(time_zone)).dt.tz_localize(None)
        frame[name] = local.astype("datetime64[ns]")
    return frame


def session_wall_time(value: datetime.datetime, time_zone: str) -> datetime.datetime:
    """The instant ``value`` (zone-aware, or naive local time as the row-tuple serializer
    decodes it) as a naive wall time of ``time_zone``."""
    return value.astimezone(_zone(time_zone)).replace(tzinfo=None)


def session_local_key(key: tuple[Any, ...], time_zone: str) -> tuple[Any, ...]:
    """``key`` with its timestamps as naive ``pandas.Timestamp`` wall times of
    ``time_zone`` (the same tuple if it has none)."""
    if not any(isinstance(value, datetime.datetime) for value in key):
        return key
    return tuple(
        _local_timestamp(value, time_zone) if isinstance(value, datetime.datetime) else value
        for value in key
    )


def _local_timestamp(value: datetime.datetime, time_zone: str) -> pd.Timestamp:
    stamp = pd.Timestamp(value)
    if stamp.tzinfo is None:
        return stamp
    return stamp.tz_convert(_zone(time_zone)).tz_localize(None)


def utc_series(series: pd.Series, time_zone: str) -> pd.Series:
    """An output column of a zone-aware timestamp type as UTC instants: naive timestamps
    are wall times of ``time_zone``; other columns are returned as they are."""
    if isinstance(series.dtype, pd.DatetimeTZDtype):
        return series.dt.tz_convert("UTC")
    if pd.api.types.is_datetime64_dtype(series.dtype):
        return series.dt.tz_localize(_zone(time_zone), ambiguous=False).dt.tz_convert("UTC")
    return series
