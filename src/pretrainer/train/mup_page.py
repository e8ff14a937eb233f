"""What `pretrainer mup-check` shows of its record (train/mup_check.py): the table of the last step's means by module
kind and width, each kind's spread across widths, the verdict, and an HTML page with a log-log chart per kind."""

from __future__ import annotations

from html import escape
from pathlib import Path

from .svg_plot import line_chart

GROWS = 1.5  # a kind "grows with width" above this ratio of its largest to its smallest mean, rising with width


def last_step(record: dict) -> dict[str, dict[int, float]]:
    """{kind: {width: its mean |output| at the last step}}."""
    return {kind: {run["width"]: run["steps"][-1][kind] for run in record["runs"] if kind in run["steps"][-1]}
            for kind in record["modules"]}


def spreads(record: dict) -> dict[str, dict]:
    """{kind: ratio (largest / smallest mean across widths), whether it grows with width (the ratio above GROWS and
    each width's mean above the narrower one's), and the widths of the smallest and largest mean}."""
    found = {}
    for kind, by_width in last_step(record).items():
        widths = sorted(by_width)
        values = [by_width[width] for width in widths]
        low, high = min(values), max(values)
        ratio = high / low if low > 0 else float("inf")
        rising = all(later > earlier for earlier, later in zip(values, values[1:]))
        found[kind] = {"ratio": ratio, "grows": rising and ratio > GROWS,
                       "from": widths[values.index(low)], "to": widths[values.index(high)]}
    return found


def verdict(record: dict) -> str:
    """`logits grow with width (4.1x from 64 to 512)`, or `no module grows with width (largest spread 1.2x: mlp)`."""
    found = spreads(record)
    growing = [f"{kind} grow with width ({spread['ratio']:.1f}x from {spread['from']} to {spread['to']})"
               for kind, spread in found.items() if spread["grows"]]
    if growing:
        return "; ".join(growing)
    kind = max(found, key=lambda name: found[name]["ratio"])
    return f"no module grows with width (largest spread {found[kind]['ratio']:.1f}x: {kind})"


def text(record: dict) -> str:
    """The table (rows: module kinds; columns: widths; the last step's mean |output|), each kind's spread, and the
    verdict."""
    widths, means, found = record["widths"], last_step(record), spreads(record)
    head = (f"mean |activation| at step {record['steps']} (parametrization {record['parametrization']}; "
            "spread: largest / smallest across widths)")
    rows = [["module", *(f"width {width}" for width in widths), "spread"]]
    for kind, by_width in means.items():
        rows.append([kind, *(f"{by_width[width]:.4g}" if width in by_width else "-" for width in widths),
                     f"{found[kind]['ratio']:.2f}x"])
    sizes = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(size) if column == 0 else cell.rjust(size)
                       for column, (cell, size) in enumerate(zip(row, sizes))) for row in rows]
    return "\n".join([head, *lines, verdict(record)])


def charted_steps(steps: int, count: int = 4) -> list[int]:
    """Up to `count` steps to draw, evenly spread from the first to the last."""
    return sorted({1 + round(index * (steps - 1) / (count - 1)) for index in range(count)})


def charts(record: dict) -> list[str]:
    """One SVG per module kind: mean |output| against width, log-log, a line per charted step."""
    shown = charted_steps(len(record["runs"][0]["steps"]))
    svgs = []
    for kind in record["modules"]:
        series = [(f"step {step}", [(run["width"], run["steps"][step - 1][kind]) for run in record["runs"]
                                    if len(run["steps"]) >= step and kind in run["steps"][step - 1]])
                  for step in shown]
        svgs.append(line_chart(f"{kind}: mean |output| by width", "mean |activation|", series, xlabel="width",
                               log=True))
    return svgs


def write_page(record: dict, path: Path) -> Path:
    """The HTML page: the table and verdict as text, then the charts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    title = f"Coordinate check: {record['config']} ({record['parametrization']})"
    body = "\n".join(f'<div class="chart">{svg}</div>' for svg in charts(record))
    path.write_text(f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{escape(title)}</title>\n"
                    "<style>body{font-family:sans-serif;margin:2em} .chart{display:inline-block;margin:6px}</style>"
                    f"</head><body>\n<h1>{escape(title)}</h1>\n<pre>{escape(text(record))}</pre>\n{body}\n"
                    "</body></html>\n", encoding="utf-8")
    return path
