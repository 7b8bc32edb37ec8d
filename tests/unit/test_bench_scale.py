"""scripts/bench/scale.py at tiny sizes: every row it prints agrees with what it wrote."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.scripts import load_script

# The measuring child process (spawn) imports the script by this name.
scale = load_script("scripts/bench/scale.py", "scale")

VALUE_BYTES = 100


def test_main_measures_and_prints_every_size_and_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--sizes", "1k,2k", "--pause-repeat", "0", "--workdir", str(tmp_path), "--json"]
    assert scale.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    assert [(row["keys"], row["format"]) for row in rows] == [
        (1000, "full"),
        (1000, "incremental"),
        (2000, "full"),
        (2000, "incremental"),
    ]
    for row in rows:
        written = {f"key-{n}" for n in range(row["keys"])}
        assert row["restored_keys"] == len(written)
        assert row["rescaled_keys"] == len(written)
        # Random values do not compress: a checkpoint holds at least every value once.
        assert row["checkpoint_bytes"] >= len(written) * VALUE_BYTES
        assert row["storage"] == "file"
        assert 0 < row["sync_pause_ms"] <= row["sync_pause_worst_ms"]
        assert row["upload_s"] > 0
        assert 0 < row["restore_max_s"] <= row["restore_s"]
        assert 0 < row["rescale_max_s"] <= row["rescale_s"]
        assert 0 <= row["rss_fill_growth_mb"] <= row["rss_growth_mb"] < row["rss_peak_mb"]
    assert list(tmp_path.iterdir()) == []  # scratch removed

    measured = [scale.Row(**row) for row in rows]
    scale.print_table(measured)
    printed = capsys.readouterr().out.splitlines()
    for row in measured:
        line = next(line for line in printed if line.split()[:2] == [str(row.keys), row.format])
        fields = line.split()
        assert int(fields[14]) == row.restored_keys
        assert int(fields[15]) == row.rescaled_keys
        assert float(fields[3]) == pytest.approx(row.checkpoint_bytes / 2**20, abs=0.05)
        upload_per_gb = row.upload_s / (row.checkpoint_bytes / 2**30)
        assert float(fields[7]) == pytest.approx(upload_per_gb, abs=0.05)
    verdicts = [line for line in printed if " -> " in line]
    assert len(verdicts) == 2 * 4
    worst_full = max(row.sync_pause_ms for row in measured if row.format == "full")
    assert verdicts[0].endswith("-> ok" if worst_full <= 50 else "-> NO")


def test_sizes_and_formats_parse_or_say_what_to_give() -> None:
    assert scale.parse_sizes("10k, 1m,500") == [10_000, 1_000_000, 500]
    with pytest.raises(argparse.ArgumentTypeError, match="10k,100k,1m,10m"):
        scale.parse_sizes("10x")
    assert scale.parse_formats("incremental") == ["incremental"]
    with pytest.raises(argparse.ArgumentTypeError, match="full, incremental"):
        scale.parse_formats("full,delta")
