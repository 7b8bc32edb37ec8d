"""Batch times come from Spark's offsets log, read as Spark writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from statebackend.checkpoint.filesystem import open_filesystem
from statebackend.errors import ConfigurationError
from statebackend.spark.batch_times import BatchTimesReader
from statebackend.spark.processor_handle import BatchTimes

# (batchTimestampMs, batchWatermarkMs) per batch, as Spark's offsets/N holds them
TIMES = [(1_000, 0), (2_000, 500), (3_500, 1_700)]


def _write_offsets(location: Path) -> None:
    (location / "offsets").mkdir(parents=True)
    for batch_id, (timestamp, watermark) in enumerate(TIMES):
        metadata = {"batchWatermarkMs": watermark, "batchTimestampMs": timestamp, "conf": {}}
        sources = {"logOffset": batch_id}
        text = f"v1\n{json.dumps(metadata)}\n{json.dumps(sources)}"
        (location / "offsets" / str(batch_id)).write_text(text)


def test_times_and_late_events_watermark_of_each_batch(tmp_path: Path) -> None:
    _write_offsets(tmp_path / "query")
    reader = BatchTimesReader(open_filesystem(str(tmp_path)), str(tmp_path / "query") + "/")
    for batch_id, (timestamp, watermark) in enumerate(TIMES):
        late = TIMES[batch_id - 1][1] if batch_id > 0 else 0
        assert reader.read(batch_id) == BatchTimes(timestamp, late, watermark)


def test_the_previous_batch_is_not_read_again(tmp_path: Path) -> None:
    _write_offsets(tmp_path)
    reader = BatchTimesReader(open_filesystem(str(tmp_path)), str(tmp_path))
    reader.read(1)
    (tmp_path / "offsets" / "1").unlink()
    assert reader.read(2) == BatchTimes(3_500, 500, 1_700)
    with pytest.raises(ConfigurationError, match="offsets/1 does not exist"):
        BatchTimesReader(open_filesystem(str(tmp_path)), str(tmp_path)).read(2)
