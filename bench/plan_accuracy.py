"""Predicted vs measured peak memory per rank, on this CPU.

For Llama models of three sizes (random init from a config.json, the quickstart's tokenizer and corpus) and
each layout below, with and without full recomputation, a short `pretrainer train` records both figures
(`predicted_peak_mem_mb` in its start row: the plan made before building the model; `peak_mem_mb`: the largest
rank's peak RSS). Prints the table and the error of each prediction.

    .venv/bin/python bench/plan_accuracy.py [--sizes S M L] [--layouts single ddp ...] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import BIN, REPO, metrics

SIZES = {  # hidden, ffn, layers, heads, kv heads
    "S": (256, 688, 4, 4, 2),
    "M": (512, 1376, 8, 8, 4),
    "L": (768, 2048, 12, 12, 4),
}
ACCUMULATING = ["micro_batch_size=1", "gradient_accumulation_steps=4"]
LAYOUTS = {  # processes, overrides
    "single": (1, ["engine=single", "dp=1"]),
    "ddp": (2, ["engine=ddp", "dp=2"]),
    "fsdp": (2, ["engine=fsdp", "dp=2"]),
    "zero2": (2, ["engine=deepspeed", "dp=2", "deepspeed={zero_optimization: {stage: 2}}"]),
    "zero3": (2, ["engine=deepspeed", "dp=2", "deepspeed={zero_optimization: {stage: 3}}"]),
    "tp2": (2, ["engine=megatron", "dp=1", "plugin_args.tp_degree=2"]),
    "pp2": (2, ["engine=megatron", "dp=1", "plugin_args.pp_degree=2", "gradient_accumulation_steps=2"]),
    # 4 ranks, 4 micro-batches of 1 per step: whole gradients while they accumulate, or sharded ones
    "fsdp4-unsharded": (4, ["engine=fsdp", "dp=4", *ACCUMULATING, "accumulate_gradients=unsharded"]),
    "fsdp4-sharded": (4, ["engine=fsdp", "dp=4", *ACCUMULATING, "accumulate_gradients=sharded"]),
    # the megatron engine's data-parallel sharding: parameters gathered from forward to backward, or resharded
    "optim-grads4": (4, ["engine=megatron", "dp=4", "plugin_args.data_parallel_sharding_strategy=optim_grads"]),
    "optim-grads-params4": (4, ["engine=megatron", "dp=4",
                                "plugin_args.data_parallel_sharding_strategy=optim_grads_params"]),
}
RECOMPUTE = ("none", "full")


def model_folder(root: Path, size: str) -> Path:
    hidden, ffn, layers, heads, kv = SIZES[size]
    folder = root / f"llama-{size}"
    shutil.copytree(REPO / "examples/models/tiny-llama", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=hidden // heads)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def run(folder: Path, processes: int, overrides: list[str], recompute: str, steps: int, save_dir: Path) -> dict:
    common = ["examples/quickstart.yaml", f"model_path={folder}", f"save_dir={save_dir}", f"num_training_steps={steps}",
              "warmup_steps=0", "eval_interval=null", "save_interval=null", "export_hf=false", "write_report=false",
              "log_interval=1", "micro_batch_size=4", "seq_length=256", f"activation_checkpointing={recompute}"]
    given = {o.split("=", 1)[0] for o in overrides}  # a layout's own value replaces the common one
    common = [o for o in common if o.split("=", 1)[0] not in given] + overrides
    if processes == 1:
        command = [BIN / "pretrainer", "train", *common]
    else:
        command = [BIN / "torchrun", "--standalone", "--nproc_per_node", str(processes), BIN / "pretrainer", "train",
                   *common]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // processes))}
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if "error:" in line] or done.stderr.splitlines()[-1:]
        return {"error": errors[-1].strip()[:200] if errors else "failed"}
    rows = metrics(save_dir)
    start = next(r for r in rows if r.get("event") == "start")
    measured = max(r.get("peak_mem_mb", 0) for r in rows if "peak_mem_mb" in r)
    return {"predicted": start["predicted_peak_mem_mb"], "measured": measured, "parameters": start["parameters"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--recompute", nargs="+", default=list(RECOMPUTE), choices=list(RECOMPUTE))
    parser.add_argument("--steps", type=int, default=4)
    ns = parser.parse_args()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = sorted(set(re.findall(r"\b(amx_bf16|avx512_bf16|avx512f|avx2)\b", lscpu)))
    print(f"CPU: {lscpu.split('Model name:')[1].splitlines()[0].strip()} ({', '.join(flags)})")
    print(f"{'model':<14}{'layout':<8}{'recompute':<10}{'predicted MB':>13}{'measured MB':>12}{'error':>8}")
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for size in ns.sizes:
            folder = model_folder(root, size)
            for name in ns.layouts:
                processes, overrides = LAYOUTS[name]
                for recompute in ns.recompute:
                    save_dir = root / f"run-{size}-{name}-{recompute}"
                    result = run(folder, processes, overrides, recompute, ns.steps, save_dir)
                    label = f"{size} ({result.get('parameters', 0) / 1e6:.0f}M)" if "parameters" in result else size
                    if "error" in result:
                        print(f"{label:<14}{name:<8}{recompute:<10}  failed: {result['error']}")
                        continue
                    error = (result["predicted"] - result["measured"]) / result["measured"]
                    errors.append(abs(error))
                    print(f"{label:<14}{name:<8}{recompute:<10}{result['predicted']:>13,.0f}{result['measured']:>12,.0f}"
                          f"{error:>+8.1%}", flush=True)
    if errors:
        print(f"largest error {max(errors):.1%}, mean {sum(errors) / len(errors):.1%} over {len(errors)} runs")
    sys.exit(0)


if __name__ == "__main__":
    main()
