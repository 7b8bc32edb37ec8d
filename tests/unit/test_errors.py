"""Errors say whether retrying helps, and the runner decides from that, not from names."""

from __future__ import annotations

import inspect

from statebackend import errors
from statebackend.errors import (
    CheckpointError,
    CheckpointUnreadableError,
    SerializationError,
    StateBackendError,
    StatefulProcessorError,
)
from statebackend.spark.runner import error_line, task_error, task_errors

DETERMINISTIC = {
    "ConfigurationError",
    "StateAccessError",
    "SerializationError",
    "IncompatibleStateError",
    "LocalStateError",
    "CheckpointFencedError",
    "SourceError",
    "StatefulProcessorError",
    "ProcessorArgumentTypeError",
    "ProcessorArgumentRangeError",
    "DeletedStateError",
    "UnavailableMethodError",
    "OutputSchemaError",
    "JobFailedError",
}


def _spark_failure(*lines: str) -> Exception:
    """What a failed Spark job's exception text looks like: Python tracebacks as text."""
    return RuntimeError(
        "Job aborted due to stage failure: Task 0 in stage 3.0 failed 1 times\n"
        + "".join(f'  File "tasks.py", line 9, in run\n{line}\n' for line in lines)
    )


def test_every_error_class_says_whether_it_is_retried():
    classes = {
        name: cls
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, StateBackendError)
    }
    assert {name for name, cls in classes.items() if not cls.recoverable} == DETERMINISTIC
    assert all(isinstance(cls.recoverable, bool) for cls in classes.values())


def test_the_first_error_that_retrying_cannot_fix_decides():
    failure = _spark_failure(
        "statebackend.errors.CheckpointError: upload of x failed",
        "statebackend.errors.SerializationError: value 'x' of state 'count' is not an int",
    )
    assert [type(e) for e in task_errors(failure)] == [CheckpointError, SerializationError]
    fatal = task_error(failure)
    assert isinstance(fatal, SerializationError)
    assert str(fatal) == "value 'x' of state 'count' is not an int"


def test_transient_errors_are_retried_and_unknown_names_ignored():
    failure = _spark_failure(
        "statebackend.errors.CheckpointUnreadableError: chk-3/a.sst is missing",
        "statebackend.errors.NoSuchError: not ours",
    )
    assert task_error(failure) is None
    assert [type(e) for e in task_errors(failure)] == [CheckpointUnreadableError]
    assert task_error(RuntimeError("executor lost")) is None


def test_an_error_with_its_own_arguments_is_rebuilt_from_its_text():
    failure = _spark_failure(
        "statebackend.errors.StatefulProcessorError: [STATEFUL_PROCESSOR_X] wrong phase"
    )
    fatal = task_error(failure)
    assert isinstance(fatal, StatefulProcessorError)
    assert "wrong phase" in str(fatal)


def test_the_failure_record_names_what_failed_in_one_line():
    """A failed batch's record: our task error, else the worker's exception (the last
    line of its traceback: the first only says a worker raised), else the first line."""
    ours = _spark_failure("statebackend.errors.SourceError: p-1.jsonl line 3: not JSON")
    assert error_line(ours) == "p-1.jsonl line 3: not JSON"
    worker = RuntimeError(
        "An exception was thrown from the Python worker:\nTraceback (most recent call "
        'last):\n  File "rocksdb.py", line 3, in put\nOSError: No space left on device\n'
    )
    assert error_line(worker) == "OSError: No space left on device"
    java = RuntimeError("Job aborted: executor lost\n\tat org.apache.spark.Scheduler.run")
    assert error_line(java) == "Job aborted: executor lost"
    assert error_line(RuntimeError("")) == "RuntimeError('')"
