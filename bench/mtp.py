"""Multi-token prediction on the quickstart corpus: main-head eval loss at equal tokens, and tokens/s, with
D = 0, 1 and 2 depths (`mtp_num_layers`).

The 25M Llama of bench/vs_hf_trainer.py (hidden 512, 8 layers, vocabulary 4096; the same initial weights for
every run) trains `--steps` steps of 8 x `--seq` tokens on examples/data/python_docs.jsonl with the
quickstart's schedule (AdamW, lr 2e-3 to 2e-4, cosine, fp32, one process), 5% of the documents held out. Every
run sees the same tokens in the same order; the eval loss is the main head's (the depths never take part in
evaluation). Prints, per D: the parameters trained, the median tokens/s after the first steps and its ratio
to D = 0, the final train loss, the MTP loss per depth and its top-1 accuracy, and the main-head eval loss.

    .venv/bin/python bench/mtp.py [--steps 60] [--seq 256] [--depths 0,1,2] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import BIN, REPO, metrics
from vs_hf_trainer import CORPUS, pretrainer_config, write_model

SKIP = 3  # steps of warm-up left out of the median


def run(depths: int, steps: int, seq: int, work: Path, threads: int) -> dict:
    save_dir = work / f"mtp-{depths}"
    config = pretrainer_config(work / f"mtp-{depths}.yaml", work / "model", seq, steps, save_dir, 8,
                               train_data=str(CORPUS), eval_split=0.05, eval_interval=steps, eval_iters=10,
                               lr=2e-3, min_lr=2e-4, warmup_steps=min(10, steps // 2), export_hf=False,
                               mtp_num_layers=depths)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([str(BIN / "pretrainer"), "train", str(config)], cwd=REPO, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"D={depths} failed:\n{done.stderr[-3000:]}")
    rows = metrics(save_dir)
    train = [r for r in rows if "loss" in r and "step" in r]
    return {"parameters": next(r["parameters"] for r in rows if "parameters" in r),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[SKIP:]),
            "loss": train[-1]["loss"], "eval_loss": [r for r in rows if "eval_loss" in r][-1]["eval_loss"],
            "mtp": [(train[-1][f"mtp_loss/{k}"], train[-1][f"mtp_acc/{k}"]) for k in range(1, depths + 1)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--depths", default="0,1,2")
    parser.add_argument("--threads", type=int, default=2)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_model(work / "model", "25m")
        results = {d: run(d, ns.steps, ns.seq, work, ns.threads) for d in map(int, ns.depths.split(","))}
        base = results[min(results)]["tokens_per_s"]
        print(f"{ns.steps} steps x 8 x {ns.seq} tokens = {ns.steps * 8 * ns.seq:,} tokens per run")
        print(f"{'D':>2} {'parameters':>11} {'tokens/s':>9} {'vs D=0':>7} {'train loss':>11} {'eval loss':>10}  "
              "MTP loss / top-1 accuracy per depth")
        for depths, r in results.items():
            per_depth = "  ".join(f"{loss:.3f} / {acc:.3f}" for loss, acc in r["mtp"]) or "-"
            print(f"{depths:>2} {r['parameters']:>11,} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base:>7.2f} "
                  f"{r['loss']:>11.4f} {r['eval_loss']:>10.4f}  {per_depth}")


if __name__ == "__main__":
    main()
