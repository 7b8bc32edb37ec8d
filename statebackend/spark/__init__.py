"""The statebackend runtime on PySpark: the only package that imports pyspark.

``StatefulJob`` runs a keyed function over a partitioned log as micro-batches;
``transform_with_state`` runs a Spark ``StatefulProcessor`` inside a Structured Streaming
query; ``read_state`` and ``StateWriter`` read and write checkpoints as DataFrames.

The names below are imported on first use, so that an executor's Python worker that only
needs ``statebackend.spark.tasks`` does not load the driver's modules.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from statebackend.errors import JobFailedError
    from statebackend.spark.api import KeyedContext, KeyedFunction, RecordFunction
    from statebackend.spark.runner import RunSummary, StatefulJob
    from statebackend.spark.source import LogSource
    from statebackend.spark.state_reader import read_state
    from statebackend.spark.state_writer import StateWriter
    from statebackend.spark.streaming import transform_with_state

_HOMES = {
    "JobFailedError": "runner",
    "KeyedContext": "api",
    "KeyedFunction": "api",
    "LogSource": "source",
    "RecordFunction": "api",
    "RunSummary": "runner",
    "StateWriter": "state_writer",
    "StatefulJob": "runner",
    "read_state": "state_reader",
    "transform_with_state": "streaming",
}

__all__ = [
    "JobFailedError",
    "KeyedContext",
    "KeyedFunction",
    "LogSource",
    "RecordFunction",
    "RunSummary",
    "StateWriter",
    "StatefulJob",
    "read_state",
    "transform_with_state",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'statebackend.spark' has no attribute {name!r}")
    return getattr(import_module(f"statebackend.spark.{home}"), name)
