"""Throughput and memory of every engine on the same model and data, side by side.

Runs the quickstart model (5.0M parameters, seq 256) for a few steps per engine: one process with
micro-batch 8 and 2 threads, and 2 ranks x micro-batch 4 x 1 thread for the others (the same global
batches). Prints useful tokens/s (median of the logged steps after the first), tokens per CPU-second
of the whole process tree (so engines are compared per unit of compute, whatever else the machine
does), the peak memory per rank, and the final loss (equal across engines).

    .venv/bin/python bench/engines.py [--steps 24] [--engines single,ddp,fsdp,deepspeed-zero2,deepspeed-zero3]

Megatron layouts: megatron-tp2, megatron-tp2-sp, megatron-pp2 (1F1B, 2 micro-batches of 4), megatron-dp2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ZERO = {"deepspeed-zero1": 1, "deepspeed-zero2": 2, "deepspeed-zero3": 3}
# The megatron engine's layouts on 2 ranks; each keeps the global batch of 8 sequences per step.
MEGATRON = {
    "megatron-tp2": ["dp=1", "micro_batch_size=8", "plugin_args.tp_degree=2"],
    "megatron-tp2-sp": ["dp=1", "micro_batch_size=8", "plugin_args.tp_degree=2",
                        "plugin_args.sequence_parallelism=true"],
    "megatron-pp2": ["dp=1", "micro_batch_size=4", "gradient_accumulation_steps=2", "plugin_args.pp_degree=2"],
    "megatron-dp2": ["dp=2", "micro_batch_size=4"],
}


def command(engine: str, steps: int, save_dir: Path, work: Path) -> tuple[list, dict]:
    common = ["examples/quickstart.yaml", f"num_training_steps={steps}", "warmup_steps=2", "log_interval=1",
              "eval_interval=0", "eval_split=1", "save_interval=0", "export_hf=false", f"save_dir={save_dir}",
              "resume=none"]
    env = dict(os.environ)
    if engine == "single":
        env["OMP_NUM_THREADS"] = "2"
        return [BIN / "pretrainer", "train", *common], env
    env["OMP_NUM_THREADS"] = "1"
    extra = ["dp=2", "micro_batch_size=4"]
    if engine in MEGATRON:
        extra = [*MEGATRON[engine], "engine=megatron"]
    elif engine in ZERO:
        config = work / f"{engine}.json"
        config.write_text(json.dumps({"zero_optimization": {"stage": ZERO[engine]}}))
        extra.append(f"deepspeed={config}")
    else:
        extra.append(f"engine={engine}")
    return [BIN / "torchrun", "--standalone", "--nproc_per_node", "2", BIN / "pretrainer", "train", *common,
            *extra], env


def run(engine: str, steps: int, work: Path) -> dict:
    save_dir = work / engine
    cmd, env = command(engine, steps, save_dir, work)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    steady = rows[1:]
    tokens = sum(r["step_tokens"] for r in steady)
    seconds = sum(r["elapsed_ms"] for r in steady) / 1000
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    total_tokens = rows[-1]["tokens"]
    return {"engine": engine, "tokens_per_s": tokens / seconds, "tokens_per_cpu_s_run": total_tokens / cpu,
            "median_step_ms": statistics.median(r["elapsed_ms"] for r in steady),
            "peak_mem_mb_per_rank": max(r["peak_mem_mb"] for r in rows), "final_loss": rows[-1]["loss"],
            "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--engines", default="single,ddp,fsdp,deepspeed-zero2,deepspeed-zero3")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(engine, ns.steps, Path(tmp)) for engine in ns.engines.split(",")]
    print(f"{'engine':18} {'tokens/s':>9} {'tok/CPU-s (whole run)':>22} {'step ms':>8} {'peak MB/rank':>13} "
          f"{'final loss':>11} {'wall s':>7}")
    for r in results:
        print(f"{r['engine']:18} {r['tokens_per_s']:9.0f} {r['tokens_per_cpu_s_run']:22.0f} "
              f"{r['median_step_ms']:8.1f} {r['peak_mem_mb_per_rank']:13.0f} {r['final_loss']:11.6f} "
              f"{r['wall_s']:7.1f}")


if __name__ == "__main__":
    main()
