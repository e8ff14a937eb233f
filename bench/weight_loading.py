"""Host memory of loading an HF checkpoint on 2 ranks: each rank reading its own slices (DeepSpeed ZeRO-3:
partitioning module by module) vs every rank loading the whole model.

A ~150M-parameter Llama with random weights is saved in bf16 as several safetensors shards (with the index
json). For each layout, `pretrainer train` runs twice from it, `sliced_weight_loading: true` and `false`; the
table shows the largest rank's peak RSS once the model is laid out (`model_ready_peak_rss_mb`: the engine set
up, before the first step; DeepSpeed's initialize allocates its fp32 partitions and Adam moments here) for
both, and for the sliced run the peak RSS right after the weights are in (`weights_loaded_peak_rss_mb`),
next to one full fp32 copy of the model and the runtime baseline (the peak RSS of a tiny run, which every
process pays). It also checks that both runs give the same
per-step losses and export the same files, byte for byte.

    .venv/bin/python bench/weight_loading.py [--layouts fsdp tp2 pp2 zero3] [--steps 2]

On 2 cores the four layouts take over 10 minutes (`--layouts fsdp` about 3); the temporary folder holds the
model (0.3 GB) and one run's checkpoint at a time (about 2.4 GB), removed as the table is printed.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from common import BIN, REPO, metrics

LAYOUTS = {
    "fsdp": ["engine=fsdp", "dp=2"],
    "tp2": ["engine=megatron", "dp=1", "plugin_args.tp_degree=2"],
    "pp2": ["engine=megatron", "dp=1", "plugin_args.pp_degree=2", "gradient_accumulation_steps=2"],
    "zero3": ["deepspeed={root}/zero3.json", "dp=2"],
}
SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=14,
             num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
             tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def write_checkpoint(folder: Path) -> int:
    """The model saved in bf16 as 200 MB shards beside the quickstart tokenizer; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "examples/models/tiny-llama" / name, folder / name)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="200MB")
    return sum(p.numel() for p in model.parameters())


def run(folder: Path, overrides: list[str], sliced: bool, steps: int, save_dir: Path) -> list[dict]:
    command = [BIN / "torchrun", "--standalone", "--nproc_per_node", "2", BIN / "pretrainer", "train",
               "examples/quickstart.yaml", f"model_path={folder}", f"save_dir={save_dir}",
               f"num_training_steps={steps}", "warmup_steps=0", "eval_interval=null", "save_interval=null",
               "write_report=false", "log_interval=1", "dtype=fp32", "micro_batch_size=1", "seq_length=128",
               f"sliced_weight_loading={str(sliced).lower()}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # its own session: an interrupted bench stops torchrun's workers too, not torchrun alone
    process = subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=REPO, env=env, start_new_session=True)
    try:
        _, stderr = process.communicate()
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    if process.returncode:
        sys.exit(f"{' '.join(overrides)} sliced={sliced} failed:\n{stderr[-3000:]}")
    shutil.rmtree(save_dir / "checkpoints", ignore_errors=True)  # 2.4 GB each; the metrics and hf/ are compared
    return metrics(save_dir)


def same_export(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=2)
    ns = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from pretrainer.plan.device_spec import runtime_baseline

    baselines = {kind: runtime_baseline(kind) / 2**20 for kind in ("single", "deepspeed")}
    baseline = baselines["single"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        parameters = write_checkpoint(root / "model")
        (root / "zero3.json").write_text('{"zero_optimization": {"stage": 3}}')
        files = sorted(p.name for p in (root / "model").glob("*.safetensors"))
        fp32 = parameters * 4 / 2**20
        print(f"model: {parameters / 1e6:.0f}M parameters, bf16 in {len(files)} safetensors files; one fp32 copy "
              f"{fp32:,.0f} MB; runtime baseline {baseline:,.0f} MB ({baselines['deepspeed']:,.0f} MB with "
              f"DeepSpeed); target: at load <= 0.6 x fp32 + baseline = {0.6 * fp32 + baseline:,.0f} MB")
        print(f"{'layout':<8}{'whole MB':>10}{'sliced MB':>11}{'at load MB':>12}{'load - baseline':>17}"
              f"{'/ fp32':>8}{'losses':>9}{'export':>9}")
        for name in ns.layouts:
            rows = {}
            for sliced in (False, True):
                overrides = [o.format(root=root) for o in LAYOUTS[name]]
                rows[sliced] = run(root / "model", overrides, sliced, ns.steps, root / f"{name}-{sliced}")
            starts = {k: next(r for r in v if r.get("event") == "start") for k, v in rows.items()}
            peak = {k: start["model_ready_peak_rss_mb"] for k, start in starts.items()}
            at_load = starts[True]["weights_loaded_peak_rss_mb"]
            baseline = baselines["deepspeed" if name.startswith("zero") else "single"]
            losses = {k: [r["loss"] for r in v if "loss" in r and "event" not in r] for k, v in rows.items()}
            export = same_export(root / f"{name}-False" / "hf", root / f"{name}-True" / "hf")
            for sliced in (False, True):
                shutil.rmtree(root / f"{name}-{sliced}")
            print(f"{name:<8}{peak[False]:>10,.0f}{peak[True]:>11,.0f}{at_load:>12,.0f}{at_load - baseline:>17,.0f}"
                  f"{(at_load - baseline) / fp32:>8.2f}{'same' if losses[True] == losses[False] else 'DIFFER':>9}"
                  f"{'same' if export else 'DIFFER':>9}", flush=True)


if __name__ == "__main__":
    main()
