"""``statebackend savepoint transform``: a new savepoint with operators or states dropped
or states renamed, without Spark.

Each operator's subtasks are rewritten one after the other in this process by
``checkpoint.writer.SavepointWriter`` (the writer ``spark/state_writer.py`` runs on
executors), optionally at another parallelism; the source is only read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from statebackend.checkpoint.filesystem import FAIL_FAST_RETRY
from statebackend.checkpoint.writer import (
    OperatorRewrite,
    SavepointWriter,
    Written,
    check_rewrites,
)
from statebackend.errors import ConfigurationError
from statebackend.serializers.opaque import holds_pickle
from statebackend.snapshot.frames import DEFAULT_CODEC
from statebackend.tools.local_copies import default_local_dir, read_scratch
from statebackend.tools.location import CheckpointRef, checkpoint_directory


def parse_state_ref(text: str) -> tuple[str, str]:
    """``OPERATOR/STATE`` as (operator, state); ConfigurationError if malformed."""
    operator_id, sep, state = text.partition("/")
    if not sep or not operator_id or not state:
        raise ConfigurationError(f"{text!r} is not OPERATOR/STATE: e.g. user-totals/count")
    return operator_id, state


def plan_transform(
    ref: CheckpointRef,
    *,
    drop_operators: Sequence[str] = (),
    drop_states: Sequence[tuple[str, str]] = (),
    rename_states: Sequence[tuple[str, str, str]] = (),
    parallelism: int | None = None,
) -> list[OperatorRewrite]:
    """The rewrite of every operator of ``ref`` that is kept: (operator, state) pairs
    dropped, (operator, old, new) renamed, at ``parallelism`` (default: the operator's).

    ConfigurationError names an unknown operator or state.
    """
    operators = ref.metadata.operators
    for operator_id in [*drop_operators, *(op for op, _ in drop_states)] + [
        op for op, _, _ in rename_states
    ]:
        if operator_id not in operators:
            raise ConfigurationError(
                f"{ref.directory} has no operator {operator_id!r}; "
                f"it has {', '.join(sorted(operators)) or 'none'}"
            )
    drops: dict[str, set[str]] = {}
    for operator_id, state in drop_states:
        drops.setdefault(operator_id, set()).add(state)
    renames: dict[str, dict[str, str]] = {}
    for operator_id, old, new in rename_states:
        if old in drops.get(operator_id, ()) or operator_id in drop_operators:
            raise ConfigurationError(
                f"state {operator_id}/{old} is both dropped and renamed to {new!r}: "
                f"give one of the two"
            )
        renames.setdefault(operator_id, {})[old] = new
    rewrites = [
        OperatorRewrite(
            operator_id,
            snapshot.parallelism if parallelism is None else parallelism,
            drop_states=frozenset(drops.get(operator_id, ())),
            rename_states=renames.get(operator_id, {}),
        )
        for operator_id, snapshot in sorted(operators.items())
        if operator_id not in drop_operators
    ]
    check_rewrites(ref.metadata, rewrites)
    return rewrites


def check_transform_without_pickle(ref: CheckpointRef, rewrites: Sequence[OperatorRewrite]) -> None:
    """ConfigurationError if rewriting would unpickle: the subtasks of an operator whose
    state is restored store a state with different serializers, one of which is (or
    holds) pickle, and restoring their handles into one subtask migrates the values of
    one to the other's serializer by decoding them (``backends.keyed._reconcile``)."""
    for rewrite in rewrites:
        snapshot = ref.metadata.operators.get(rewrite.operator_id)
        if not rewrite.from_source or snapshot is None:
            continue
        configs: dict[str, list[Any]] = {}
        for handle in snapshot.keyed_handles():
            for meta in handle.states:
                seen = configs.setdefault(meta.name, [])
                if meta.serializers not in seen:
                    seen.append(meta.serializers)
        for name, distinct in sorted(configs.items()):
            if len(distinct) > 1 and any(map(holds_pickle, distinct)):
                raise ConfigurationError(
                    f"the subtasks of operator {rewrite.operator_id!r} in {ref.directory} "
                    f"store state {name!r} with different serializers, one of them pickle: "
                    f"rewriting them migrates pickled values, which unpickles them; pass "
                    f"--allow-pickle only if nobody else can write the checkpoint's storage"
                )


def transform_savepoint(
    ref: CheckpointRef,
    target: str,
    rewrites: Sequence[OperatorRewrite],
    *,
    storage_options: Mapping[str, Any] | None = None,
    compression: str = DEFAULT_CODEC,
    written: Written | None = None,
    allow_pickle: bool = False,
    local_dir: Path | None = None,
) -> str:
    """Write the savepoint of ``rewrites`` (``plan_transform``) of ``ref`` to ``target``,
    ``_metadata`` last; returns the target directory. Incremental snapshots are
    downloaded into a read copy under ``local_dir`` (default: ``default_local_dir()``;
    ``local_copies.read_scratch``). ConfigurationError if that would unpickle, unless
    ``allow_pickle`` (``check_transform_without_pickle``)."""
    if not allow_pickle:
        check_transform_without_pickle(ref, rewrites)
    writer = SavepointWriter(
        checkpoint_directory(target),
        ref.metadata.max_parallelism,
        source=ref.directory,
        storage_options=storage_options,
        compression=compression,
        retry=FAIL_FAST_RETRY,
    )
    with read_scratch(local_dir or Path(default_local_dir())) as scratch, writer.writing():
        acks = []
        for rewrite in rewrites:
            for subtask in range(rewrite.parallelism):
                acks.append(writer.write_subtask(rewrite, subtask, (), scratch))
                if written is not None:
                    written(rewrite.operator_id, subtask)
        return writer.complete(
            acks,
            job_id=ref.metadata.job_id,
            checkpoint_id=ref.metadata.checkpoint_id,
            properties=ref.metadata.properties,
        )
