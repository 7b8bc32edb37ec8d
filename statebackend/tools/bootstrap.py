"""``statebackend savepoint bootstrap``: a new savepoint of one operator's keyed state
from JSON Lines files, without Spark.

Each input line is ``{"key": ..., "value": ...}``: a value for value state, a list for
list state, an object for map state. Rows are routed to the subtask owning their key
group and each subtask is written by ``checkpoint.writer.SavepointWriter`` in this
process (``spark/state_writer.py`` does the same on executors, for any state kind).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from statebackend.checkpoint.filesystem import FAIL_FAST_RETRY
from statebackend.checkpoint.writer import OperatorRewrite, Row, SavepointWriter, Written
from statebackend.errors import ConfigurationError
from statebackend.keygroups import check_parallelism, compute_default_max_parallelism
from statebackend.serializers import Serializer
from statebackend.snapshot.frames import DEFAULT_CODEC
from statebackend.state.descriptors import (
    ListStateDescriptor,
    MapStateDescriptor,
    StateDescriptor,
    ValueStateDescriptor,
)
from statebackend.tools.location import checkpoint_directory, open_location

KINDS = ("value", "list", "map")
"""The state kinds a bootstrap from files writes (reducing and aggregating state need a
function: write them with ``spark.state_writer``)."""


@dataclass(frozen=True)
class StateFile:
    """One state to bootstrap: its name, kind and the JSON Lines file of its rows."""

    name: str
    kind: str
    path: str


def parse_state_file(text: str) -> StateFile:
    """``NAME:KIND=FILE`` as a StateFile; ConfigurationError if malformed."""
    spec, sep, path = text.partition("=")
    name, _, kind = spec.partition(":")
    if not sep or not name or not path or kind not in KINDS:
        raise ConfigurationError(
            f"{text!r} is not NAME:KIND=FILE with KIND one of {', '.join(KINDS)}: "
            f"e.g. count:value=counts.jsonl"
        )
    return StateFile(name, kind, path)


def descriptor_of(
    state: StateFile, value_serializer: Serializer[Any], map_key_serializer: Serializer[Any]
) -> StateDescriptor:
    """The descriptor the state is written with."""
    if state.kind == "list":
        return ListStateDescriptor(state.name, value_serializer)
    if state.kind == "map":
        return MapStateDescriptor(state.name, map_key_serializer, value_serializer)
    return ValueStateDescriptor(state.name, value_serializer)


def _rows(index: int, state: StateFile, storage_options: Mapping[str, Any] | None) -> Iterator[Row]:
    fs = open_location(state.path, dict(storage_options or {}))
    lines = fs.read_file(state.path).decode("utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            yield index, record["key"], record["value"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigurationError(
                f"{state.path}, line {number}: not a JSON object with key and value: {exc}"
            ) from exc


def bootstrap_from_files(
    target: str,
    operator_id: str,
    states: Sequence[StateFile],
    *,
    parallelism: int,
    key_serializer: Serializer[Any],
    value_serializer: Serializer[Any],
    map_key_serializer: Serializer[Any],
    max_parallelism: int | None = None,
    job_id: str = "bootstrap",
    storage_options: Mapping[str, Any] | None = None,
    compression: str = DEFAULT_CODEC,
    written: Written | None = None,
) -> str:
    """Write a savepoint of ``operator_id`` at ``parallelism`` holding ``states``, its
    files compressed with ``compression``; ``_metadata`` last, ``written`` told of each
    subtask written. Returns the savepoint's directory."""
    if len({s.name for s in states}) != len(states):
        raise ConfigurationError("a state is given twice: give each state once")
    if max_parallelism is None:
        max_parallelism = compute_default_max_parallelism(parallelism)
    check_parallelism(parallelism, max_parallelism)
    rewrite = OperatorRewrite(
        operator_id,
        parallelism,
        keyed_states=tuple(descriptor_of(s, value_serializer, map_key_serializer) for s in states),
        key_serializer=key_serializer,
        from_source=False,
    )
    writer = SavepointWriter(
        checkpoint_directory(target),
        max_parallelism,
        storage_options=storage_options,
        compression=compression,
        retry=FAIL_FAST_RETRY,
    )
    with writer.writing():
        per_subtask: list[list[Row]] = [[] for _ in range(parallelism)]
        for index, state in enumerate(states):
            for row in _rows(index, state, storage_options):
                per_subtask[rewrite.subtask_of(row[1], max_parallelism, state.name)].append(row)
        acks = []
        for subtask, rows in enumerate(per_subtask):
            acks.append(writer.write_subtask(rewrite, subtask, rows))
            if written is not None:
                written(operator_id, subtask)
        return writer.complete(acks, job_id=job_id)
