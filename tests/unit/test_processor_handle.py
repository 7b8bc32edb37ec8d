"""ProcessorHandle: Spark's StatefulProcessorHandle over our heap and RocksDB backends,
compared with plain-Python dicts; lifecycle and time-mode errors; TTL on batch time."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import Row
from pyspark.sql.streaming.stateful_processor import StatefulProcessorHandle
from pyspark.sql.types import (
    ArrayType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.errors import (
    ConfigurationError,
    IncompatibleStateError,
    StatefulProcessorError,
)
from statebackend.serializers import RowTupleSerializer
from statebackend.spark.processor_handle import (
    BatchClock,
    BatchTimes,
    Phase,
    ProcessorHandle,
    SchemaCatalog,
    _row_tuple,
    parse_time_mode,
)
from tests.unit.stateful_processors import make_backend

COUNT = StructType([StructField("count", LongType())])
EVENT = StructType([StructField("what", StringType()), StructField("n", LongType())])
USERS = [("alice",), ("bob",), ("carol",), ("dave",)]


@pytest.fixture(params=["heap", "rocksdb"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> BatchClock:
    return BatchClock(1_000_000)


@pytest.fixture
def backend(backend_kind: str, tmp_path: Path, clock: BatchClock) -> Iterator[KeyedStateBackend]:
    backend = make_backend(backend_kind, tmp_path / "db", clock)
    yield backend
    backend.dispose()


def _handle(backend: KeyedStateBackend, time_mode: str = "None", **kwargs: Any) -> ProcessorHandle:
    return ProcessorHandle(time_mode=time_mode, catalog=SchemaCatalog(), backend=backend, **kwargs)


def test_is_a_spark_handle(backend: KeyedStateBackend) -> None:
    assert isinstance(_handle(backend), StatefulProcessorHandle)


def test_value_list_and_map_state_match_plain_python(backend: KeyedStateBackend) -> None:
    handle = _handle(backend)
    value = handle.getValueState("count", COUNT)
    events = handle.getListState("events", EVENT)
    scores = handle.getMapState("scores", StructType([StructField("what", StringType())]), COUNT)
    handle.phase = Phase.INITIALIZED
    model_value: dict[Any, tuple[Any, ...]] = {}
    model_list: dict[Any, list[tuple[Any, ...]]] = {}
    model_map: dict[Any, dict[tuple[Any, ...], tuple[Any, ...]]] = {}
    rng = random.Random(7)
    for step in range(600):
        key = rng.choice(USERS)
        backend.set_current_key(key)
        op = rng.randrange(9)
        if op == 0:
            model_value[key] = (step,)
            value.update((step,))
        elif op == 1:
            model_value.pop(key, None)
            value.clear()
        elif op == 2:
            item = (f"e{step}", step)
            model_list.setdefault(key, []).append(item)
            events.appendValue(item)
        elif op == 3:
            items = [(f"x{step}", i) for i in range(rng.randrange(3))]
            model_list[key] = items
            events.put(items)
        elif op == 4:
            items = [(f"y{step}", 1), (f"z{step}", 2)]
            model_list.setdefault(key, []).extend(items)
            events.appendList(items)
        elif op == 5:
            user_key = (rng.choice("abc"),)
            model_map.setdefault(key, {})[user_key] = (step,)
            scores.updateValue(user_key, (step,))
        elif op == 6:
            user_key = (rng.choice("abc"),)
            model_map.get(key, {}).pop(user_key, None)
            scores.removeKey(user_key)
        elif op == 7:
            model_list.pop(key, None)
            events.clear()
        else:
            model_map.pop(key, None)
            scores.clear()
        for user in USERS:
            backend.set_current_key(user)
            assert value.exists() == (user in model_value)
            assert value.get() == model_value.get(user)
            assert list(events.get()) == model_list.get(user, [])
            assert events.exists() == bool(model_list.get(user))
            expected_map = model_map.get(user, {})
            assert dict(scores.iterator()) == expected_map
            assert sorted(scores.keys()) == sorted(expected_map)
            assert sorted(scores.values()) == sorted(expected_map.values())
            assert scores.exists() == bool(expected_map)
            for letter in "abc":
                got = scores.getValue((letter,))
                assert got == expected_map.get((letter,))
                if got is not None:  # a Row, as Spark's MapState gives
                    assert got.asDict() == {"count": got[0]}
                assert scores.containsKey((letter,)) == ((letter,) in expected_map)


def test_nested_structs_read_back_as_rows_and_not_null_fields_refuse_none(
    backend: KeyedStateBackend,
) -> None:
    """As Spark's handle gives them, a nested struct is a Row (by field name) in values,
    list elements and map keys and values; the value itself stays a tuple. A None for a
    field declared not null is refused, naming the field (Spark's own handle stores it and
    reads back 0)."""

    def struct(*fields: tuple[str, Any], nullable: bool = True) -> StructType:
        return StructType([StructField(name, kind, nullable) for name, kind in fields])

    def nested(name: str, *fields: tuple[str, Any]) -> StructType:
        return struct((name, struct(*fields)))

    totals = struct(("sum", LongType()), ("max", LongType()))
    handle = _handle(backend)
    value = handle.getValueState(
        "v", StructType([StructField("n", LongType(), False), StructField("totals", totals)])
    )
    listed = handle.getListState("l", nested("pair", ("a", StringType()), ("b", LongType())))
    mapped = handle.getMapState(
        "m", nested("k", ("day", IntegerType())), nested("v", ("n", LongType()))
    )
    handle.phase = Phase.INITIALIZED
    backend.set_current_key(("alice",))
    value.update((1, (10, 7)))
    listed.put([(("x", 1),), (("y", 2),)])
    mapped.updateValue(((3,),), ((5,),))
    stored = value.get()
    assert type(stored) is tuple and stored == (1, (10, 7))
    assert (stored[1].sum, stored[1].max) == (10, 7)
    assert [(row[0].a, row[0].b) for row in listed.get()] == [("x", 1), ("y", 2)]
    [(user_key, user_value)] = list(mapped.iterator())
    assert (user_key[0].day, user_value[0].n) == (3, 5)
    with pytest.raises(Exception, match="field 'n' is not nullable"):
        value.update((None, (1, 1)))
    value.update((2, None))  # the struct itself and its fields are nullable
    assert value.get() == (2, None)
    value.update((3, (None, None)))
    assert value.get() == (3, (None, None))


def test_numpy_values_are_stored_as_python_values(backend: KeyedStateBackend) -> None:
    import numpy as np

    handle = _handle(backend)
    value = handle.getValueState("count", COUNT)
    events = handle.getListState("events", EVENT)
    scores = handle.getMapState("scores", StructType([StructField("what", StringType())]), COUNT)
    stamps = handle.getValueState("stamps", StructType([StructField("at", TimestampType())]))
    handle.phase = Phase.INITIALIZED
    backend.set_current_key(("alice",))
    value.update((np.int64(5),))
    assert value.get() == (5,)
    assert type(value.get()[0]) is int  # type: ignore[index]
    stamps.update((np.datetime64(1_700_000_000_000_000, "us"),))
    assert stamps.get() == (datetime(2023, 11, 14, 22, 13, 20),)
    events.put([(np.str_("a"), np.int64(1))])
    events.appendValue([np.str_("b"), np.int32(2)])
    events.appendList([Row(what="c", n=np.int64(3))])
    assert list(events.get()) == [("a", 1), ("b", 2), ("c", 3)]
    assert [type(n) for _, n in events.get()] == [int, int, int]
    scores.updateValue([np.str_("x")], (np.int64(7),))
    assert scores.getValue(("x",)) == (7,) and scores.containsKey([np.str_("x")])
    scores.removeKey((np.str_("x"),))
    assert not scores.exists()


VALUE_SCHEMAS = {
    "flat": StructType([StructField("n", LongType()), StructField("x", DoubleType())]),
    "one string": StructType([StructField("s", StringType())]),
    "mixed": StructType(
        [
            StructField("s", StringType()),
            StructField("n", LongType()),
            StructField("xs", ArrayType(LongType())),
            StructField("at", TimestampType()),
        ]
    ),
}


@pytest.mark.parametrize("shape", sorted(VALUE_SCHEMAS))
def test_state_serializers_encode_values_as_their_python_tuples(shape: str) -> None:
    """A state's serializer encodes any accepted value (numpy and pandas scalars, lists,
    Rows, dicts) as the plain serializer encodes ``_row_tuple`` of it, on its fast paths
    (exact tuples of Python scalars, which ``update`` hands over unchanged) as on the
    rest."""
    import numpy as np
    import pandas as pd

    schema = VALUE_SCHEMAS[shape]
    prepared = RowTupleSerializer(schema.json(), _row_tuple)
    plain = RowTupleSerializer(schema.json())
    moment = datetime(2026, 11, 23, 6, 30, tzinfo=timezone.utc)
    candidates: dict[str, list[Any]] = {
        "flat": [
            (1, 2.5),
            (np.int64(1), 2.5),
            (1, np.float64(2.5)),
            [1, 2.5],
            (None, 2.5),
            (1, 2),
            Row(n=1, x=2.5),
            {"n": 1, "x": 2.5},
            (np.int32(-3), -0.0),
        ],
        "one string": [("a",), (np.str_("a"),), ["a"], (None,), Row(s="é"), {"s": "b"}],
        "mixed": [
            ("a", 1, [1, 2], moment),
            (np.str_("a"), np.int64(1), [np.int64(1)], moment),
            ["a", 1, (1, 2), pd.Timestamp(moment)],
            ("a", None, None, None),
            Row(s="a", n=1, xs=[], at=moment),
            ("b", 2, [], np.datetime64(1_700_000_000_000_000, "us")),  # only prepared
            {"s": "a", "n": 2, "xs": [3], "at": moment},
        ],
    }
    encode = prepared.encoder()
    for value in candidates[shape]:
        expected = plain.serialize(_row_tuple(value))
        assert prepared.serialize(value) == expected, value
        assert encode(value) == expected, value
    assert prepared.config() == plain.config()
    copy = pickle.loads(pickle.dumps(prepared))
    assert copy.serialize(candidates[shape][1]) == prepared.serialize(candidates[shape][1])


def test_ttl_expires_on_batch_time_not_wall_clock(
    backend: KeyedStateBackend, clock: BatchClock
) -> None:
    handle = _handle(backend, "ProcessingTime")
    value = handle.getValueState("count", COUNT, ttlDurationMs=5_000)
    handle.phase = Phase.INITIALIZED
    backend.set_current_key(("alice",))
    value.update((1,))
    clock.timestamp_ms += 4_999
    assert value.get() == (1,)
    clock.timestamp_ms += 1  # expiry = write time + TTL: expired at exactly that time
    assert value.get() is None
    assert not value.exists()


def test_ttl_needs_a_time_mode_and_a_positive_duration(backend: KeyedStateBackend) -> None:
    with pytest.raises(StatefulProcessorError, match="INCORRECT_TIME_MODE_TO_ASSIGN_TTL"):
        _handle(backend).getValueState("count", COUNT, ttlDurationMs=1000)
    with pytest.raises(StatefulProcessorError, match="TTL for state=seen in timeMode=EventTime"):
        _handle(backend, "EventTime").getMapState("seen", EVENT, COUNT, ttlDurationMs=1000)
    with pytest.raises(StatefulProcessorError, match="TTL_DURATION_MUST_BE_POSITIVE"):
        _handle(backend, "ProcessingTime").getListState("events", EVENT, ttlDurationMs=-1)


def test_states_are_declared_in_init_only(backend: KeyedStateBackend) -> None:
    handle = _handle(backend)
    handle.phase = Phase.INITIALIZED
    with pytest.raises(StatefulProcessorError, match="operation=get_value_state.*INITIALIZED"):
        handle.getValueState("count", COUNT)
    with pytest.raises(StatefulProcessorError, match="operation=delete_if_exists"):
        handle.deleteIfExists("count")


def test_state_use_after_close_is_an_error(backend: KeyedStateBackend) -> None:
    handle = _handle(backend)
    value = handle.getValueState("count", COUNT)
    handle.phase = Phase.CLOSED
    backend.set_current_key(("alice",))
    with pytest.raises(StatefulProcessorError, match="operation=update .*CLOSED"):
        value.update((1,))


@pytest.mark.parametrize("phase", [Phase.CREATED, Phase.TIMER_PROCESSED])
def test_state_use_in_init_or_close_is_an_error(backend: KeyedStateBackend, phase: Phase) -> None:
    """No key is current in ``init`` (CREATED) or ``close`` (TIMER_PROCESSED) in Spark: a
    state used there is refused, not served for the key the backend last had."""
    handle = _handle(backend)
    value = handle.getValueState("count", COUNT)
    handle.phase = Phase.INITIALIZED
    backend.set_current_key(("alice",))
    value.update((1,))
    handle.phase = phase
    for call in (value.exists, value.get, value.clear, lambda: value.update((2,))):
        with pytest.raises(StatefulProcessorError, match=f"invalid handle state={phase.name}"):
            call()
    handle.phase = Phase.INITIALIZED
    assert value.get() == (1,)


def test_timers_need_a_time_mode(backend: KeyedStateBackend) -> None:
    handle = _handle(backend, timers=backend.timer_service)
    handle.phase = Phase.INITIALIZED
    backend.set_current_key(("alice",))
    for call in (
        lambda: handle.registerTimer(5),
        lambda: handle.deleteTimer(5),
        lambda: list(handle.listTimers()),
    ):
        with pytest.raises(StatefulProcessorError, match="INVALID_TIME_MODE.*timeMode=None"):
            call()


def test_timers_are_not_available_in_init(backend: KeyedStateBackend) -> None:
    handle = _handle(backend, "ProcessingTime", timers=backend.timer_service)
    with pytest.raises(StatefulProcessorError, match="operation=register_timer.*CREATED"):
        handle.registerTimer(5)


@pytest.mark.parametrize("time_mode", ["ProcessingTime", "EventTime"])
def test_timers_of_the_current_key(backend: KeyedStateBackend, time_mode: str) -> None:
    timers = backend.timer_service
    handle = _handle(backend, time_mode, timers=timers)
    handle.phase = Phase.INITIALIZED
    backend.set_current_key(("alice",))
    for ts in (30, 10, 20):
        handle.registerTimer(ts)
    handle.deleteTimer(20)
    backend.set_current_key(("bob",))
    handle.registerTimer(15)
    assert list(handle.listTimers()) == [15]
    backend.set_current_key(("alice",))
    assert list(handle.listTimers()) == [10, 30]
    domain = (
        timers.processing_time_timers
        if time_mode == "ProcessingTime"
        else (timers.event_time_timers)
    )
    assert list(domain()) == [10, 30]


def test_changed_schema_is_incompatible(tmp_path: Path, clock: BatchClock) -> None:
    first = make_backend("rocksdb", tmp_path / "db", clock)
    handle = _handle(first)
    value = handle.getValueState("count", COUNT)
    handle.phase = Phase.INITIALIZED
    first.set_current_key(("alice",))
    value.update((1,))
    first.close()  # type: ignore[attr-defined]
    reopened = make_backend("rocksdb", tmp_path / "db", clock)
    try:
        with pytest.raises(IncompatibleStateError, match="'count'"):
            _handle(reopened).getValueState(
                "count", StructType([StructField("count", StringType())])
            )
    finally:
        reopened.dispose()


def test_same_name_with_another_schema_in_one_run_is_incompatible(
    backend: KeyedStateBackend,
) -> None:
    _handle(backend).getValueState("count", COUNT)
    with pytest.raises(IncompatibleStateError, match="'count'"):
        _handle(backend).getValueState("count", EVENT)


def test_delete_if_exists_clears_every_key(backend: KeyedStateBackend) -> None:
    handle = _handle(backend)
    value = handle.getValueState("count", COUNT)
    handle.phase = Phase.INITIALIZED
    for n, user in enumerate(USERS):
        backend.set_current_key(user)
        value.update((n,))
    _handle(backend).deleteIfExists("count")
    _handle(backend).deleteIfExists("never-declared")
    for user in USERS:
        backend.set_current_key(user)
        assert value.get() is None


def test_ddl_schemas_are_parsed_on_the_driver_and_looked_up_on_executors(
    backend: KeyedStateBackend,
) -> None:
    catalog = SchemaCatalog()
    parsed: list[str] = []

    def parse(ddl: str, what: str) -> StructType:
        parsed.append(ddl)
        return COUNT

    driver = ProcessorHandle(time_mode="None", catalog=catalog, parse_ddl=parse)
    assert driver.phase is Phase.PRE_INIT
    driver_state = driver.getValueState("count", "count long")
    with pytest.raises(StatefulProcessorError, match="PRE_INIT"):
        driver_state.get()
    executor = ProcessorHandle(time_mode="None", catalog=catalog, backend=backend)
    value = executor.getValueState("count", "count long")
    executor.phase = Phase.INITIALIZED
    backend.set_current_key(("alice",))
    value.update((3,))
    assert value.get() == (3,)
    assert parsed == ["count long"]
    executor.phase = Phase.CREATED
    with pytest.raises(ConfigurationError, match="state 'other': schema 'other long' was not"):
        executor.getValueState("other", "other long")


def test_a_state_name_declared_twice_is_spark_s_error() -> None:
    """As Spark's handle: a second declaration of a name in ``init``, of any kind, fails."""
    driver = ProcessorHandle(time_mode="None", catalog=SchemaCatalog(), parse_ddl=lambda *_: COUNT)
    driver.getValueState("count", "count long")
    with pytest.raises(StatefulProcessorError, match="DUPLICATE_STATE_VARIABLE_DEFINED.*count"):
        driver.getListState("count", "count long")
    assert list(driver.declared) == ["count"]


def test_time_modes_and_timer_values() -> None:
    assert parse_time_mode("processingtime") == "ProcessingTime"
    with pytest.raises(ConfigurationError, match="time_mode 'Later'"):
        parse_time_mode("Later")
    times = BatchTimes(1_000, late_events_watermark_ms=200, eviction_watermark_ms=500)
    assert times.timer_values("None").getCurrentProcessingTimeInMs() == -1
    assert times.timer_values("ProcessingTime").getCurrentProcessingTimeInMs() == 1_000
    assert times.timer_values("ProcessingTime").getCurrentWatermarkInMs() == 500  # as Spark
    assert times.timer_values("EventTime").getCurrentWatermarkInMs() == 500
