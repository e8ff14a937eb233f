"""Longer contexts on CPU: what the chunked loss saves, and how RoPE scaling carries a model past its
positions.

    .venv/bin/python bench/long_context.py [--part memory|scaling|both] [--folder DIR]
        [--pretrain-steps 300] [--steps 40]

memory: the quickstart model's layers with a 32,768-row vocabulary, seq 4096, micro-batch 1, 3 steps, with
    `loss_chunk_size: 0` (whole logits) and `auto` (chunks of 64 MB of logits): peak RSS of the process
    (the run's own `peak_mem_mb`) and the median step time.
scaling: the quickstart model with max_position_embeddings 256 is pretrained at 256 tokens on CPython's
    documentation (the last 300 documents held out); then, with `rope_scaling` linear x4 and yarn x4, it
    continues for --steps steps at 1024 tokens. Held-out loss per token on 1024-token windows before and
    after, next to its loss on 256-token windows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from common import REPO, metrics, pretrainer

QUICKSTART = REPO / "examples" / "models" / "tiny-llama"
CORPUS = REPO / "examples" / "data" / "python_docs.jsonl"
HELD_OUT = 300


def model_copy(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QUICKSTART / name, folder / name)
    config = json.loads((QUICKSTART / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}, indent=2))
    return folder


def memory(folder: Path) -> None:
    model = model_copy(folder / "model-16k", vocab_size=32768, max_position_embeddings=4096)
    rows = []
    for setting in ("0", "auto"):
        save_dir = folder / f"memory-{setting}"
        shutil.rmtree(save_dir, ignore_errors=True)
        pretrainer("train", "examples/quickstart.yaml", f"model_path={model}", "seq_length=4096",
                   "micro_batch_size=1", "num_training_steps=3", "warmup_steps=1", "eval_interval=0",
                   "save_interval=0", "export_hf=false", "write_report=false", "log_interval=1",
                   f"loss_chunk_size={setting}", f"save_dir={save_dir}")
        steps = [row for row in metrics(save_dir) if "loss" in row]
        rows.append((setting, max(row["peak_mem_mb"] for row in steps),
                     statistics.median(row["elapsed_ms"] for row in steps[1:]), steps[-1]["loss"]))
    print("seq 4096, vocabulary 32,768, micro-batch 1 (fp32 logits of a micro-batch: 512 MB)\n")
    print("| loss_chunk_size | peak RSS | step time | loss, step 3 |")
    print("|---|---|---|---|")
    for setting, peak, ms, loss in rows:
        print(f"| {setting} | {peak:,.0f} MB | {ms / 1000:.2f} s | {loss:.4f} |")
    print()


def held_out_loss(model_folder: Path, seq: int, rope: dict | None, windows: int = 24) -> float:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_folder)
    if rope:
        config.rope_parameters = {"rope_theta": 10000.0, **rope}
        config.max_position_embeddings = max(config.max_position_embeddings, seq)
    model = AutoModelForCausalLM.from_pretrained(model_folder, config=config).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    ids = []
    for line in CORPUS.read_text(encoding="utf-8").splitlines()[-HELD_OUT:]:
        ids += [tokenizer.bos_token_id, *tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"],
                tokenizer.eos_token_id]
    tokens = torch.tensor(ids[:windows * seq + 1])
    total = count = 0.0
    with torch.no_grad():
        for start in range(0, windows * seq, seq):
            window = tokens[start:start + seq + 1]
            logits = model(window[None, :-1]).logits[0]
            total += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
            count += seq
    return total / count


def scaling(folder: Path, pretrain_steps: int, steps: int) -> None:
    train = folder / "train.jsonl"
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    train.write_text("\n".join(lines[:-HELD_OUT]) + "\n", encoding="utf-8")
    base = folder / "base-256"
    common = ["dtype=fp32", "micro_batch_size=8", "lr=2e-3", "min_lr=2e-4", "eval_interval=0", "save_interval=0",
              "write_report=false", "seed=42", "eval_split=0", f"train_data={train}"]
    if not (base / "hf" / "config.json").is_file():
        print(f"pretraining at 256 tokens for {pretrain_steps} steps ...", flush=True)
        model = model_copy(folder / "model-256", max_position_embeddings=256)
        pretrainer("train", "examples/quickstart.yaml", *common, f"model_path={model}", "seq_length=256",
                   f"num_training_steps={pretrain_steps}", "warmup_steps=30", f"save_dir={base}")
    start_256 = held_out_loss(base / "hf", 256, None)
    rows = []
    for kind in ("linear", "yarn"):
        rope = {"rope_type": kind, "factor": 4.0}
        before = held_out_loss(base / "hf", 1024, rope if kind == "linear" else
                               {**rope, "original_max_position_embeddings": 256})
        save_dir = folder / f"continue-{kind}"
        shutil.rmtree(save_dir, ignore_errors=True)
        print(f"continuing with {kind} x4 at 1024 tokens for {steps} steps ...", flush=True)
        pretrainer("train", "examples/quickstart.yaml", *common, f"model_path={base / 'hf'}", "seq_length=1024",
                   "micro_batch_size=2", f"rope_scaling={{rope_type: {kind}, factor: 4}}",
                   f"num_training_steps={steps}", "warmup_steps=5", "lr=5e-4", "min_lr=5e-5", f"save_dir={save_dir}")
        rows.append((kind, before, held_out_loss(save_dir / "hf", 1024, None)))
    print(f"\nheld-out loss per token; the model was pretrained at 256 tokens: {start_256:.3f} on 256-token windows\n")
    print(f"| rope_scaling | 1024-token windows, before | after {steps} steps at 1024 |")
    print("|---|---|---|")
    for kind, before, after in rows:
        print(f"| {kind} x4 | {before:.3f} | {after:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["memory", "scaling", "both"], default="both")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/pretrainer-bench-long-context"))
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=40)
    ns = parser.parse_args()
    ns.folder.mkdir(parents=True, exist_ok=True)
    if ns.part in ("memory", "both"):
        memory(ns.folder)
    if ns.part in ("scaling", "both"):
        scaling(ns.folder, ns.pretrain_steps, ns.steps)


if __name__ == "__main__":
    main()
