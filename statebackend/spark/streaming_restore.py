"""``transform_with_state(..., restore_from=...)``: a job's first start from a savepoint.

Spark starts a query's state empty (or from ``initial_state``) whenever it gets a new
``checkpointLocation``, which a change of source or of the query's plan requires. Flink
starts a job from a savepoint instead, and so does a ``transform_with_state`` job: given a
savepoint (or a completed checkpoint) of a ``transform_with_state`` job, the first batch
of a new job restores its keyed state, timers and the processor's operator state from it,
at any parallelism, and the first manifest builds on it.

``restore_point`` checks it up front on the driver, one ConfigurationError or
IncompatibleStateError each: it must be a completed checkpoint or savepoint on the job's
own storage, with the job's max parallelism, a ``transform_with_state`` operator keyed by
the same key columns, and states the processor can read. As Flink's "no claim" mode, the
job never writes, deletes or keeps depending on it: its first batch is also a
materialization, and once that completes later manifests build on the job's own
checkpoint. The query's first start records it with the binding (``streaming_commit.bind``):
a restart before the first batch committed goes on from it, also without ``restore_from``,
and one with another ``restore_from`` is refused.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Any

from fsspec.utils import get_protocol

from statebackend.backends.keyed import stored_reader
from statebackend.checkpoint.filesystem import absolute_location
from statebackend.checkpoint.layout import metadata_path
from statebackend.checkpoint.metadata import CheckpointMetadata
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    IncompatibleStateError,
)
from statebackend.serializers import (
    Compatibility,
    Serializer,
    SerializerConfig,
    serializer_from_config,
)
from statebackend.spark.arrow_path import OPERATOR_ID
from statebackend.spark.conf import check_max_parallelism_setting
from statebackend.state.descriptors import StateDescriptor
from statebackend.tools.location import job_directory_of


def _fold_hint(job_dir: str = "<job dir>") -> str:
    """What to restore from instead, and how to fold the manifests of ``job_dir`` into it."""
    return (
        f"give a chk-<N> or savepoint directory (fold a job's batch manifests into one first: "
        f"statebackend savepoint create --from {job_dir}/latest --to DIR)"
    )


def restore_location(
    storage: CheckpointStorage, restore_from: str, argument: str = "restore_from"
) -> str:
    """The one spelling of the directory a job restores from (as manifests record it;
    ``argument`` names where it was given). ConfigurationError if it is not on the file
    system of the job's storage, with which the keyed subtasks read it, or names a job (its
    directory, ``<job dir>/latest``, its Spark checkpointLocation), not a checkpoint."""
    if not isinstance(restore_from, str) or not restore_from:
        raise ConfigurationError(f"{argument} {restore_from!r} is invalid: give a directory")
    location = absolute_location(restore_from)
    ours = storage.layout.checkpoint_dir
    protocol = get_protocol(ours)
    if get_protocol(location) != protocol:
        raise ConfigurationError(
            f"{argument} {restore_from} is not on the file system of the job's storage "
            f"({ours}), with whose options the keyed subtasks read it: copy it to a "
            f"{protocol}:// directory with statebackend savepoint create --from "
            f"{restore_from} --to DIR"
        )
    resolved = storage.resolve(location)
    if storage.fs.exists(metadata_path(resolved)):
        return resolved
    if resolved.endswith("/latest"):
        raise ConfigurationError(
            f"{argument} {restore_from}: <job dir>/latest names a job's newest state on the "
            f"command line, not a directory a job restores from: "
            f"{_fold_hint(posixpath.dirname(resolved))}"
        )
    job = job_directory_of(storage.fs, resolved)
    if job is not None:
        raise ConfigurationError(
            f"{argument} {restore_from} is {job.given_as}, not a checkpoint or savepoint: "
            f"{_fold_hint(job.path)}"
        )
    return resolved


def restore_point(
    storage: CheckpointStorage,
    directory: str,
    key_serializer: Serializer[Any],
    declared_states: Sequence[StateDescriptor],
    max_parallelism: int | None,
) -> CheckpointMetadata:
    """The metadata of the checkpoint or savepoint in ``directory`` (``restore_location``)
    once it is checked to fit the job: ConfigurationError if it is not complete, holds no
    ``transform_with_state`` state, was keyed by other key columns, or its max
    parallelism is not ``max_parallelism`` (the setting, if given); IncompatibleStateError
    naming a state the processor declares with another kind or an unreadable schema;
    CheckpointError if it cannot be read (or, with a signing key, is not signed)."""
    try:
        metadata = storage.load(directory)
    except CheckpointNotFoundError as exc:
        raise ConfigurationError(
            f"restore_from {directory} is not a completed checkpoint or savepoint (no "
            f"_metadata): {_fold_hint()}"
        ) from exc
    check_max_parallelism_setting(
        max_parallelism, metadata.max_parallelism, f"restore_from {directory}"
    )
    operator = metadata.operators.get(OPERATOR_ID)
    if operator is None:
        held = ", ".join(sorted(metadata.operators)) or "none"
        raise ConfigurationError(
            f"restore_from {directory} holds no transform_with_state state (operator "
            f"{OPERATOR_ID!r}; it holds {held}): give a savepoint of a transform_with_state "
            f"job"
        )
    handles = operator.keyed_handles()
    if handles:
        stored = handles[0].key_serializer
        if key_serializer.compatibility_with(stored) is not Compatibility.COMPATIBLE_AS_IS:
            raise ConfigurationError(
                f"restore_from {directory} is keyed by {_describe(stored)}, this query by "
                f"{key_serializer!r}: its state cannot be read with other keys; key_by the "
                f"same columns with the same types"
            )
    stored_states = operator.keyed_states()
    for descriptor in declared_states:
        if descriptor.name in stored_states:
            try:
                stored_reader(stored_states[descriptor.name], descriptor)
            except IncompatibleStateError as exc:
                raise IncompatibleStateError(f"restore_from {directory}: {exc}") from exc
    return metadata


def _describe(config: SerializerConfig) -> str:
    try:
        return repr(serializer_from_config(config))
    except Exception:  # a serializer this release does not know: its configuration
        return str(config)
