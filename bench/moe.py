"""Mixture-of-Experts throughput: the experts' implementations, and one process against 2 data-parallel ranks.

Trains examples/models/tiny-qwen3-moe (4 layers x 8 experts, top-2) for a few steps on the quickstart corpus,
fp32, with each `moe_experts_implementation` on one process (2 threads; `eager` is transformers' reference
loop over the experts), then with the fastest on 2 ranks of ddp, fsdp, fsdp with expert parallelism (`fsdp-ep2`:
each rank holds 4 of the 8 experts and tokens go to them all-to-all), the megatron engine with expert parallelism
(`megatron-ep2`) and with tensor parallelism (`megatron-tp2`: sequence parallel, each rank routes half of every
sequence through whole MoE blocks), 1 thread each, the same global batch. Prints tokens/s (median step after the
first steps), the peak memory per rank from metrics.jsonl and the last loss (every run computes the same model:
equal losses are expected).

bench/gpu_check.sh runs this script on one GPU (bf16, one process: `--engines ''`).

    .venv/bin/python bench/moe.py [--steps 12] [--seq 256] [--micro 8] [--engines ddp,fsdp,fsdp-ep2,...] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from common import REPO, metrics

MODEL = REPO / "examples" / "models" / "tiny-qwen3-moe"
SKIP = 3  # steps of warm-up left out of the median
TP2 = {"engine": "megatron", "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}}
TWO_RANKS = {  # name: (config keys, tensor-parallel degree)
    "ddp": ({"engine": "ddp"}, 1), "fsdp": ({"engine": "fsdp"}, 1),
    "fsdp-ep2": ({"engine": "fsdp", "expert_parallel_degree": 2}, 1),
    "megatron-ep2": ({"engine": "megatron", "expert_parallel_degree": 2}, 1),
    "megatron-tp2": (TP2, 2),
}


def train(name: str, work: Path, steps: int, seq: int, micro: int, ranks: int, dtype: str, tp: int = 1,
          **keys) -> dict:
    save_dir = work / name
    replicas = ranks // tp
    config = {"num_training_steps": steps, "micro_batch_size": micro // replicas, "dp": replicas, "seq_length": seq,
              "dtype": dtype, "model_path": str(MODEL), "tokenizer_path": str(REPO / "examples/models/tiny-llama"),
              "train_data": str(REPO / "examples/data/python_docs.jsonl"), "lr": 2e-3, "warmup_steps": 2,
              "eval_interval": 0, "save_interval": 0, "export_hf": False, "write_report": False,
              "save_dir": str(save_dir), "seed": 42, "moe_z_loss_coeff": 1e-3, **keys}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "pretrainer.cli", "train", path]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   "-m", "pretrainer.cli", "train", path]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // ranks))}
    done = subprocess.run([str(c) for c in command], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [r for r in metrics(save_dir) if "loss" in r]
    start = next(r for r in metrics(save_dir) if r.get("event") == "start")
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[SKIP:]),
            "peak_mem_mb": max(r["peak_mem_mb"] for r in rows), "loss": rows[-1]["loss"],
            "experts": start.get("experts_implementation"), "imbalance": rows[-1].get("moe_load_imbalance")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8, help="sequences per step (split over the ranks)")
    parser.add_argument("--engines", default=",".join(TWO_RANKS), help="2-rank runs after one process, of "
                        f"{', '.join(TWO_RANKS)} ('' for none: one GPU)")
    parser.add_argument("--dtype", default="fp32")
    ns = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for implementation in ("eager", "batched_mm", "grouped_mm"):
            results[f"single {implementation}"] = train(f"single-{implementation}", work, ns.steps, ns.seq, ns.micro,
                                                        1, ns.dtype, moe_experts_implementation=implementation)
        fastest = max((k for k in results), key=lambda k: results[k]["tokens_per_s"]).split()[1]
        for engine in filter(None, ns.engines.split(",")):
            if engine not in TWO_RANKS:
                sys.exit(f"--engines: {engine!r} is not one of {', '.join(TWO_RANKS)}")
            keys, tp = TWO_RANKS[engine]
            results[f"{engine} x2 {fastest}"] = train(f"{engine}-{fastest}", work, ns.steps, ns.seq, ns.micro, 2,
                                                      ns.dtype, tp, moe_experts_implementation=fastest, **keys)
    eager = results["single eager"]["tokens_per_s"]
    print(f"tiny-qwen3-moe, {ns.micro} x {ns.seq} tokens per step, {ns.dtype}, {ns.steps} steps (median after {SKIP})")
    print(f"{'run':24} {'experts':11} {'tokens/s':>9} {'vs eager':>9} {'peak MB/rank':>13} {'last loss':>10}")
    for name, r in results.items():
        print(f"{name:24} {r['experts']:11} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / eager:8.2f}x "
              f"{r['peak_mem_mb']:13.0f} {r['loss']:10.4f}")


if __name__ == "__main__":
    main()
