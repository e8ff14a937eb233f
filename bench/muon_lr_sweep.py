"""Muon against AdamW on the quickstart: 3 learning rates each, held-out eval loss, and the steps Muon needs
to reach AdamW's best final eval loss. The default grids are those of
docs/optimization.md's table.

Each run is `pretrainer train examples/quickstart.yaml` (the 5.0M-parameter model, the Python-docs corpus,
240 steps of 8 x 256 tokens, cosine to lr/10, fp32) with `lr` set, evaluated every `--eval-interval` steps
on the same held-out documents. Muon uses `muon_adjust_lr: match_rms_adamw` (the default), so one `lr` serves
both halves (Muon's matrices and AdamW's embeddings, head and norms). Prints every run's final eval loss and
for each Muon run the first step its eval curve (linear between evaluations) is at or below the best AdamW
run's final eval loss, as a fraction of the run.

    .venv/bin/python bench/muon_lr_sweep.py [--adamw-lrs 5e-4,1e-3,2e-3] [--muon-lrs 2e-3,4e-3,8e-3]
                                           [--eval-interval 20] [--steps 240]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import metrics, pretrainer


def eval_curve(save_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["eval_loss"]) for r in metrics(save_dir) if "eval_loss" in r]


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which the curve (linear between evaluations) reaches `target`; None if it never does."""
    previous = None
    for step, loss in curve:
        if loss <= target:
            if previous is None:
                return float(step)
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adamw-lrs", default="5e-4,1e-3,2e-3")
    parser.add_argument("--muon-lrs", default="2e-3,4e-3,8e-3")
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--steps", type=int, default=240)
    ns = parser.parse_args()
    grids = {name: [float(x) for x in text.split(",")] for name, text in (("adamw", ns.adamw_lrs),
                                                                            ("muon", ns.muon_lrs))}
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, lrs in grids.items():
            for lr in lrs:
                save_dir = Path(tmp) / f"{optimizer}-{lr:g}"
                pretrainer("train", "examples/quickstart.yaml", f"optimizer={optimizer}", f"lr={lr}",
                           f"min_lr={lr / 10}", f"num_training_steps={ns.steps}", f"eval_interval={ns.eval_interval}",
                           "save_interval=0", "export_hf=false", "write_report=false", "resume=none",
                           f"save_dir={save_dir}")
                curves[optimizer, lr] = eval_curve(save_dir)
                print(f"{optimizer:6} lr {lr:<7g} final eval loss {curves[optimizer, lr][-1][1]:.4f}", flush=True)
    best_adamw = min(curves["adamw", lr][-1][1] for lr in grids["adamw"])
    best_muon = min(curves["muon", lr][-1][1] for lr in grids["muon"])
    print(f"\nbest final eval loss: adamw {best_adamw:.4f}, muon {best_muon:.4f}")
    print(f"| optimizer | lr | final eval loss | steps to AdamW's best ({best_adamw:.4f}) |")
    print("|---|---|---|---|")
    for (optimizer, lr), curve in curves.items():
        reached = steps_to_reach(curve, best_adamw)
        where = "never" if reached is None else f"{reached:.0f} ({reached / ns.steps:.2f}x)"
        print(f"| {optimizer} | {lr:g} | {curve[-1][1]:.4f} | {where} |")


if __name__ == "__main__":
    main()
