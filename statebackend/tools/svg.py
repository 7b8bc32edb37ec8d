"""Small inline SVG charts for ``statebackend report``: line charts and bar charts.

The report must open without network access, so it draws its own SVG instead of loading
a chart library. Points and bars carry a ``<title>`` (the browser shows it on hover), and
every chart's root carries ``data-marks`` (how many points or bars it shows), so a test
can check in the rendered page that a plot is not empty.
Values on an axis are formatted by unit: ``B`` (bytes, ticks in powers of 1024),
``s`` (seconds), ``x`` (a ratio) or none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

WIDTH = 920
HEIGHT = 280
_LEFT, _RIGHT, _TOP, _BOTTOM = 78, 16, 34, 46
PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#be123c")
"""Series colours, in order."""
MUTED = "#94a3b8"
HOT = "#dc2626"
GOOD = "#16a34a"
_WIDEST_BAR = 90
MAX_DOTS = 200
"""A line chart's series with more points than this is drawn as a line without dots."""
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


@dataclass(frozen=True)
class Series:
    """A line of a line chart: its name (in the legend), points (x, y) and colour."""

    name: str
    points: Sequence[tuple[float, float]]
    color: str


@dataclass(frozen=True)
class Bar:
    """A bar of a bar chart: its label (axis and tooltip), value and colour."""

    label: str
    value: float
    color: str = PALETTE[0]
    note: str = ""
    """Added to the tooltip."""


@dataclass(frozen=True)
class Marker:
    """A vertical line across a bar chart, before the bar at ``position`` (a float: bars
    are 1 wide), with a label at its top."""

    position: float
    label: str
    color: str


def format_value(value: float, unit: str = "") -> str:
    """``value`` for a person: ``1.5 MiB`` (unit ``B``), ``120 ms`` or ``2.5 s`` (``s``),
    ``1.25x`` (``x``), else a short number."""
    if unit == "B":
        index = _byte_scale(abs(value))[1]
        number = value / 1024**index
        digits = f"{number:.0f}" if index == 0 or abs(number) >= 100 else f"{number:.3g}"
        return f"{digits} {_BYTE_UNITS[index]}"
    if unit == "s":
        if value != 0 and abs(value) < 1:
            return f"{value * 1000:.3g} ms"
        return f"{value:.0f} s" if abs(value) >= 100 else f"{value:.3g} s"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.3g}"


def _byte_scale(value: float) -> tuple[float, int]:
    index = 0
    while value >= 1024 and index < len(_BYTE_UNITS) - 1:
        value /= 1024
        index += 1
    return value, index


def nice_ticks(high: float, unit: str = "", count: int = 5) -> list[float]:
    """About ``count`` round tick values from 0 to at least ``high`` (steps of 1, 2, 2.5
    or 5 times a power of ten; of a power of 1024 first for bytes)."""
    if high <= 0:
        return [0.0, 1.0]
    scale = 1024.0 ** _byte_scale(high)[1] if unit == "B" else 1.0
    rough = high / scale / count
    power = 10 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= rough) * scale
    if unit == "B" and step < 1:
        step = 1.0
    steps = math.ceil(high / step - 1e-9)
    return [i * step for i in range(steps + 1)]


def _frame(width: int, height: int, marks: int, label: str, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(label)}" '
        f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'data-marks="{marks}">' + "".join(body) + "</svg>"
    )


def _y_axis(
    ticks: list[float], unit: str, y_of: Callable[[float], float], width: int, label: str
) -> list[str]:
    parts = []
    for tick in ticks:
        y = y_of(tick)
        parts.append(
            f'<line x1="{_LEFT}" x2="{width - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
            f'class="grid"/><text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" '
            f'class="tick">{escape(format_value(tick, unit))}</text>'
        )
    parts.append(f'<text x="14" y="{_TOP - 14}" class="axis-label">{escape(label)}</text>')
    return parts


def _x_label(width: int, height: int, label: str) -> str:
    return (
        f'<text x="{(_LEFT + width - _RIGHT) / 2:.0f}" y="{height - 6}" text-anchor="middle" '
        f'class="axis-label">{escape(label)}</text>'
    )


def _legend(series: Sequence[tuple[str, str]], width: int) -> list[str]:
    parts = []
    x = width - _RIGHT
    for name, color in reversed(series):
        x -= 14 + 7 * len(name)
        parts.append(
            f'<rect x="{x}" y="{_TOP - 24}" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14}" y="{_TOP - 15}" class="legend">{escape(name)}</text>'
        )
        x -= 12
    return parts


def line_chart(
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    y_unit: str = "",
    x_unit: str = "",
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """An SVG line chart of ``series`` (each point a dot with a tooltip, up to
    ``MAX_DOTS`` points per series), y from 0."""
    points = [p for s in series for p in s.points]
    xs = [x for x, _ in points] or [0.0]
    low_x, high_x = min(xs), max(xs)
    if high_x == low_x:
        low_x, high_x = low_x - 1, high_x + 1
    y_ticks = nice_ticks(max((y for _, y in points), default=0.0), y_unit)
    plot_w, plot_h = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM

    def x_of(x: float) -> float:
        return _LEFT + (x - low_x) / (high_x - low_x) * plot_w

    def y_of(y: float) -> float:
        return _TOP + plot_h - y / y_ticks[-1] * plot_h

    body = _y_axis(y_ticks, y_unit, y_of, width, y_label)
    integers = all(float(x).is_integer() for x in xs)
    x_ticks = [t for t in _x_ticks(low_x, high_x, integers) if low_x <= t <= high_x]
    for tick in x_ticks:
        body.append(
            f'<text x="{x_of(tick):.1f}" y="{_TOP + plot_h + 16}" text-anchor="middle" '
            f'class="tick">{escape(format_value(tick, x_unit))}</text>'
        )
    body.append(_x_label(width, height, x_label))
    marks = 0
    for n, s in enumerate(series):
        ordered = sorted(s.points)
        if len(ordered) > 1:
            coords = " ".join(f"{x_of(x):.1f},{y_of(y):.1f}" for x, y in ordered)
            # Later lines dashed, so that one lying on an earlier one still shows both.
            dashes = f' stroke-dasharray="{3 + 3 * n} {3 * n}"' if n else ""
            body.append(
                f'<polyline points="{coords}" fill="none" stroke="{s.color}" '
                f'stroke-width="2"{dashes}/>'
            )
        marks += len(ordered)
        if len(ordered) > MAX_DOTS:  # the line alone reads better than a row of dots
            continue
        for x, y in ordered:
            tip = f"{s.name}: {format_value(y, y_unit)} at {x_label} {format_value(x, x_unit)}"
            body.append(
                f'<circle class="mark" cx="{x_of(x):.1f}" cy="{y_of(y):.1f}" r="3.5" '
                f'fill="{s.color}"><title>{escape(tip)}</title></circle>'
            )
    body += _legend([(s.name, s.color) for s in series], width)
    return _frame(width, height, marks, y_label, body)


def _x_ticks(low: float, high: float, integers: bool) -> list[float]:
    """Round tick values between ``low`` and ``high`` (whole numbers if ``integers``)."""
    ticks = nice_ticks(high - low, count=8)
    step = max(ticks[1] - ticks[0], 1.0) if integers else ticks[1] - ticks[0]
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def bar_chart(
    bars: Sequence[Bar],
    *,
    x_label: str,
    y_label: str,
    y_unit: str = "",
    markers: Sequence[Marker] = (),
    reference: float | None = None,
    legend: Sequence[tuple[str, str]] = (),
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """An SVG bar chart, y from 0; with vertical ``markers``, a dashed horizontal line at
    ``reference``, and a ``legend`` of (name, colour). Bar labels are written under the
    bars when they fit, else every so many."""
    top = max([b.value for b in bars] + ([reference] if reference is not None else []))
    y_ticks = nice_ticks(top if bars else 0.0, y_unit)
    plot_w, plot_h = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    slot = plot_w / max(len(bars), 1)

    def y_of(y: float) -> float:
        return _TOP + plot_h - y / y_ticks[-1] * plot_h

    body = _y_axis(y_ticks, y_unit, y_of, width, y_label)
    gap = max(slot * 0.15, slot - _WIDEST_BAR) if slot >= 4 else 0.0
    longest = max((len(b.label) for b in bars), default=1)
    every = max(1, math.ceil(len(bars) / max(plot_w // (7 * longest + 8), 1)))
    for i, bar in enumerate(bars):
        x, y = _LEFT + i * slot + gap / 2, y_of(bar.value)
        tip = f"{bar.label}: {format_value(bar.value, y_unit)}" + (
            f" ({bar.note})" if bar.note else ""
        )
        body.append(
            f'<rect class="mark" x="{x:.2f}" y="{y:.1f}" width="{max(slot - gap, 0.5):.2f}" '
            f'height="{max(_TOP + plot_h - y, 0):.1f}" fill="{bar.color}">'
            f"<title>{escape(tip)}</title></rect>"
        )
        if i % every == 0:
            body.append(
                f'<text x="{x + (slot - gap) / 2:.1f}" y="{_TOP + plot_h + 16}" '
                f'text-anchor="middle" class="tick">{escape(bar.label)}</text>'
            )
    if reference is not None:
        y = y_of(reference)
        body.append(
            f'<line x1="{_LEFT}" x2="{width - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="{MUTED}" stroke-dasharray="6 4" stroke-width="1.5"/>'
        )
    for marker in markers:
        x = _LEFT + marker.position * slot
        body.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" y2="{_TOP + plot_h}" '
            f'stroke="{marker.color}" stroke-dasharray="4 3" stroke-width="1.5"/>'
        )
        if marker.label:
            body.append(
                f'<text x="{x + 3:.1f}" y="{_TOP + 10}" class="marker" '
                f'fill="{marker.color}">{escape(marker.label)}</text>'
            )
    body.append(_x_label(width, height, x_label))
    body += _legend(legend, width)
    return _frame(width, height, len(bars), y_label, body)
