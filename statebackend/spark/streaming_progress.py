"""The state operator of a ``transform_with_state`` query in Spark's progress reports.

The query is a ``foreachBatch`` query, so the ``StreamingQueryProgress`` Spark makes of
each batch has no ``stateOperators``: Spark's plan holds no stateful operator. Our keyed
subtasks count what the state did in each batch (``BatchMetrics``); ``BatchProgress``
keeps the recent batches' counts and puts them into the query's ``lastProgress`` and
``recentProgress`` as one ``StateOperatorProgress``, with the fields and custom metrics
Spark's ``transformWithState`` operator reports, so a dashboard that reads them goes on
working. A ``StreamingQueryListener`` gets its events from the JVM and still sees none.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from pyspark.sql.streaming.listener import StreamingQueryProgress

from statebackend.checkpoint.metrics import BatchMetrics

OPERATOR_NAME = "transformWithStateInPySparkExec"
"""The operator name Spark 4's Python ``transformWithState`` reports."""

NOT_COUNTED = -1
"""A count's value in a progress report where the backend does not count it: Spark's
fields are numbers, and 0 would say that the state is empty."""

DEFAULT_KEPT = 100
"""Spark's default ``spark.sql.streaming.numRecentProgressUpdates``."""


def state_operator(batch: BatchMetrics, parallelism: int) -> dict[str, Any]:
    """Batch ``batch``'s state as Spark's ``StateOperatorProgress`` JSON: rows total,
    written (``numRowsUpdated``) and removed (entries by their last change in the batch,
    as ``BatchMetrics`` counts them), commit time (the changelog and manifest), memory,
    late rows dropped, and timers registered, deleted and fired (calls, as Spark counts
    them; a fired timer is deleted too). Rows total and memory are
    ``NOT_COUNTED`` where the backend does not count them (``BatchMetrics``). Times are
    the slowest subtask's, where Spark sums its partitions'."""
    return {
        "operatorName": OPERATOR_NAME,
        "numRowsTotal": _counted(batch.state_rows),
        "numRowsUpdated": batch.state_rows_written,
        "allUpdatesTimeMs": _ms(batch.keyed_seconds),
        "numRowsRemoved": batch.state_rows_removed,
        "allRemovalsTimeMs": 0,
        "commitTimeMs": _ms(batch.changelog_seconds + batch.manifest_seconds),
        "memoryUsedBytes": _counted(batch.state_memory_bytes),
        "numRowsDroppedByWatermark": batch.late_rows,
        "numShufflePartitions": parallelism,
        "numStateStoreInstances": parallelism,
        "customMetrics": {
            "numRegisteredTimers": batch.timers_registered,
            "numDeletedTimers": batch.timers_removed,
            "numExpiredTimers": batch.timers_fired,
            "timerProcessingTimeMs": _ms(batch.timer_seconds),
            "keysTouched": batch.keys_touched,
            "changelogBytes": batch.changelog_bytes,
            "syncCutTimeMs": _ms(batch.sync_cut_seconds),
        },
    }


def _counted(count: int | None) -> int:
    return NOT_COUNTED if count is None else count


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


class BatchProgress:
    """The state counts of a query's recent batches, by batch id (the newest ``kept``),
    and Spark's progress reports with them (``with_state``). Thread-safe: batches are
    added by the query's thread and read by the user's."""

    def __init__(self, kept: int = DEFAULT_KEPT) -> None:
        self._kept = max(kept, 1)
        self._batches: OrderedDict[int, tuple[BatchMetrics, int]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, batch: BatchMetrics, parallelism: int) -> None:
        """Keep batch ``batch.batch_id``'s counts, run at ``parallelism``."""
        with self._lock:
            self._batches[batch.batch_id] = (batch, parallelism)
            self._batches.move_to_end(batch.batch_id)
            while len(self._batches) > self._kept:
                self._batches.popitem(last=False)

    def with_state(self, progress: StreamingQueryProgress) -> StreamingQueryProgress:
        """``progress`` with its batch's state operator, if that batch's counts are kept
        and Spark's report has no state operator of its own; else as it is."""
        with self._lock:
            kept = self._batches.get(progress.batchId)
        if kept is None or progress.stateOperators:
            return progress
        data = json.loads(progress.json)
        data["stateOperators"] = [state_operator(*kept)]
        return StreamingQueryProgress.fromJson(data)
