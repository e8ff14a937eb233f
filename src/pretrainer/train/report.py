"""The run report: `save_dir/report/report.html` (self-contained) and the SVG plots beside it (the plots and the
table: docs/checkpoints-and-faults.md, 'Run report').

Built from `metrics.jsonl` alone (and the run's `config.yaml` when a checkpoint holds one), so it can be made any time,
even mid-run. The plots are SVG drawn by `svg_plot` (no plotting library: written in milliseconds at every run's end).
"""

from __future__ import annotations

import html
import json
import logging
import re
import time
from pathlib import Path

from ..config import write_text_whole
from ..run.branch import find_branches
from .svg_plot import heatmap, line_chart

logger = logging.getLogger("pretrainer")

# (file name, title, y label, [(row key, legend, row filter)])
PLOTS = (
    ("loss.svg", "Loss", "loss", [("loss", "train", "train"), ("eval_loss", "eval", "eval")]),
    ("lr.svg", "Learning rate", "lr", [("lr", "lr", "train")]),
    ("tokens_per_s.svg", "Throughput", "useful tokens/s", [("tokens_per_s", "all ranks", "train")]),
    ("mfu.svg", "Model FLOPs utilisation", "MFU (%)", [("mfu", "MFU", "train")]),
    ("memory.svg", "Peak memory (largest rank)", "MB", [("peak_mem_mb", "peak", "train")]),
)


class ReportError(ValueError):
    """Nothing to report on."""


class ReportWriteError(ReportError):
    """The report's files could not be written (a full disk); the previous report's stay whole."""


def read_rows(save_dir: Path) -> list[dict]:
    path = Path(save_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} does not exist: give the save_dir of a run")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_report_logged(save_dir: str | Path) -> None:
    """The report at the end of a run: where it went, or why there is none (never an error)."""
    try:
        logger.info("run report: %s", write_report(save_dir))
    except ReportWriteError as exc:  # the run itself is complete: its checkpoint and metrics are written
        logger.warning("no run report: %s", exc)
    except ReportError as exc:
        logger.info("no run report: %s", exc)


def write_report(save_dir: str | Path, branches: list[str | Path] | None = None) -> Path:
    """`branches`: cooldown branches to draw over the run (None: those under save_dir/branches)."""
    save_dir = Path(save_dir)
    rows = read_rows(save_dir)
    train = latest_per_step([r for r in rows if "loss" in r and "event" not in r])
    evals = latest_per_step([r for r in rows if "eval_loss" in r])
    if not train:
        raise ReportError(f"{save_dir / 'metrics.jsonl'} has no training rows yet")
    out = save_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    charts = []
    for name, title, ylabel, series in PLOTS:  # line_chart leaves out a series without points
        lines = [(legend, [(r["step"], r[key] * (100 if key == "mfu" else 1))
                           for r in (train if kind == "train" else evals) if key in r]) for key, legend, kind in series]
        charts.append((name, line_chart(title, ylabel, lines)))
    tasks = downstream_rows(rows)
    found = [Path(b) for b in branches] if branches is not None else find_branches(save_dir)
    branch_rows = {branch: read_rows(branch) for branch in found}
    charts += downstream_charts(tasks, train) + moe_charts(train) + mixture_charts(train, evals)
    charts += length_stage_charts(train)
    charts += branch_charts(train, evals, branch_rows)
    page = out / "report.html"
    try:
        for name, chart in charts:
            write_text_whole(out / name, chart)
        write_text_whole(page, render_html(save_dir, rows, train, evals, tasks, [chart for _, chart in charts],
                                           branch_summary(branch_rows)))
    except OSError as exc:  # a full disk: the previous report's files stay whole
        raise ReportWriteError(f"writing the run report into {out} failed ({exc})") from None
    return page


def length_stage_starts(train: list[dict]) -> list[tuple[int, int]]:
    """(first logged step, seq_length) of each sequence-length stage the rows show."""
    starts: list[tuple[int, int]] = []
    for row in train:
        if "seq_length" in row and (not starts or starts[-1][1] != row["seq_length"]):
            starts.append((row["step"], row["seq_length"]))
    return starts


def length_stage_charts(train: list[dict]) -> list[tuple[str, str]]:
    """The window length per step, where it changed during the run (seq_length_schedule)."""
    if len(length_stage_starts(train)) < 2:
        return []
    points = [(row["step"], row["seq_length"]) for row in train if "seq_length" in row]
    return [("seq_length.svg", line_chart("Sequence-length stages", "seq_length", [("seq_length", points)]))]


def mixture_charts(train: list[dict], evals: list[dict]) -> list[tuple[str, str]]:
    """A mixture's stacked tokens (a line sums the sources up to it) and each source's train and eval loss."""
    names = [key.split("/", 1)[1] for key in (train[-1] if train else {}) if key.startswith("source_tokens/")]
    if not names:
        return []
    stacked, below = [], [0] * len(train)
    for name in names:
        below = [b + r.get(f"source_tokens/{name}", 0) for b, r in zip(below, train)]
        stacked.append((f"{name} (and above)" if stacked else name, [(r["step"], y) for r, y in zip(train, below)]))
    charts = [("mixture_tokens.svg", line_chart("Tokens trained per source (stacked)", "tokens",
                                                list(reversed(stacked))))]
    for file, title, key, rows in (("mixture_loss.svg", "Train loss per source", "source_loss", train),
                                   ("mixture_eval_loss.svg", "Eval loss per source", "eval_loss", evals)):
        lines = [(name, [(r["step"], r[f"{key}/{name}"]) for r in rows if f"{key}/{name}" in r]) for name in names]
        if any(points for _, points in lines):
            charts.append((file, line_chart(title, key.replace("_", " "), lines)))
    return charts


def branch_charts(train: list[dict], evals: list[dict], branches: dict[Path, list[dict]]) -> list[tuple[str, str]]:
    """The run's train and eval loss with each branch's over it (a branch logs the parent's step numbers)."""
    if not branches:
        return []
    charts = []
    for name, key, source, title in (("branches_loss.svg", "loss", train, "Train loss"),
                                     ("branches_eval_loss.svg", "eval_loss", evals, "Eval loss")):
        lines = [("this run", [(r["step"], r[key]) for r in source if key in r])]
        for folder, rows in branches.items():
            lines.append((folder.name, [(r["step"], r[key]) for r in latest_per_step(
                [r for r in rows if key in r and "event" not in r])]))
        charts.append((name, line_chart(f"{title}: the run and its cooldown branches", key, lines)))
    return charts


def branch_summary(branches: dict[Path, list[dict]]) -> list[tuple[str, str]]:
    """A line per branch: where it starts and its final losses."""
    items = []
    for folder, rows in branches.items():
        start = next((r for r in rows if r.get("event") == "start"), {})
        evals = [r for r in rows if "eval_loss" in r]
        train = [r for r in rows if "loss" in r and "event" not in r]
        final = f"final eval loss {evals[-1]['eval_loss']:.4f} at step {evals[-1]['step']:,}" if evals else "no eval"
        trained = f"train loss {train[-1]['loss']:.4f}" if train else "no steps yet"
        items.append((f"branch {folder.name}", f"from step {start.get('step', '?')}: {final}, {trained}"))
    return items


def downstream_rows(rows: list[dict]) -> dict[str, list[dict]]:
    """{task: its scored rows, one per step}, tasks in the order they were first scored."""
    tasks: dict[str, list[dict]] = {}
    for row in rows:
        for key in row:
            if key.startswith("eval/") and key.endswith("/acc"):
                tasks.setdefault(key[len("eval/"):-len("/acc")], []).append(row)
    return {task: latest_per_step(scored) for task, scored in tasks.items()}


def downstream_charts(tasks: dict[str, list[dict]], train: list[dict]) -> list[tuple[str, str]]:
    """(file name, chart) per task: acc and acc_norm (%) against the tokens trained on when it was scored."""
    tokens = {r["step"]: r.get("tokens", 0) for r in train}
    charts = []
    for task, scored in tasks.items():
        lines = [(metric, [(tokens[r["step"]], 100 * r[f"eval/{task}/{metric}"]) for r in scored
                           if r["step"] in tokens and f"eval/{task}/{metric}" in r])
                 for metric in ("acc", "acc_norm")]
        name = "downstream_" + re.sub(r"[^A-Za-z0-9_.-]", "_", task) + ".svg"
        charts.append((name, line_chart(f"Downstream: {task}", "accuracy (%)", lines, xlabel="tokens trained on")))
    return charts


def moe_charts(train: list[dict]) -> list[tuple[str, str]]:
    """A Mixture-of-Experts run's routing: the imbalance and dead experts over steps, and a heatmap of each
    layer's imbalance (busiest expert / mean) over steps."""
    routed = [r for r in train if "moe_load_imbalance" in r]
    if not routed:
        return []
    lines = [("max over layers", [(r["step"], r["moe_load_imbalance"]) for r in routed])]
    dead = [("dead (layer, expert) pairs", [(r["step"], r["moe_dead_experts"]) for r in routed])]
    layers = [(r["step"], r["moe_layer_imbalance"]) for r in routed if r.get("moe_layer_imbalance")]
    return [("moe_imbalance.svg", line_chart("Expert load imbalance", "busiest expert / mean", lines)),
            ("moe_dead_experts.svg", line_chart("Experts that got no token", "count", dead)),
            ("moe_layers.svg", heatmap("Load imbalance per MoE layer", "MoE layer", layers))]


def latest_per_step(rows: list[dict]) -> list[dict]:
    """One row per step, the last written (a resumed run logs the steps after its checkpoint again)."""
    by_step = {r["step"]: r for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def summary(save_dir: Path, rows: list[dict], train: list[dict], evals: list[dict],
            tasks: dict[str, list[dict]]) -> list[tuple[str, str]]:
    start = next((r for r in reversed(rows) if r.get("event") in ("start", "resume") and "engine" in r), {})
    last = train[-1]
    steady = train[len(train) // 4:] or train
    items = [
        ("run", str(save_dir.resolve()) + (f" (cooldown branch of {start['branch_of']})"
                                           if "branch_of" in start else "")),
        ("engine", f"{start.get('engine', '?')} on {start.get('world_size', '?')} process(es), "
                   f"device {start.get('device', '?')}, dtype {start.get('dtype', '?')}"),
        ("hardware", str(start.get("hardware", "?"))),
        ("model", f"{start.get('parameters', 0):,} parameters, {start.get('flops_per_token', 0) / 1e6:,.1f} "
                  "MFLOP per token"),
        ("MFU peak", str(start.get("peak", "?"))),
        ("steps", f"{last['step']:,} ({last.get('tokens', 0):,} tokens trained on)"),
        ("final train loss", f"{last['loss']:.4f}"),
    ]
    stages = length_stage_starts(train)
    if len(stages) > 1:
        items.append(("sequence-length stages", ", then ".join(f"{length} from logged step {step:,}"
                                                                for step, length in stages)))
    if evals:
        items.append(("final eval loss / ppl / acc", f"{evals[-1]['eval_loss']:.4f} / {evals[-1]['eval_ppl']:.2f} / "
                                                     f"{evals[-1]['eval_acc']:.4f}"))
    for task, scored in tasks.items():
        final = scored[-1]
        values = (final.get(f"eval/{task}/{metric}", float("nan")) for metric in ("acc", "acc_norm", "bpb"))
        items.append((f"{task} at step {final['step']:,}: acc / acc_norm / bpb",
                      " / ".join(f"{value:.4f}" for value in values)))
    if tasks:
        items.append(("downstream evaluation time", f"{sum(r.get('downstream_seconds', 0) for r in rows):,.1f} s"))
    items += [
        ("useful tokens/s (last 3/4 of the run)", f"{sum(r['tokens_per_s'] for r in steady) / len(steady):,.0f}"),
        ("MFU (last 3/4 of the run)", f"{100 * sum(r.get('mfu', 0) for r in steady) / len(steady):.1f}%"),
        ("peak memory (largest rank)", peak_memory_line(max(r.get("peak_mem_mb", 0) for r in train),
                                                        start.get("predicted_peak_mem_mb"))),
        ("skipped updates", str(sum(1 for r in rows if r.get("skipped_update")))),
    ]
    return items


def peak_memory_line(measured_mb: float, predicted_mb: float | None) -> str:
    """The measured peak, and the pre-launch prediction with its error when the run made one."""
    if not predicted_mb:
        return f"{measured_mb:,.0f} MB"
    error = (predicted_mb - measured_mb) / measured_mb if measured_mb else 0.0
    return f"{measured_mb:,.0f} MB measured, {predicted_mb:,.0f} MB predicted before launch ({error:+.0%})"


def render_html(save_dir: Path, rows, train, evals, tasks, charts: list[str],
                branches: list[tuple[str, str]] = ()) -> str:
    table = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                      for k, v in summary(save_dir, rows, train, evals, tasks) + list(branches))
    figures = "\n".join(f"<figure>{chart}</figure>" for chart in charts)
    config = config_text(save_dir)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pretrainer run report: {html.escape(save_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 20px; }}
th, td {{ text-align: left; padding: 4px 12px; border-bottom: 1px solid #ddd; vertical-align: top; }}
.plots {{ display: flex; flex-wrap: wrap; gap: 12px; }}
figure {{ margin: 0; }}
pre {{ background: #f6f6f6; padding: 12px; font-size: 12px; }}
</style></head><body>
<h1>pretrainer run report</h1>
<p>{html.escape(save_dir.name)} &middot; written {time.strftime("%Y-%m-%d %H:%M:%S")}</p>
<table>{table}</table>
<div class="plots">{figures}</div>
<h2>config</h2><pre>{html.escape(config)}</pre>
</body></html>
"""


def config_text(save_dir: Path) -> str:
    pointer = save_dir / "checkpoints" / "latest"
    if pointer.is_file():
        path = save_dir / "checkpoints" / pointer.read_text().strip() / "config.yaml"
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return "(no checkpoint with a config.yaml yet)"
