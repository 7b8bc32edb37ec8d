"""A batch interrupted by ``StreamingQuery.stop()``, told to Spark in words it recognises.

``stop()`` cancels the query's job group and interrupts its thread, so a ``foreachBatch``
function that is running a Spark job gets a ``Py4JJavaError`` (an InterruptedException,
or the job cancelled). Spark decides whether the query stopped cleanly or failed by
matching the text Py4J sends back (the Python traceback) against its regex
``StreamExecution.PROXY_ERROR``: ``py4j.protocol.Py4JJavaError: An error occurred while
calling((.|\\r\\n|\\r|\\n)*)(java.lang.InterruptedException|...)``. That pattern recurses
once per character after its prefix, so on a Java stack trace of a few KB the stream
thread dies with a StackOverflowError printed to the console (and a cancelled job,
whose trace names no interruption, would fail the query). ``stop_interruption`` turns
such an error into a ``BatchInterruptedError`` raised without its cause: a short traceback
that ends in the words the regex looks for, so Spark ends the query as stopped.
"""

from __future__ import annotations

from typing import Any

from py4j.protocol import Py4JJavaError

from statebackend.errors import BatchInterruptedError, error_chain

INTERRUPTIONS = (
    "java.lang.InterruptedException",
    "java.io.InterruptedIOException",
    "java.nio.channels.ClosedByInterruptException",
)
"""The Java exceptions Spark takes for an interrupted query thread
(``StreamExecution.IO_EXCEPTION_NAMES``)."""


def stop_interruption(
    error: BaseException, batch_id: int, query_group: str | None
) -> BatchInterruptedError | None:
    """The error to raise instead of ``error`` if ``error`` is a Spark call interrupted by
    the query's stop: a Java interruption anywhere in its causes, or a job cancelled with
    the query's job group ``query_group`` (which only ``stop()`` cancels), in ``error`` or
    an error it was raised from. None otherwise. Raise it ``from None``: the traceback
    Spark matches must stay short."""
    java_error = _py4j_error(error)
    if java_error is None:
        return None
    interruption = _interruption(java_error.java_exception, query_group)
    if interruption is None:
        return None
    call = str(java_error.errmsg).strip().rstrip(".")
    return BatchInterruptedError(
        f"batch {batch_id} was interrupted by the query's stop() and runs again when the "
        f"query restarts (py4j.protocol.Py4JJavaError: {call}: {interruption})"
    )


def _py4j_error(error: BaseException) -> Py4JJavaError | None:
    """The first Py4JJavaError among ``error`` and the errors it was raised from."""
    return next((e for e in error_chain(error) if isinstance(e, Py4JJavaError)), None)


def _interruption(java_exception: Any, query_group: str | None) -> str | None:
    """The name of the interruption in the Java exception's chain of causes, if any."""
    cause, seen = java_exception, 0
    while cause is not None and seen < 32:  # a chain, never a cycle, but bounded anyway
        name = cause.getClass().getName()
        if name in INTERRUPTIONS:
            return str(name)
        message = str(cause.getMessage() or "")
        if query_group and "cancelled" in message and query_group in message:
            return f"{INTERRUPTIONS[0]} (job cancelled: {message.splitlines()[0]})"
        cause, seen = cause.getCause(), seen + 1
    return None
