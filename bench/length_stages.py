"""Sequence-length stages on CPU: a short-sequence warmup and a context grown in stages, beside fixed-length runs
of the same tokens.

    .venv/bin/python bench/length_stages.py [--steps 100] [--jobs 2] [--folder runs/bench/length-stages]

Every run is `examples/quickstart.yaml` (fp32, one thread per run), 2,048 tokens per update, warmup 10 steps then
cosine, ending with an evaluation on held-out windows at the run's `seq_length`:
  fixed-256    seq_length 256 throughout
  warmup       64 for the first 40% of the tokens, then 256 (a 2-stage warmup)
  fixed-1024   seq_length 1024 throughout, YaRN x2 from the start (the model has 512 positions)
  growth       256 for 60% of the tokens, 512 for 20%, then 1024 with YaRN x2 (a 3-stage context growth)
For each: tokens/s in each stage (the mean of its rows), the wall time, and the final eval loss.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

from common import REPO, metrics, pretrainer

TOKENS_PER_STEP = 2048
YARN = "{rope_type: yarn, factor: 2}"


def runs(steps: int) -> dict[str, list[str]]:
    total = steps * TOKENS_PER_STEP
    at = lambda share: int(total * share)  # noqa: E731 - a stage boundary in tokens
    return {
        "fixed-256": ["seq_length=256", "micro_batch_size=8"],
        "warmup": ["seq_length=256", "micro_batch_size=8",
                   f"seq_length_schedule=[{{until_tokens: {at(0.4)}, seq_length: 64}}, {{seq_length: 256}}]"],
        "fixed-1024": ["seq_length=1024", "micro_batch_size=2", f"rope_scaling={YARN}"],
        "growth": ["seq_length=1024", "micro_batch_size=2",
                   f"seq_length_schedule=[{{until_tokens: {at(0.6)}, seq_length: 256}}, {{until_tokens: {at(0.8)}, "
                   f"seq_length: 512}}, {{seq_length: 1024, rope_scaling: {YARN}}}]"],
    }


def train(job: tuple[str, list[str], int, Path]) -> dict:
    name, keys, steps, folder = job
    save_dir = folder / name
    start = time.perf_counter()
    pretrainer("train", "examples/quickstart.yaml", f"num_training_steps={steps}", "warmup_steps=10",
               "log_interval=5", "eval_interval=0", "save_interval=0", "downstream_evals=null", "export_hf=false",
               "write_report=false", "resume=none", "eval_iters=10", f"save_dir={save_dir}", *keys)
    seconds = time.perf_counter() - start
    rows = metrics(save_dir)
    stages: dict[int, list[float]] = {}
    for row in rows:
        if "tokens_per_s" in row:
            stages.setdefault(row["seq_length"], []).append(row["tokens_per_s"])
    final = [row for row in rows if "eval_loss" in row][-1]
    return {"run": name, "wall_s": round(seconds, 1), "eval_loss": final["eval_loss"],
            "eval_seq_length": final["seq_length"], "tokens": [row for row in rows if "tokens" in row][-1]["tokens"],
            "tokens_per_s": {length: round(statistics.mean(values)) for length, values in stages.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--folder", type=Path, default=REPO / "runs" / "bench" / "length-stages")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # one core per run, --jobs runs at once
    jobs = [(name, keys, args.steps, args.folder) for name, keys in runs(args.steps).items()]
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        results = pool.map(train, jobs)
    print(f"{'run':<12}{'tokens':>10}{'wall s':>9}{'eval loss':>11}  tokens/s by seq_length")
    for result in results:
        speeds = ", ".join(f"{length}: {speed:,}" for length, speed in sorted(result["tokens_per_s"].items(),
                                                                              key=lambda item: int(item[0])))
        print(f"{result['run']:<12}{result['tokens']:>10,}{result['wall_s']:>9}{result['eval_loss']:>11.4f}  "
              f"{speeds} (eval at {result['eval_seq_length']})")
    (args.folder / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
