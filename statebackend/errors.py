"""The exceptions statebackend raises: one hierarchy, each message says what to do."""

from __future__ import annotations


class StateBackendError(Exception):
    """Base of every error statebackend raises on purpose."""


class ConfigurationError(StateBackendError):
    """A setting, argument or parallelism is invalid (bad key, P > M, M out of range)."""


class StateAccessError(StateBackendError):
    """State was used wrongly: no current key, a key outside the owned key-group range,
    a state name registered as two kinds, a reserved name, a disposed backend."""


class SerializationError(StateBackendError):
    """A value could not be encoded or decoded by its serializer."""


class IncompatibleStateError(StateBackendError):
    """Stored state cannot be read with the serializer, kind or max parallelism asked for."""


class CheckpointError(StateBackendError):
    """A checkpoint could not be taken, completed or found."""


class CheckpointNotFoundError(CheckpointError):
    """A path is not a completed checkpoint or savepoint."""


class CheckpointCorruptedError(CheckpointError):
    """A checkpoint file is missing, truncated or fails its checksum."""


class CheckpointUnreadableError(CheckpointError):
    """A completed checkpoint or savepoint could not be restored from: one of its files is
    missing, corrupted, or could not be read even after retries."""


class LocalStateError(StateBackendError):
    """An executor's local state directory (``local.dir``) cannot be used: it is not
    writable, or its disk is full."""


class CheckpointCancelledError(CheckpointError):
    """A snapshot's asynchronous part was cancelled before it finished."""


class CheckpointFencedError(CheckpointError):
    """Another driver claimed the job's checkpoint directory: this one may not trigger or
    complete checkpoints there any more."""


class SourceError(StateBackendError):
    """Input could not be read (e.g. a malformed line in a source partition)."""


class StatefulProcessorError(StateAccessError):
    """A StatefulProcessor used its handle where Spark forbids it (wrong lifecycle phase or
    time mode, an unusable TTL). ``error_class`` is the name Spark gives the same error."""

    def __init__(self, error_class: str, message: str) -> None:
        super().__init__(f"[{error_class}] {message}")
        self.error_class = error_class


class ProcessorFailedError(StateBackendError):
    """A user's StatefulProcessor (or KeyedFunction) raised while a keyed subtask ran a
    micro-batch; names the processor and the batch. The batch is not committed."""


class OutputSchemaError(StateBackendError):
    """A processor's output does not fit the declared output schema (names the column)."""
