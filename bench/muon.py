"""Step time of Muon against AdamW, on one process and on 2 FSDP ranks.

The 25M Llama of bench/vs_hf_trainer.py (hidden 512, 8 layers, seq 512, micro-batch 8) trains a few steps
with each optimizer, on the quickstart corpus, in fp32: one process with 2 threads, then 2 FSDP ranks x 1
thread (micro-batch 4 each, the same global batch). Prints the median step time after the first steps, the
ratio Muon / AdamW and the final loss. On 2 FSDP ranks Muon gathers each matrix's update whole and every rank
runs the Newton-Schulz iteration on it (optim/muon.py), so its extra time there is the gathers plus the whole
iteration on each rank.

    .venv/bin/python bench/muon.py [--steps 12] [--layouts single,fsdp]
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


def run(layout: str, optimizer: str, steps: int, work: Path, model: Path, seq: int) -> dict:
    save_dir = work / f"{layout}-{optimizer}"
    micro = 8 if layout == "single" else 4
    config = pretrainer_config(work / f"{layout}-{optimizer}.yaml", model, seq, steps, save_dir, micro,
                               train_data=str(CORPUS), optimizer=optimizer, export_hf=False,
                               dp=1 if layout == "single" else 2, engine=layout)
    env = {**os.environ, "OMP_NUM_THREADS": "2" if layout == "single" else "1"}
    command = [BIN / "pretrainer", "train", config]
    if layout != "single":
        command = [BIN / "torchrun", "--standalone", "--nproc_per_node", "2", *command]
    done = subprocess.run([str(c) for c in command], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{layout} {optimizer} failed:\n{done.stderr[-3000:]}")
    rows = [r for r in metrics(save_dir) if "loss" in r]
    return {"step_ms": statistics.median(r["elapsed_ms"] for r in rows[SKIP:]), "loss": rows[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layouts", default="single,fsdp")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        seq = write_model(work / "model", "25m")
        print(f"{'layout':8} {'optimizer':9} {'median step ms':>15} {'vs adamw':>9} {'final loss':>11}")
        for layout in ns.layouts.split(","):
            # the two optimizers alternate (adamw, muon, adamw, muon) so a change of machine load hits both
            results = {o: [] for o in ("adamw", "muon")}
            for optimizer in ("adamw", "muon", "adamw", "muon"):
                results[optimizer].append(run(layout, optimizer, ns.steps, work, work / "model", seq))
            adamw = min(r["step_ms"] for r in results["adamw"])
            for optimizer, rows in results.items():
                best = min(r["step_ms"] for r in rows)
                print(f"{layout:8} {optimizer:9} {best:15.0f} {best / adamw:9.2f} {rows[-1]['loss']:11.4f}")


if __name__ == "__main__":
    main()
