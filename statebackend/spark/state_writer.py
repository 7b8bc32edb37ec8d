"""Write state offline with Spark: bootstrap a new savepoint, or transform one.

The Spark side of ``checkpoint/writer.py`` (Flink's State Processor API), beside
``read_state``:

- **bootstrap**: ``StateWriter.new(spark)`` then ``with_keyed_state`` (a DataFrame of
  ``key``, ``value`` per state), ``with_operator_state`` (the elements and their mode),
  ``write(target, parallelism=...)``: a self-contained savepoint a job starts from at
  any parallelism;
- **transform**: ``StateWriter.from_savepoint(spark, source)`` then ``remove_operator``,
  ``remove_state``, ``rename_state``, and ``with_keyed_state`` to add a state or replace
  one by a DataFrame — typically ``read_state`` of it, transformed, written with a new
  descriptor (that is how values are mapped and a serializer changed offline). The
  source is never modified.

Each operator is written by one Spark task per subtask of the new savepoint: rows are
routed to the subtask owning their key group, the task restores its share of the source
(downloading into the session's ``spark.statebackend.local.dir``:
``local_copies.read_scratch``) and writes its snapshot files; the driver writes
``_metadata`` last. A DataFrame's
``value`` column holds what ``read_state`` shows: the value, the reduced value, the
aggregate's accumulator, a list, or a map; JSON strings (as ``read_state`` gives for
lists, maps and untyped serializers) are decoded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StringType, StructType

from statebackend.checkpoint.filesystem import open_filesystem
from statebackend.checkpoint.metadata import CheckpointMetadata, SubtaskAck
from statebackend.checkpoint.storage import load_metadata
from statebackend.checkpoint.writer import (
    OperatorRewrite,
    OperatorStateInput,
    Row,
    SavepointWriter,
    check_rewrites,
)
from statebackend.errors import ConfigurationError, IncompatibleStateError
from statebackend.keygroups import check_parallelism, compute_default_max_parallelism
from statebackend.redistribution import DistributionMode
from statebackend.serializers import PickleSerializer, Serializer, StrSerializer
from statebackend.snapshot.frames import DEFAULT_CODEC
from statebackend.spark.conf import StateBackendConf
from statebackend.spark.job_groups import job_group
from statebackend.spark.runner import task_error
from statebackend.spark.state_reader import column_type
from statebackend.state.descriptors import StateDescriptor, StateKind
from statebackend.tools.local_copies import read_scratch
from statebackend.tools.location import checkpoint_directory

_TYPED_KINDS = (StateKind.VALUE, StateKind.REDUCING)


def _decoder(
    frame: DataFrame, descriptor: StateDescriptor, key_serializer: Serializer[Any]
) -> Callable[[Any], tuple[Any, Any]]:
    """Row -> (key, value), undoing ``read_state``'s JSON encoding where it applies."""
    schema: StructType = frame.schema
    names = schema.fieldNames()
    if names[:2] != ["key", "value"] or len(names) != 2:
        raise ConfigurationError(
            f"the DataFrame of state {descriptor.name!r} has columns {names}: give exactly "
            f"the columns key and value (e.g. select them)"
        )
    strings = [isinstance(schema[name].dataType, StringType) for name in names]
    key_json = strings[0] and column_type(key_serializer.config()) is None
    value_json = strings[1] and (
        descriptor.kind not in _TYPED_KINDS or column_type(descriptor.serializer.config()) is None
    )

    def decode(row: Any) -> tuple[Any, Any]:
        key, value = row[0], row[1]
        if key_json and key is not None:
            key = json.loads(key)
        if value_json and isinstance(value, str):
            value = json.loads(value)
        return key, value

    return decode


@dataclass(frozen=True)
class _KeyedInput:
    descriptor: StateDescriptor
    frame: DataFrame
    key_serializer: Serializer[Any]


@dataclass
class _OperatorChanges:
    drop: set[str] = field(default_factory=set)
    rename: dict[str, str] = field(default_factory=dict)
    keyed: list[_KeyedInput] = field(default_factory=list)
    operator_states: list[OperatorStateInput] = field(default_factory=list)


class StateWriter:
    """Builds a new savepoint from DataFrames and, optionally, an existing savepoint.

    Create it with ``new`` (bootstrap) or ``from_savepoint`` (transform); the methods
    record changes and return the writer, ``write`` writes the savepoint.
    ``storage_options`` default to the session's ``spark.statebackend.storage.*``.
    """

    def __init__(
        self,
        spark: SparkSession,
        *,
        source: str | None = None,
        max_parallelism: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.spark = spark
        self.source = None if source is None else checkpoint_directory(source)
        if storage_options is None:
            storage_options = StateBackendConf.from_session(spark).storage_options
        self.storage_options = storage_options
        self.metadata: CheckpointMetadata | None = None
        if self.source is not None:
            self.metadata = load_metadata(
                open_filesystem(self.source, storage_options), self.source
            )
            if max_parallelism not in (None, self.metadata.max_parallelism):
                raise IncompatibleStateError(
                    f"{self.source} has max parallelism {self.metadata.max_parallelism}, not "
                    f"{max_parallelism}: key groups cannot be re-cut, leave it unset"
                )
            max_parallelism = self.metadata.max_parallelism
        self.max_parallelism = max_parallelism
        self._removed: set[str] = set()
        self._changes: dict[str, _OperatorChanges] = {}

    @classmethod
    def new(
        cls,
        spark: SparkSession,
        max_parallelism: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> StateWriter:
        """A writer of a savepoint from nothing but the given data (bootstrap).

        ``max_parallelism`` defaults to the default for the highest parallelism written.
        """
        return cls(spark, max_parallelism=max_parallelism, storage_options=storage_options)

    @classmethod
    def from_savepoint(
        cls, spark: SparkSession, source: str, storage_options: dict[str, Any] | None = None
    ) -> StateWriter:
        """A writer of a new savepoint holding the state of the completed checkpoint or
        savepoint ``source`` (its directory or ``_metadata``), changed as recorded."""
        return cls(spark, source=source, storage_options=storage_options)

    def _operator(self, operator_id: str) -> _OperatorChanges:
        if operator_id in self._removed:
            raise ConfigurationError(f"operator {operator_id!r} was removed: do not change it")
        return self._changes.setdefault(operator_id, _OperatorChanges())

    def remove_operator(self, operator_id: str) -> StateWriter:
        """Leave ``operator_id`` and all its state out of the new savepoint."""
        if self.metadata is None or operator_id not in self.metadata.operators:
            raise ConfigurationError(f"the source has no operator {operator_id!r} to remove")
        self._changes.pop(operator_id, None)
        self._removed.add(operator_id)
        return self

    def remove_state(self, operator_id: str, name: str) -> StateWriter:
        """Leave keyed or operator state ``name`` of ``operator_id`` out."""
        self._operator(operator_id).drop.add(name)
        return self

    def rename_state(self, operator_id: str, old: str, new: str) -> StateWriter:
        """Give keyed or operator state ``old`` of ``operator_id`` the name ``new``."""
        self._operator(operator_id).rename[old] = new
        return self

    def with_keyed_state(
        self,
        operator_id: str,
        descriptor: StateDescriptor,
        frame: DataFrame,
        *,
        key_serializer: Serializer[Any] | None = None,
    ) -> StateWriter:
        """Write keyed state ``descriptor`` of ``operator_id`` from ``frame`` (columns
        ``key``, ``value``; one row per key), replacing a source state of that name.

        Keys are encoded with ``key_serializer`` (default str, as ``StatefulJob``), values
        with the descriptor's serializers and TTL. A key given twice, or one the key
        serializer cannot encode, fails ``write`` with an error naming the state.
        """
        changes = self._operator(operator_id)
        if any(k.descriptor.name == descriptor.name for k in changes.keyed):
            raise ConfigurationError(
                f"keyed state {descriptor.name!r} of operator {operator_id!r} is given twice"
            )
        changes.keyed.append(_KeyedInput(descriptor, frame, key_serializer or StrSerializer()))
        return self

    def with_operator_state(
        self,
        operator_id: str,
        name: str,
        elements: Sequence[Any] | Mapping[Any, Any],
        *,
        mode: DistributionMode = DistributionMode.SPLIT,
        serializer: Serializer[Any] | None = None,
        key_serializer: Serializer[Any] | None = None,
    ) -> StateWriter:
        """Write operator state ``name`` of ``operator_id``: a list of elements (split
        mode: divided among the subtasks; union: divided, every subtask restores all) or
        a dict (broadcast: every subtask a copy; ``key_serializer`` for its keys)."""
        self._operator(operator_id).operator_states.append(
            OperatorStateInput(
                name,
                elements,
                mode,
                serializer or PickleSerializer(),
                key_serializer or PickleSerializer(),
            )
        )
        return self

    def _rewrites(self, parallelism: int | Mapping[str, int] | None) -> list[OperatorRewrite]:
        operators = dict(self.metadata.operators) if self.metadata is not None else {}
        rewrites = []
        for operator_id in sorted((set(operators) | set(self._changes)) - self._removed):
            changes = self._changes.get(operator_id, _OperatorChanges())
            chosen = (
                parallelism.get(operator_id) if isinstance(parallelism, Mapping) else parallelism
            )
            if chosen is None and operator_id in operators:
                chosen = operators[operator_id].parallelism
            if chosen is None:
                raise ConfigurationError(
                    f"operator {operator_id!r} is new: give its parallelism to write()"
                )
            key_serializers = {k.key_serializer for k in changes.keyed}
            if len(key_serializers) > 1:
                raise ConfigurationError(
                    f"the keyed states of operator {operator_id!r} have different key "
                    f"serializers: key them all alike"
                )
            rewrites.append(
                OperatorRewrite(
                    operator_id,
                    chosen,
                    drop_states=frozenset(changes.drop),
                    rename_states=dict(changes.rename),
                    keyed_states=tuple(k.descriptor for k in changes.keyed),
                    key_serializer=next(iter(key_serializers), StrSerializer()),
                    operator_states=tuple(changes.operator_states),
                )
            )
        check_rewrites(self.metadata, rewrites)
        return rewrites

    def write(
        self,
        target: str,
        *,
        parallelism: int | Mapping[str, int] | None = None,
        job_id: str | None = None,
        compression: str = DEFAULT_CODEC,
    ) -> str:
        """Write the savepoint into the empty directory ``target``; return it.

        ``parallelism`` is one for all operators or one per operator (default: each
        source operator's own; required for new operators). Its files are compressed
        with ``compression`` (lz4 by default, as a job's checkpoints). Every subtask's
        files are written by a Spark task; ``_metadata`` last, by the driver.
        """
        rewrites = self._rewrites(parallelism)
        highest = max((r.parallelism for r in rewrites), default=1)
        max_parallelism = self.max_parallelism
        if max_parallelism is None:
            max_parallelism = compute_default_max_parallelism(highest)
        for rewrite in rewrites:
            check_parallelism(rewrite.parallelism, max_parallelism)
        writer = SavepointWriter(
            checkpoint_directory(target),
            max_parallelism,
            source=self.source,
            storage_options=self.storage_options,
            compression=compression,
        )
        metadata = self.metadata
        job_id = job_id or (metadata.job_id if metadata else "bootstrap")
        local_dir = StateBackendConf.from_session(self.spark).local_dir
        with writer.writing():
            acks: list[SubtaskAck] = []
            for rewrite in rewrites:
                acks += self._write_operator(writer, rewrite, job_id, local_dir)
            return writer.complete(
                acks,
                job_id=job_id,
                checkpoint_id=metadata.checkpoint_id if metadata else 0,
                properties=metadata.properties if metadata else None,
            )

    def _write_operator(
        self, writer: SavepointWriter, rewrite: OperatorRewrite, job_id: str, local_dir: str
    ) -> list[SubtaskAck]:
        """One Spark task per subtask, fed the rows of its key groups, restoring the
        source into a read copy under ``local_dir`` on its executor."""
        context = self.spark.sparkContext
        parts: list[Any] = [context.parallelize([(i, None) for i in range(rewrite.parallelism)])]
        max_parallelism = writer.max_parallelism
        for index, keyed in enumerate(
            self._changes.get(rewrite.operator_id, _OperatorChanges()).keyed
        ):
            decode = _decoder(keyed.frame, keyed.descriptor, keyed.key_serializer)
            name = keyed.descriptor.name

            def route(row: Any, index: int = index, decode: Any = decode, name: str = name) -> Any:
                key, value = decode(row)
                return rewrite.subtask_of(key, max_parallelism, name), (index, key, value)

            parts.append(keyed.frame.rdd.map(route))

        def write(subtask: int, items: Iterable[tuple[int, Row | None]]) -> Iterator[str]:
            rows = (row for _, row in items if row is not None)
            scratch: AbstractContextManager[Path | None] = (
                nullcontext() if writer.source is None else read_scratch(Path(local_dir))
            )
            with scratch as local:
                ack = writer.write_subtask(rewrite, subtask, rows, local)
            yield json.dumps(ack.to_json())

        routed = context.union(parts).partitionBy(rewrite.parallelism, lambda subtask: subtask)
        try:
            with job_group(context, job_id, rewrite.operator_id, "write savepoint"):
                written = routed.mapPartitionsWithIndex(write).collect()
        except Exception as exc:
            error = task_error(exc)
            if error is None:
                raise
            raise error from None
        return [SubtaskAck.from_json(json.loads(item)) for item in written]
