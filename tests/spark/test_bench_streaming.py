"""scripts/bench/streaming.py at its smoke size: engines alternate their order by round,
each engine's result is its median round, and a bad ``--rounds`` is one parser error."""

from __future__ import annotations

import json

import pytest
from pyspark.sql import SparkSession

from tests.scripts import load_script

streaming = load_script("scripts/bench/streaming.py", "bench_streaming")

ENGINES = ["ours-row", "spark-jvm-agg"]


def test_rounds_alternate_and_report_the_median_run(
    spark_local: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--quick", "--rounds", "3", "--engines", ",".join(ENGINES), "--json"]
    results = streaming.main(argv, spark=spark_local)
    captured = capsys.readouterr()

    # Each run checked its final per-user values against plain Python; here the order
    # and the choice of the reported run.
    rounds = [
        (int(line.split()[2].rstrip(":")), json.loads(line.split(": ", 1)[1]))
        for line in captured.err.splitlines()
        if line.startswith("# round ")
    ]
    assert [(index, run["engine"]) for index, run in rounds] == [
        (0, "ours-row"),
        (0, "spark-jvm-agg"),
        (1, "spark-jvm-agg"),
        (1, "ours-row"),
        (2, "ours-row"),
        (2, "spark-jvm-agg"),
    ]
    sizes = streaming.QUICK
    for result in results:
        own = [run["events_per_second"] for _, run in rounds if run["engine"] == result.engine]
        assert result.rounds_events_per_second == own
        assert result.events_per_second == sorted(own)[1]
        assert result.batches == sizes["events"] // sizes["batch"]
    printed = [json.loads(line) for line in captured.out.splitlines()]
    assert [row["engine"] for row in printed] == ENGINES


def test_rounds_below_one_is_a_parser_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        streaming.main(["--quick", "--rounds", "0"])
    assert exit_info.value.code == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
