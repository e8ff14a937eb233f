"""Learning-rate transfer across width: the quickstart's 4-layer Llama at widths 64 to 512, a grid of learning rates a
factor 2 apart, under `parametrization: sp` and `mup` (base width 64), with AdamW and with Muon.

    .venv/bin/python bench/mup_transfer.py [--widths 64,128,256,512] [--log2-lrs=-12,-11,...] [--steps 150]
        [--runs sp-adamw,mup-adamw,mup-muon,sp-muon] [--jobs 2] [--out runs/bench/mup-transfer]
    .venv/bin/python bench/mup_transfer.py --depths 2,4,8 --widths 128 --runs completep-adamw,sp-adamw \
        --out runs/bench/completep-transfer

With `--depths`, the first width is kept and the depth (`num_hidden_layers`) varies instead, under `completep` with
the base at the smallest depth (and that width).

Each run is `examples/quickstart.yaml` (the Python-docs corpus, fp32) at that width (`pretrainer mup-check`'s width
variants: heads in proportion at head_dim 64, intermediate_size in proportion), `--steps` steps of 8 x 64 tokens,
warmup 15 steps then cosine to lr/10; with Muon, `muon_lr` is 10 x `lr` (AdamW's embedding, head and norms take `lr`).
A run's loss is the mean training loss of its last 20 steps; each width's optimum is the vertex of a quadratic fitted
to loss against log2(lr) over the grid's best point and up to two neighbours on each side. Results are appended to
OUT/results.jsonl as they finish (a rerun skips what is there); the summary and one SVG chart per run kind
(OUT/<kind>.svg: loss against log2(lr), a line per width) are written at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def run_one(job: dict) -> dict:
    """One training run in this (spawned, one-thread) process; its per-step losses."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from pretrainer import PreTrainer, PreTrainingArguments

    lr = 2.0 ** job["log2_lr"]
    overrides = [f"model_path={job['model']}", f"lr={lr}", f"min_lr={lr / 10}", "warmup_steps=15",
                 f"num_training_steps={job['steps']}", "micro_batch_size=8", "seq_length=64", "log_interval=1",
                 "eval_interval=0", "save_interval=0", "downstream_evals=null", "export_hf=false",
                 "write_report=false", "resume=none", f"optimizer={job['optimizer']}",
                 f"parametrization={job['parametrization']}", f"save_dir={job['save_dir']}"]
    if job["parametrization"] != "sp":
        overrides.append(f"mup_base_hidden_size={job['base_width']}")
    if job["parametrization"] == "completep":
        overrides.append(f"mup_base_num_layers={job['base_depth']}")
    if job["optimizer"] == "muon":
        overrides.append(f"muon_lr={10 * lr}")
    PreTrainer(PreTrainingArguments.from_yaml(str(REPO / "examples/quickstart.yaml"), overrides)).train()
    rows = [json.loads(line) for line in (Path(job["save_dir"]) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    return {key: job[key] for key in ("kind", "size", "log2_lr")} | {"losses": losses}


def final_loss(losses: list[float]) -> float:
    tail = losses[-20:]
    return float(np.mean(tail)) if tail and all(math.isfinite(x) for x in tail) else math.inf


def optimum(points: list[tuple[float, float]]) -> float:
    """log2 of the best lr: the vertex of a quadratic through the best point and up to two neighbours a side."""
    points = sorted(points)
    finite = [i for i, (_, loss) in enumerate(points) if math.isfinite(loss) and loss < 20]
    best = min(finite, key=lambda i: points[i][1])
    near = [points[i] for i in finite if abs(i - best) <= 2]
    if len(near) < 3:
        return points[best][0]
    a, b, _ = np.polyfit([x for x, _ in near], [y for _, y in near], 2)
    vertex = -b / (2 * a) if a > 0 else points[best][0]
    return float(min(max(vertex, near[0][0]), near[-1][0]))  # not beyond the points it was fitted to


def jobs_to_run(ns, folders: dict[int, Path], done: set, scratch: Path) -> list[dict]:
    jobs = []
    for kind in ns.runs.split(","):
        parametrization, optimizer = kind.split("-")
        for size in ns.sizes:
            for log2_lr in ns.log2_lrs:
                if (kind, size, log2_lr) not in done:
                    jobs.append({"kind": kind, "size": size, "log2_lr": log2_lr, "steps": ns.steps,
                                 "model": str(folders[size]), "optimizer": optimizer,
                                 "parametrization": parametrization, "base_width": ns.widths[0],
                                 "base_depth": min(ns.sizes), "save_dir": str(scratch / f"{kind}-{size}-{log2_lr:g}")})
    return sorted(jobs, key=lambda j: -j["size"])  # the longest first: the pool ends together


def depth_variants(width_folder: Path, depths: list[int], folder: Path) -> dict[int, Path]:
    """The model at one width with each depth: its config.json's num_hidden_layers changed, the tokenizer beside."""
    import shutil

    folders = {}
    for depth in depths:
        folders[depth] = folder / f"depth-{depth}"
        shutil.copytree(width_folder, folders[depth])
        config = json.loads((folders[depth] / "config.json").read_text())
        (folders[depth] / "config.json").write_text(json.dumps({**config, "num_hidden_layers": depth}, indent=2))
    return folders


def summarize(results: list[dict], ns, out: Path) -> None:
    from pretrainer.train.svg_plot import line_chart

    axis = "depth" if ns.depths else "width"
    for kind in ns.runs.split(","):
        curves = {s: [(r["log2_lr"], final_loss(r["losses"])) for r in results if r["kind"] == kind and r["size"] == s]
                  for s in ns.sizes}
        curves = {w: sorted(points) for w, points in curves.items() if points}
        if not curves:
            continue
        print(f"\n{kind}: loss (mean of the last 20 steps) by {axis} and log2(lr)")
        grid = sorted({x for points in curves.values() for x, _ in points})
        print(f"{axis:<6} " + " ".join(f"{x:>7g}" for x in grid) + "   optimum lr")
        optima = {}
        for width, points in curves.items():
            losses = dict(points)
            optima[width] = optimum(points)
            print(f"{width:<6} " + " ".join(f"{losses.get(x, math.nan):7.3f}" for x in grid)
                  + f"   {2 ** optima[width]:.3g}")
        spread = 2 ** (max(optima.values()) - min(optima.values()))
        top = max(grid)
        narrow, wide = min(curves), max(curves)
        gap = dict(curves[wide]).get(top, math.nan) - dict(curves[narrow]).get(top, math.nan)
        print(f"optima within a factor {spread:.2f}; at the highest lr (2^{top:g}) {axis} {wide} ends {gap:+.3f} "
              f"against {axis} {narrow}")
        chart = line_chart(f"{kind}: loss after {ns.steps} steps", "loss (last 20 steps)",
                           [(f"{axis} {s}", [(x, y) for x, y in points if y < 20]) for s, points in curves.items()],
                           xlabel="log2(lr)")
        (out / f"{kind}.svg").write_text(chart)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="64,128,256,512")
    parser.add_argument("--log2-lrs", default="-13,-12,-11,-10,-9,-8,-7")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--runs", default="sp-adamw,mup-adamw,mup-muon,sp-muon")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="runs/bench/mup-transfer")
    parser.add_argument("--depths", help="vary the depth (num_hidden_layers) at the first width instead")
    ns = parser.parse_args()
    ns.widths = [int(w) for w in ns.widths.split(",")]
    ns.depths = [int(d) for d in ns.depths.split(",")] if ns.depths else None
    ns.sizes = ns.depths or ns.widths
    ns.log2_lrs = [float(x) for x in ns.log2_lrs.split(",")]
    sys.path.insert(0, str(REPO / "src"))
    from pretrainer import PreTrainingArguments
    from pretrainer.train.mup_check import model_variants

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.jsonl"
    results = [json.loads(line) for line in results_file.read_text().splitlines()] if results_file.exists() else []
    done = {(r["kind"], r["size"], r["log2_lr"]) for r in results}
    with tempfile.TemporaryDirectory() as tmp:
        args = PreTrainingArguments.from_yaml(str(REPO / "examples/quickstart.yaml"))
        folders = model_variants(args, ns.widths[:1] if ns.depths else ns.widths, Path(tmp) / "models").folders
        if ns.depths:
            folders = depth_variants(folders[ns.widths[0]], ns.depths, Path(tmp) / "depths")
        jobs = jobs_to_run(ns, folders, done, Path(tmp) / "runs")
        with multiprocessing.get_context("spawn").Pool(ns.jobs, maxtasksperchild=1) as pool:
            for result in pool.imap_unordered(run_one, jobs):
                results.append(result)
                with open(results_file, "a") as f:
                    f.write(json.dumps(result) + "\n")
                print(f"{result['kind']} size {result['size']} lr 2^{result['log2_lr']:g}: "
                      f"{final_loss(result['losses']):.4f}", flush=True)
    summarize(results, ns, out)


if __name__ == "__main__":
    main()
