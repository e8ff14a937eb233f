"""Line charts and heatmaps as SVG text: what the run report needs, without a plotting library.

A chart is a title, an axis label and one or more series of (step, value) points; the axes get "nice" ticks (1, 2 or 5
times a power of ten), non-finite values are left out. A heatmap is columns of values (one per step), shaded by value.
"""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT = 560, 290
LEFT, RIGHT, TOP, BOTTOM = 68, 16, 30, 42  # margins around the plot area
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round values covering [low, high]."""
    if not high > low:
        low, high = low - (abs(low) * 0.1 or 1.0), high + (abs(high) * 0.1 or 1.0)
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    return [first + i * step for i in range(int(math.ceil((high - first) / step)) + 1)]


def tick_label(value: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e5, "k")):  # token counts: 200k, 1.5M, 3B
        if abs(value) >= scale:
            return f"{round(value / (scale if suffix != 'k' else 1e3), 6):g}{suffix}"
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:,.6g}" if abs(value) >= 1000 else f"{round(value, 10):g}"


def _svg_start(title: str) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">',
            f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
            f'<text x="{LEFT + PLOT_W / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>']


def _frame(xlabel: str, ylabel: str) -> str:
    return (f'<rect x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="none" stroke="#888"/>'
            f'<text x="{LEFT + PLOT_W / 2}" y="{HEIGHT - 6}" text-anchor="middle">{escape(xlabel)}</text>'
            f'<text transform="translate(14 {TOP + PLOT_H / 2}) rotate(-90)" text-anchor="middle">'
            f'{escape(ylabel)}</text>')


def log_ticks(low: float, high: float) -> list[float]:
    """The log10 of round values (1, 2 and 5 times a power of ten; powers of ten alone over more than three
    decades) from the last at or below 10**low to the first at or above 10**high."""
    multiples = (1,) if high - low > 3 else (1, 2, 5)
    values = [m * 10.0 ** power for power in range(math.floor(low) - 1, math.ceil(high) + 2) for m in multiples]
    logs = [math.log10(value) for value in values]
    first = max((v for v in logs if v <= low + 1e-9), default=logs[0])
    last = min((v for v in logs if v >= high - 1e-9), default=logs[-1])
    return [v for v in logs if first <= v <= last] if last > first else [first - 0.5, first, first + 0.5]


def line_chart(title: str, ylabel: str, series: list[tuple[str, list[tuple[float, float]]]],
               xlabel: str = "step", log: bool = False) -> str:
    """An SVG document: each series is (legend, points); a legend is drawn when there are several. With `log`, both
    axes are logarithmic (points with a value <= 0 are left out)."""
    if log:
        series = [(name, [(math.log10(x), math.log10(y)) for x, y in points if x > 0 and y > 0])
                  for name, points in series]
    series = [(name, [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)])
              for name, points in series]
    series = [(name, points) for name, points in series if points]
    xs = [x for _, points in series for x, _ in points] or [0.0, 1.0]
    ys = [y for _, points in series for _, y in points] or [0.0, 1.0]
    ticks = log_ticks if log else nice_ticks
    xticks, yticks = ticks(min(xs), max(xs)), ticks(min(ys), max(ys))
    x0, x1, y0, y1 = xticks[0], xticks[-1], yticks[0], yticks[-1]

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * PLOT_W

    def py(y: float) -> float:
        return TOP + PLOT_H - (y - y0) / (y1 - y0) * PLOT_H

    def label(value: float) -> str:
        return tick_label(float(f"{10 ** value:.3g}") if log else value)

    parts = _svg_start(escape(title))
    for x in xticks:
        parts.append(f'<line x1="{px(x):.1f}" y1="{TOP}" x2="{px(x):.1f}" y2="{TOP + PLOT_H}" stroke="#e4e4e4"/>'
                     f'<text x="{px(x):.1f}" y="{TOP + PLOT_H + 15}" text-anchor="middle">{label(x)}</text>')
    for y in yticks:
        parts.append(f'<line x1="{LEFT}" y1="{py(y):.1f}" x2="{LEFT + PLOT_W}" y2="{py(y):.1f}" stroke="#e4e4e4"/>'
                     f'<text x="{LEFT - 5}" y="{py(y) + 4:.1f}" text-anchor="end">{label(y)}</text>')
    parts.append(_frame(xlabel, ylabel))
    for index, (name, points) in enumerate(series):
        colour = COLOURS[index % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        if len(points) < 30:
            parts.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in points)
        if len(series) > 1:
            top = TOP + 14 + 16 * index
            parts.append(f'<line x1="{LEFT + PLOT_W - 70}" y1="{top - 4}" x2="{LEFT + PLOT_W - 50}" y2="{top - 4}" '
                         f'stroke="{colour}" stroke-width="2"/><text x="{LEFT + PLOT_W - 45}" y="{top}">'
                         f'{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def heatmap(title: str, ylabel: str, columns: list[tuple[float, list[float]]], xlabel: str = "step",
            low: float = 1.0) -> str:
    """An SVG document: one column of cells per (x, values) (row i = values[i], row 0 at the top), shaded
    from white at `low` to dark red at the largest value; the scale's ends are written beside the title."""
    columns = [(x, values) for x, values in columns if values]
    rows = max((len(values) for _, values in columns), default=0)
    high = max((v for _, values in columns for v in values if math.isfinite(v)), default=low)
    parts = _svg_start(f"{escape(title)} (white {tick_label(low)}, dark {tick_label(high)})")
    if columns and rows:
        cell_w, cell_h = PLOT_W / len(columns), PLOT_H / rows
        for index, (_, values) in enumerate(columns):
            for row, value in enumerate(values):
                share = 0.0 if not math.isfinite(value) or high <= low else min(max((value - low) / (high - low), 0), 1)
                shade = f"rgb({255 - round(116 * share)},{255 - round(255 * share)},{255 - round(255 * share)})"
                parts.append(f'<rect x="{LEFT + index * cell_w:.1f}" y="{TOP + row * cell_h:.1f}" '
                             f'width="{cell_w + 0.5:.1f}" height="{cell_h + 0.5:.1f}" fill="{shade}"/>')
        for index in sorted({0, len(columns) // 2, len(columns) - 1}):
            parts.append(f'<text x="{LEFT + (index + 0.5) * cell_w:.1f}" y="{TOP + PLOT_H + 15}" '
                         f'text-anchor="middle">{tick_label(columns[index][0])}</text>')
        for row in sorted({0, rows - 1}):
            parts.append(f'<text x="{LEFT - 5}" y="{TOP + (row + 0.5) * cell_h + 4:.1f}" '
                         f'text-anchor="end">{row}</text>')
    parts.append(_frame(xlabel, ylabel) + "</svg>")
    return "\n".join(parts)
