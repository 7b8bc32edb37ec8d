"""The report's SVG charts: values formatted for people, axes that cover the data, and
``data-marks`` counting what a chart shows."""

from __future__ import annotations

import re

import pytest

from statebackend.tools.svg import (
    MAX_DOTS,
    Bar,
    Series,
    bar_chart,
    format_value,
    line_chart,
    nice_ticks,
)


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (0, "B", "0 B"),
        (1023, "B", "1023 B"),
        (1536, "B", "1.5 KiB"),
        (1000 * 1024, "B", "1000 KiB"),
        (3 * 1024**3, "B", "3 GiB"),
        (0.0042, "s", "4.2 ms"),
        (2.5, "s", "2.5 s"),
        (250.4, "s", "250 s"),
        (1.234, "x", "1.23x"),
        (12000, "", "12,000"),
    ],
)
def test_values_are_formatted_for_people(value: float, unit: str, text: str) -> None:
    assert format_value(value, unit) == text


@pytest.mark.parametrize("high", [0.7, 1, 9, 10, 11, 999, 1234.5, 3 * 1024**2 + 1])
@pytest.mark.parametrize("unit", ["", "B", "s"])
def test_ticks_start_at_zero_step_evenly_and_cover_the_data(high: float, unit: str) -> None:
    ticks = nice_ticks(high, unit)
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert ticks[0] == 0 and ticks[-1] >= high and len(steps) == 1
    assert 2 <= len(ticks) <= 12
    assert ticks[-2] < high  # no empty step above the data


def _marks(svg: str) -> int:
    match = re.search(r'data-marks="(\d+)"', svg)
    assert match is not None
    return int(match.group(1))


def test_charts_count_what_they_show() -> None:
    many = [(float(x), float(x % 7)) for x in range(MAX_DOTS + 1)]
    chart = line_chart(
        [Series("few", [(0, 1), (1, 2)], "#000"), Series("many", many, "#111")],
        x_label="batch",
        y_label="bytes",
        y_unit="B",
    )
    assert _marks(chart) == 2 + len(many)
    assert chart.count("<circle") == 2  # the long series is drawn as a line only
    assert chart.count("<polyline") == 2
    bars = bar_chart([Bar("0", 5), Bar("1", 0)], x_label="subtask", y_label="bytes")
    assert _marks(bars) == 2 and bars.count("<rect") == 2
    assert 'data-marks="0"' in line_chart([], x_label="x", y_label="y")
