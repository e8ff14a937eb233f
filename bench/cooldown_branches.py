"""Cooldown branches against cosine runs of the same length, on the quickstart model and corpus.

One WSD run (`examples/quickstart.yaml` with lr_decay_style wsd, 1-sqrt decay over its last 20%) is stable
until then; from its checkpoints at 50% and 75% of its steps, a cooldown branch each decays over 20% of its own
total length. Each branch (and the WSD run itself) is set beside a cosine run of the same total steps, as the
quickstart trains it (the same warmup, peak and min_lr, data and seed). Prints the final eval loss of each and
the relative difference; the published result (Hägele et al. 2024) is that a short 1-sqrt cooldown matches
cosine within about 1%. Finally writes the WSD run's report, which draws the branches over it.

    .venv/bin/python bench/cooldown_branches.py [--steps 240] [--work runs/cooldown-bench]
"""

from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path

from common import REPO, metrics, pretrainer

COOLDOWN_SHARE = 0.2   # of a run's total steps
BRANCH_POINTS = (0.5, 0.75)
TOKENS_PER_STEP = 8 * 256  # the quickstart's global batch x seq_length
QUIET = ["downstream_evals=null", "export_hf=false", "log_interval=40", "eval_interval=1000000"]


def final_eval_loss(save_dir: Path) -> float:
    return [row["eval_loss"] for row in metrics(save_dir) if "eval_loss" in row][-1]


def train(*overrides) -> None:
    pretrainer("train", "examples/quickstart.yaml", *QUIET, *overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--work", default="runs/cooldown-bench")
    ns = parser.parse_args()
    work = REPO / ns.work
    shutil.rmtree(work, ignore_errors=True)
    steps, decay = ns.steps, round(COOLDOWN_SHARE * ns.steps)
    points = [round(share * steps) for share in BRANCH_POINTS]
    wsd = work / "wsd"
    train(f"num_training_steps={steps}", "lr_decay_style=wsd", "wsd_decay_shape=1-sqrt",
          f"wsd_decay_tokens={decay * TOKENS_PER_STEP}", f"save_interval={math.gcd(*points)}", f"save_dir={wsd}")
    results = []
    for point in points:
        length = round(point / (1 - COOLDOWN_SHARE))        # the branch's total steps: cooldown = 20% of them
        cooldown = length - point
        branch = wsd / "branches" / f"cooldown-step-{point}"
        train(f"num_training_steps={steps}", "lr_decay_style=wsd", "wsd_decay_shape=1-sqrt",
              f"cooldown_from={wsd}/checkpoints/step-{point}", f"cooldown_tokens={cooldown * TOKENS_PER_STEP}",
              f"save_dir={branch}")
        results.append((f"branch from step {point}, cooldown {cooldown} steps", length, branch))
    results.append((f"WSD run, decay {decay} steps", steps, wsd))
    print(f"{'run':42} {'steps':>5} {'tokens':>9} {'WSD eval loss':>13} {'cosine eval loss':>16} {'difference':>10}")
    for name, length, folder in results:
        cosine = work / f"cosine-{length}"
        train(f"num_training_steps={length}", f"save_interval={length}", f"save_dir={cosine}")
        ours, reference = final_eval_loss(folder), final_eval_loss(cosine)
        print(f"{name:42} {length:>5} {length * TOKENS_PER_STEP:>9,} {ours:>13.4f} {reference:>16.4f} "
              f"{(ours - reference) / reference:>+10.2%}")
    print(pretrainer("report", wsd).strip())


if __name__ == "__main__":
    main()
