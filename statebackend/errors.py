"""The exceptions statebackend raises: one hierarchy, each message says what to do.

Every class says whether the runtime retries the work that raised it (``recoverable``,
Flink's ThrowableType): a deterministic error (bad configuration, bad input, state that
does not fit) would fail again, so a job stops at once; anything else (storage, a lost
executor) is retried up to ``max_retries`` times.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar


class StateBackendError(Exception):
    """Base of every error statebackend raises on purpose."""

    recoverable: ClassVar[bool] = True
    """Whether retrying the failed work may succeed (False: it fails the same way)."""


class ConfigurationError(StateBackendError):
    """A setting, argument or parallelism is invalid (bad key, P > M, M out of range)."""

    recoverable = False


class UnavailableMethodError(ConfigurationError, AttributeError):
    """A DataFrame method or property that the result of ``transform_with_state`` does not
    have (an action, a stateful operator): names it and says what to do. An
    AttributeError too, so ``hasattr`` and ``getattr(result, name, default)`` see no such
    attribute, as for any name the result lacks."""


class StateAccessError(StateBackendError):
    """State was used wrongly: no current key, a key outside the owned key-group range,
    a state name registered as two kinds, a reserved name, a disposed backend."""

    recoverable = False


class SerializationError(StateBackendError):
    """A value could not be encoded or decoded by its serializer."""

    recoverable = False


class IncompatibleStateError(StateBackendError):
    """Stored state cannot be read with the serializer, kind or max parallelism asked for."""

    recoverable = False


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

    recoverable = False


class CheckpointCancelledError(CheckpointError):
    """A snapshot's asynchronous part was cancelled before it finished."""


class CheckpointFencedError(CheckpointError):
    """Another driver claimed the job's checkpoint directory: this one may not trigger or
    complete checkpoints there any more."""

    recoverable = False


class SourceError(StateBackendError):
    """Input could not be read (e.g. a malformed line in a source partition)."""

    recoverable = False


class StatefulProcessorError(StateAccessError):
    """A StatefulProcessor used its handle where Spark forbids it (wrong lifecycle phase or
    time mode, an unusable TTL). ``error_class`` is the name Spark gives the same error."""

    def __init__(self, error_class: str, message: str) -> None:
        super().__init__(f"[{error_class}] {message}")
        self.error_class = error_class


class ProcessorArgumentTypeError(StateAccessError, TypeError):
    """A StatefulProcessor gave its handle an argument of the wrong type (a float timer
    timestamp or TTL, None as a state's value): a TypeError too, as Spark's handle raises
    one."""


class ProcessorArgumentRangeError(StateAccessError, ValueError):
    """A StatefulProcessor gave its handle a number beyond 64 bits: a ValueError too, as
    Spark's handle raises one."""


class DeletedStateError(StateAccessError, RuntimeError):
    """A StatefulProcessor used a state variable whose state ``deleteIfExists`` removed
    in ``init``: a RuntimeError too, as Spark's handle raises one."""


class ProcessorFailedError(StateBackendError):
    """A user's StatefulProcessor (or KeyedFunction) raised while a keyed subtask ran a
    micro-batch; names the method that raised (``Class.handleInputRows``) and the batch.
    The batch is not committed."""


class BatchInterruptedError(StateBackendError):
    """A Structured Streaming batch was interrupted by ``StreamingQuery.stop()``; it is not
    committed and runs again when the query restarts."""


class OutputSchemaError(StateBackendError):
    """A processor's output does not fit the declared output schema (names the column)."""

    recoverable = False


class JobFailedError(StateBackendError):
    """A job kept failing after ``max_retries`` recoveries (or cannot go on at all)."""

    recoverable = False


def error_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from (``__cause__``, else ``__context__``),
    each once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        yield error
        seen.add(id(error))
        error = error.__cause__ or error.__context__


MALFORMED_DOCUMENT: tuple[type[Exception], ...] = (
    KeyError,
    IndexError,
    TypeError,
    ValueError,
    AttributeError,
    OverflowError,
    RecursionError,
    CheckpointCorruptedError,
)
"""What parsing a JSON document of a checkpoint directory (``_metadata``, an ack, a batch
manifest, a savepoint request or answer, a leader claim, a metrics history line) raises
when a value has the wrong shape: a missing field, a range without bounds, a number no int
or float holds (``Infinity`` for an int, ``10**400`` for a float), nesting too deep, bytes
that are no UTF-8, an unknown handle type. The parser turns each into one
CheckpointCorruptedError naming the file, or ignores the document (a malformed ack)."""
