"""Each micro-batch's timestamp and watermarks, read from the Spark query's own offsets log."""

from __future__ import annotations

import json
from typing import Any

from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.layout import join
from statebackend.errors import ConfigurationError
from statebackend.spark.processor_handle import (
    BatchTimes,
)


class BatchTimesReader:
    """Batch N's timestamp and watermarks from Spark's ``offsets/N`` (and ``offsets/N-1``
    for the late-events watermark) in the query's checkpointLocation, read through the
    file system its binding file is written with (no py4j round trips); batch N's entry
    is kept for batch N+1, which reads it again (Spark never rewrites an offsets entry)."""

    def __init__(self, fs: CheckpointFileSystem, checkpoint_location: str) -> None:
        self._fs = fs
        self._location = checkpoint_location.rstrip("/")
        self._kept: tuple[int, dict[str, Any]] | None = None

    def _metadata(self, batch_id: int) -> dict[str, Any]:
        if self._kept is not None and self._kept[0] == batch_id:
            return self._kept[1]
        path = join(self._location, "offsets", str(batch_id))
        if not self._fs.exists(path):
            raise ConfigurationError(
                f"{path} does not exist: checkpointLocation must be the query's own "
                f"checkpoint directory"
            )
        lines = self._fs.read_file(path).decode("utf-8").splitlines()
        return dict(json.loads(lines[1]))  # lines[0] is the log version, "v1"

    def read(self, batch_id: int) -> BatchTimes:
        """The times of batch ``batch_id``; ConfigurationError if its offsets entry (or
        the previous batch's) is missing."""
        current = self._metadata(batch_id)
        late = self._metadata(batch_id - 1).get("batchWatermarkMs", 0) if batch_id > 0 else 0
        self._kept = (batch_id, current)
        return BatchTimes(
            int(current.get("batchTimestampMs", 0)),
            int(late),
            int(current.get("batchWatermarkMs", 0)),
        )
