"""Read one keyed state of a completed checkpoint, savepoint or batch manifest as a Spark
DataFrame.

The DataFrame has columns ``key`` and ``value``, one row per key. It is read in parallel,
one Spark partition per key-group range (the ranges of the subtasks that wrote the
checkpoint), each reading only its key groups with ranged reads. From a batch manifest
(``<job dir>/manifests/<B>``, or ``<job dir>/latest``) each partition rebuilds the key
groups of one subtask of the batch from base + changelog records in a heap backend on
its executor, as a keyed subtask of the job does (``tools/manifests.py``). Keys and values are
decoded with the serializers the checkpoint recorded. A column is typed when its
serializer says so (str, int, float, bool) for value-like state; everything else (lists,
maps, pickled or JSON objects) is a JSON string. Values with a TTL are shown unwrapped.
Pickled keys and values are unpickled only with ``allow_pickle=True`` (otherwise they are
``{"serializer": "pickle", "base64": ...}``): unpickling runs code the checkpoint names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from itertools import groupby
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    BooleanType,
    DataType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from statebackend.backends.keyed import StateMetaInfo
from statebackend.backends.keyed_states import decode_list
from statebackend.checkpoint.filesystem import CheckpointFileSystem, open_filesystem
from statebackend.checkpoint.signing import SigningKey, verified_reads
from statebackend.errors import CheckpointNotFoundError, ConfigurationError, StateAccessError
from statebackend.keygroups import KeyGroupRange, compute_key_group_range_for_operator_index
from statebackend.serializers import OpaqueValue, Serializer, reading_serializer
from statebackend.snapshot.handles import HandleFiles, KeyedHandle
from statebackend.spark.conf import StateBackendConf
from statebackend.state.descriptors import StateKind
from statebackend.state.ttl import TtlValue
from statebackend.tools.local_copies import read_scratch
from statebackend.tools.location import ManifestRef, open_state
from statebackend.tools.manifests import (
    check_replay_without_pickle,
    operator_ids,
    parallelism_of,
    rebuild_subtask,
    state_metas,
)

_SPARK_TYPES: dict[str, DataType] = {
    "str": StringType(),
    "int": LongType(),
    "float": DoubleType(),
    "bool": BooleanType(),
}
_VALUE_KINDS = (StateKind.VALUE, StateKind.REDUCING)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, TtlValue) else value


def _jsonable(value: Any) -> Any:
    return value.to_json() if isinstance(value, OpaqueValue) else str(value)


def _json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, default=_jsonable)
    except TypeError:  # e.g. a map with tuple keys
        return json.dumps([[k, v] for k, v in value.items()], default=_jsonable)


def column_type(config: dict[str, Any]) -> DataType | None:
    """The Spark type of a column of values of serializer ``config`` (TTL unwrapped), or
    None when values are shown as JSON strings."""
    if config.get("identity") == "ttl":
        return column_type(config.get("inner", {}))
    return _SPARK_TYPES.get(str(config.get("identity")))


class _Decoder:
    """Turns one state's stored entries into (key, value) rows."""

    def __init__(self, meta: StateMetaInfo, key_config: dict[str, Any], allow_pickle: bool) -> None:
        self.kind = meta.kind
        self.key: Serializer[Any] = reading_serializer(key_config, allow_pickle)
        self.value: Serializer[Any] = reading_serializer(meta.serializers["value"], allow_pickle)
        self.user_key: Serializer[Any] | None = (
            reading_serializer(meta.serializers["user_key"], allow_pickle)
            if meta.kind is StateKind.MAP
            else None
        )
        self.key_type = column_type(key_config)
        value_type = column_type(meta.serializers["value"])
        self.value_type = value_type if meta.kind in _VALUE_KINDS else None

    def schema(self) -> StructType:
        return StructType(
            [
                StructField("key", self.key_type or StringType(), False),
                StructField("value", self.value_type or StringType(), True),
            ]
        )

    def _value(self, data: bytes) -> Any:
        return _plain(self.value.deserialize(data))

    def rows(self, entries: Iterator[tuple[bytes, bytes, bytes]]) -> Iterator[tuple[Any, Any]]:
        for key_bytes, group in groupby(entries, key=lambda entry: entry[0]):
            if self.kind is StateKind.MAP:
                assert self.user_key is not None
                value: Any = {
                    self.user_key.deserialize(user_key): self._value(data)
                    for _, user_key, data in group
                }
            elif self.kind is StateKind.LIST:
                value = [self._value(e) for _, _, data in group for e in decode_list(data)]
            else:
                value = self._value(next(group)[2])
            key = self.key.deserialize(key_bytes)
            yield (
                key if self.key_type is not None else _json(key),
                value if self.value_type is not None else _json(value),
            )


def _read_range(
    fs: CheckpointFileSystem,
    directory: str,
    handles: list[KeyedHandle],
    key_groups: KeyGroupRange,
    state_name: str,
    decoder: _Decoder,
    local_dir: Path,
) -> Iterator[tuple[Any, Any]]:
    for handle in handles:
        wanted = handle.key_group_range.intersection(key_groups)
        if not wanted:
            continue
        entries = handle.read_entries(HandleFiles(fs, directory, fs.read_range, local_dir), wanted)
        yield from decoder.rows(entry for name, _, entry in entries if name == state_name)


def read_state(
    spark: SparkSession,
    checkpoint: str | os.PathLike[str],
    operator_id: str,
    state_name: str,
    storage_options: dict[str, Any] | None = None,
    *,
    allow_pickle: bool = False,
    signing_key: SigningKey | None = None,
) -> DataFrame:
    """The (key, value) rows of keyed state ``state_name`` of ``operator_id`` in the
    completed checkpoint or savepoint ``checkpoint`` (its directory or ``_metadata``), or
    at the batch of a manifest (``<job dir>/manifests/<B>`` or ``<job dir>/latest``).

    ``storage_options`` default to the session's ``spark.statebackend.storage.*``. The
    tasks download (incremental snapshots, a manifest's base) into the session's
    ``spark.statebackend.local.dir`` on their executors (``local_copies.read_scratch``).
    Pickled keys and values are unpickled only with ``allow_pickle``. With
    ``signing_key`` (``StateBackendConf.checkpoint_signing_key()``) the checkpoint or
    manifest must be signed with it and its files unchanged. Raises
    CheckpointNotFoundError if it is not a completed checkpoint or committed manifest or
    has no such operator, StateAccessError if the operator has no such state,
    CheckpointCorruptedError if its ``_metadata`` or manifest is invalid or not signed.
    The files holding the rows are read by the DataFrame's tasks: a damaged one fails
    the action that reads it (e.g. ``count()``), with Spark's PythonException around our
    CheckpointCorruptedError.
    """
    if not isinstance(checkpoint, (str, os.PathLike)):  # e.g. the None of a run without one
        raise ConfigurationError(
            f"checkpoint {checkpoint!r} is invalid: give the directory of a completed "
            f"checkpoint or savepoint, or a batch manifest (e.g. <job dir>/latest)"
        )
    conf = StateBackendConf.from_session(spark)
    if storage_options is None:
        storage_options = conf.storage_options
    local_dir = conf.local_dir
    ref = open_state(os.fspath(checkpoint), storage_options, signing_key)
    if isinstance(ref, ManifestRef):
        return _read_manifest_state(spark, ref, operator_id, state_name, allow_pickle, local_dir)
    directory, metadata = ref.directory, ref.metadata
    fs = open_filesystem(directory, storage_options)
    snapshot = metadata.operators.get(operator_id)
    if snapshot is None:
        raise CheckpointNotFoundError(
            f"{directory} has no operator {operator_id!r}; it has {sorted(metadata.operators)}"
        )
    handles = snapshot.keyed_handles()
    metas = {meta.name: meta for handle in handles for meta in handle.states}
    if state_name not in metas:
        raise StateAccessError(
            f"operator {operator_id!r} in {directory} has no keyed state {state_name!r}; "
            f"it has {sorted(metas)}"
        )
    decoder = _Decoder(metas[state_name], handles[0].key_serializer, allow_pickle)
    ranges = [handle.key_group_range for handle in handles]
    files = metadata.files()

    def read_partition(items: Iterable[KeyGroupRange]) -> Iterator[tuple[Any, Any]]:
        with (
            read_scratch(Path(local_dir)) as local,
            verified_reads(fs, directory, files, signing_key) as reads,
        ):
            for key_groups in items:
                yield from _read_range(
                    reads, directory, handles, key_groups, state_name, decoder, local
                )

    rdd = spark.sparkContext.parallelize(ranges, max(1, len(ranges))).mapPartitions(read_partition)
    return spark.createDataFrame(rdd, decoder.schema())


def _read_manifest_state(
    spark: SparkSession,
    ref: ManifestRef,
    operator_id: str,
    state_name: str,
    allow_pickle: bool,
    local_dir: str,
) -> DataFrame:
    """``read_state`` of a manifest: one partition per subtask of the operator at the
    manifest's batch, each rebuilt from base + records on its executor (downloading
    into ``local_dir`` there)."""
    if operator_id not in operator_ids(ref):
        raise CheckpointNotFoundError(
            f"{ref.path} has no keyed state of operator {operator_id!r}; it has {operator_ids(ref)}"
        )
    check_replay_without_pickle(ref, operator_id, allow_pickle)
    states, key_serializer = state_metas(ref, operator_id)
    metas = {meta.name: meta for meta in states}
    if state_name not in metas:
        raise StateAccessError(
            f"operator {operator_id!r} in {ref.path} has no keyed state {state_name!r}; "
            f"it has {sorted(metas)}"
        )
    decoder = _Decoder(metas[state_name], key_serializer, allow_pickle)
    parallelism = parallelism_of(ref, operator_id)
    ranges = [
        compute_key_group_range_for_operator_index(ref.manifest.max_parallelism, parallelism, i)
        for i in range(parallelism)
    ]

    def read_partition(items: Iterable[KeyGroupRange]) -> Iterator[tuple[Any, Any]]:
        for key_groups in items:
            with read_scratch(Path(local_dir)) as local:
                backend = rebuild_subtask(ref, operator_id, key_groups, local)
            try:
                cut = backend.sync_cut()
                entries = (
                    entry
                    for key_group in key_groups
                    for name, entry in cut.entries(key_group)
                    if name == state_name
                )
                yield from decoder.rows(entries)
            finally:
                backend.dispose()

    rdd = spark.sparkContext.parallelize(ranges, len(ranges)).mapPartitions(read_partition)
    return spark.createDataFrame(rdd, decoder.schema())
