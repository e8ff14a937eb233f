"""pretrainer next to the seeds' Hugging Face Trainer flow, on the same model, data and settings.

    .venv/bin/pip install -e '.[bench]'        # datasets, for the HF flow
    .venv/bin/python bench/vs_hf_trainer.py [--size tiny|25m] [--threads 1] [--steps 30] [--repeats 2]
        [--dtype fp32|bf16] [--flows FLOW[@DTYPE],...]

Flows, each a fresh process, run in alternation (`--repeats` rounds), in `--dtype` (fp32 default; bf16: the
HF Trainer with `bf16=True`, pretrainer with `dtype: bf16`, fp32 master weights in both) or the dtype a flow
names (`pretrainer@fp32,pretrainer@bf16,hf-trainer@bf16`: several dtypes side by side in one run), same
initial weights, AdamW
(lr 3e-4, betas 0.9/0.95, weight decay 0.1, clip 1.0, cosine with 3 warmup steps), micro-batch 8, no
accumulation, no evaluation:

- `hf-trainer`: `run_clm.py`/`pretrain_clm.py` style: `datasets.map` tokenize + `group_texts` into blocks of
  `seq` tokens (cache warmed by an untimed first run), `Trainer`, `save_model` at the end.
- `pretrainer`: `pretrainer train` from data prepared once with `pretrainer prepare` (the final checkpoint
  with optimizer state and the HF export are part of its run).
- `pretrainer-compile`: the same with `compile: true`.
- `pretrainer-glibc-malloc` (not run by default): the same with `host_malloc_reuse: false`.
- `seed-padded-alpaca`: the seed's JSON flow (alpaca records, each padded to `seq`, through `PreTrainer`
  with a DataLoader), and `pretrainer-packed-alpaca`: the same records packed by pretrainer. The records
  are made from the shipped corpus with the shape of Stanford alpaca's (a one-line instruction, an answer of
  roughly 30-250 tokens).

Printed per flow: steady-state useful (non-padding) tokens/s (steps 6 onward, median over rounds), MFU
against this machine's measured GEMM peak in the flow's dtype at the same thread count, the whole run's wall
time from launch to exit, and the process tree's peak RSS; the header names the CPU and its bf16 matrix flags.
With several dtypes, each flow's tokens/s is also given against `pretrainer@fp32` (when run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

from common import REPO, measure

BIN = Path(sys.executable).parent
TOKENIZER = REPO / "examples" / "models" / "tiny-llama"
CORPUS = REPO / "examples" / "data" / "python_docs.jsonl"
SIZES = {  # name: (LlamaConfig overrides, seq)
    "tiny": ({}, 256),  # the quickstart model, 5.0M parameters
    "25m": ({"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8,
             "num_key_value_heads": 8, "max_position_embeddings": 512}, 512),
}
WARMUP_STEPS = 5
OPTIM = {"lr": 3e-4, "warmup": 3, "weight_decay": 0.1, "beta2": 0.95, "clip": 1.0}

HF_TRAINER = textwrap.dedent('''
    import json, sys, time
    import torch
    from datasets import load_dataset
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments,
                              default_data_collator)
    model_dir, corpus, cache, out, seq, mbs, steps, timings = sys.argv[1:9]
    seq, mbs, steps = int(seq), int(mbs), int(steps)
    optim = json.loads(sys.argv[9])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def tokenize(batch):
        return tokenizer(batch["text"])

    def group_texts(batch):
        ids = [t for row in batch["input_ids"] for t in row]
        n = len(ids) // seq * seq
        blocks = [ids[i:i + seq] for i in range(0, n, seq)]
        return {"input_ids": blocks, "attention_mask": [[1] * seq for _ in blocks], "labels": [b[:] for b in blocks]}

    raw = load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
    data = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    data = data.map(group_texts, batched=True, remove_columns=data.column_names)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=mbs, max_steps=steps,
                             learning_rate=optim["lr"], lr_scheduler_type="cosine", warmup_steps=optim["warmup"],
                             weight_decay=optim["weight_decay"], adam_beta2=optim["beta2"],
                             max_grad_norm=optim["clip"], logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, seed=42, dataloader_num_workers=0, disable_tqdm=True,
                             bf16=optim.get("dtype") == "bf16")
    marks = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                      callbacks=[Clock()])
    trainer.train()
    trainer.save_model(out + "/hf")
    json.dump({"marks": marks, "tokens_per_step": mbs * seq}, open(timings, "w"))
''')

SEED_PADDED = textwrap.dedent('''
    import json, sys, time
    import torch
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq
    from pretrainer import PreTrainer, PreTrainingArguments
    from pretrainer.data.readers import record_to_text
    config, alpaca, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
    args = PreTrainingArguments.from_yaml(config)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    records = json.load(open(alpaca))
    # the seed's JSON flow: one sample per record, truncated and padded to seq_length
    samples = [tokenizer(record_to_text(r, "", "text") + tokenizer.eos_token, max_length=seq, truncation=True,
                         padding="max_length") for r in records]
    for s in samples:
        s["labels"] = [t if m else -100 for t, m in zip(s["input_ids"], s["attention_mask"])]
    loader = torch.utils.data.DataLoader(samples, batch_size=args.micro_batch_size, shuffle=True,
                                         collate_fn=DataCollatorForSeq2Seq(tokenizer, padding=True))
    PreTrainer(args, train_dataloader=loader).train()
''')


def write_alpaca(path: Path) -> None:
    """Short instruction/answer records (alpaca-sized) from the shipped corpus, deterministic."""
    import random

    rng = random.Random(0)
    records = []
    for line in CORPUS.read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        title = text.strip().splitlines()[0][:80]
        records.append({"instruction": f"Explain this part of Python: {title}", "input": "",
                        "output": text[:rng.randint(100, 900)]})
    path.write_text(json.dumps(records))


def write_model(folder: Path, size: str) -> int:
    """A randomly initialised model with weights on disk, so every flow starts from the same ones."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides, seq = SIZES[size]
    config = AutoConfig.from_pretrained(TOKENIZER)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return seq


def pretrainer_config(path: Path, model: Path, seq: int, steps: int, save_dir: Path, micro_batch: int,
                      **data) -> Path:
    config = {"num_training_steps": steps, "micro_batch_size": micro_batch, "dp": 1, "seq_length": seq,
              "dtype": data.pop("dtype", "fp32"),
              "model_path": str(model), "lr": OPTIM["lr"], "min_lr": 0.0, "warmup_steps": OPTIM["warmup"],
              "weight_decay": OPTIM["weight_decay"], "adam_beta2": OPTIM["beta2"], "clip_grad": OPTIM["clip"],
              "eval_interval": 0, "eval_split": 0, "save_interval": 0, "log_interval": 1, "resume": "none",
              "save_dir": str(save_dir), "seed": 42, **data}
    import yaml

    path.write_text(yaml.safe_dump(config))
    return path


def steady_from_metrics(save_dir: Path) -> tuple[float, float]:
    rows = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r][WARMUP_STEPS:]
    tokens = sum(r["step_tokens"] for r in rows)
    return tokens / (sum(r["elapsed_ms"] for r in rows) / 1000), rows[-1]["loss"]


def steady_from_marks(path: Path) -> float:
    timing = json.loads(path.read_text())
    marks = timing["marks"][WARMUP_STEPS - 1:]
    return timing["tokens_per_step"] * (len(marks) - 1) / (marks[-1] - marks[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--flows", default="hf-trainer,pretrainer,pretrainer-compile,seed-padded-alpaca,"
                                           "pretrainer-packed-alpaca")
    ns = parser.parse_args()
    flows = [flow if "@" in flow else f"{flow}@{ns.dtype}" for flow in ns.flows.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": str(ns.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    results: dict[str, list] = {flow: [] for flow in flows}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        seq = write_model(tmp / "model", ns.size)
        measure([BIN / "pretrainer", "prepare", "--input", CORPUS, "--tokenizer", tmp / "model", "--output-prefix",
                 tmp / "corpus", "--append-eod"], env=env)
        (tmp / "hf.py").write_text(HF_TRAINER)
        (tmp / "padded.py").write_text(SEED_PADDED)
        alpaca = tmp / "alpaca.json"
        write_alpaca(alpaca)

        def hf_args(dtype: str) -> list:
            return [tmp / "model", CORPUS, tmp / "hf-cache", tmp / "hf-out", seq, ns.micro_batch, ns.steps,
                    tmp / "timings.json", json.dumps({**OPTIM, "dtype": dtype})]

        hf_flows = [flow for flow in flows if flow.startswith("hf-trainer@")]
        if hf_flows:  # fills the datasets cache (untimed)
            measure([sys.executable, tmp / "hf.py", *hf_args(hf_flows[0].split("@")[1])], env=env)
        prepared = {"megatron_dataset_flag": True, "data_path": str(tmp / "corpus_text_document"),
                    "dataloader_config": {"split": "100,0,0"}}
        for round_ in range(ns.repeats):
            for flow in flows:
                name, dtype = flow.split("@")
                run = tmp / f"{name}-{dtype}-{round_}"
                if name == "hf-trainer":
                    wall, rss, _ = measure([sys.executable, tmp / "hf.py", *hf_args(dtype)], env=env)
                    results[flow].append((steady_from_marks(tmp / "timings.json"), wall, rss))
                    continue
                if name in ("pretrainer", "pretrainer-compile", "pretrainer-glibc-malloc"):
                    config = pretrainer_config(tmp / f"{name}.yaml", tmp / "model", seq, ns.steps, run,
                                               ns.micro_batch, compile=name.endswith("compile"),
                                               host_malloc_reuse=not name.endswith("glibc-malloc"), dtype=dtype,
                                               **prepared)
                    command = [BIN / "pretrainer", "train", config]
                elif name == "seed-padded-alpaca":
                    config = pretrainer_config(tmp / f"{name}.yaml", tmp / "model", seq, ns.steps, run,
                                               ns.micro_batch, dtype=dtype)
                    command = [sys.executable, tmp / "padded.py", config, alpaca, seq]
                else:
                    config = pretrainer_config(tmp / f"{name}.yaml", tmp / "model", seq, ns.steps, run,
                                               ns.micro_batch, train_data=str(alpaca), dtype=dtype)
                    command = [BIN / "pretrainer", "train", config]
                wall, rss, _ = measure(command, env=env)
                results[flow].append((steady_from_metrics(run)[0], wall, rss))
    report(results, tmp_model_flops(ns.size, seq), ns)


def tmp_model_flops(size: str, seq: int) -> float:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pretrainer.perf import flops_per_token

    config = AutoConfig.from_pretrained(TOKENIZER)
    for key, value in SIZES[size][0].items():
        setattr(config, key, value)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return flops_per_token(model, seq).per_token


def report(results: dict, flops: float, ns) -> None:
    import torch

    from pretrainer.perf import device_peak

    torch.set_num_threads(ns.threads)
    from pretrainer.perf.dtype_choice import cpu_matrix_flags
    from pretrainer.perf.peak import processor_name

    dtypes = sorted({flow.split("@")[1] for flow in results})
    peaks = {dtype: device_peak(torch.device("cpu"), torch.bfloat16 if dtype == "bf16" else torch.float32)
             for dtype in dtypes}

    def rate_of(flow: str) -> float | None:
        return statistics.median(r[0] for r in results[flow]) if results.get(flow) else None

    print(f"CPU: {processor_name(torch.device('cpu'))}; bf16/fp16 matrix flags: "
          f"{' '.join(cpu_matrix_flags()) or 'none'}")
    print(f"model {ns.size}, {ns.threads} thread(s), micro-batch {ns.micro_batch}, {ns.steps} steps, "
          f"{ns.repeats} round(s); {flops / 1e6:,.1f} MFLOP/token")
    for dtype, peak in peaks.items():
        print(f"  {dtype}: {peak.describe()}")
    fp32 = rate_of("pretrainer@fp32") if len(dtypes) > 1 else None
    print(f"{'flow':31} {'useful tok/s':>12} {'vs HF':>6} {'vs fp32':>7} {'MFU':>6} {'run wall s':>10} {'vs HF':>6} "
          f"{'peak RSS MB':>11}")
    for flow, runs in results.items():
        dtype = flow.split("@")[1]
        hf = f"hf-trainer@{dtype}"
        baseline = rate_of(hf)
        base_wall = statistics.median(r[1] for r in results[hf]) if baseline else None
        rate = rate_of(flow)
        wall = statistics.median(r[1] for r in runs)
        rss = max(r[2] for r in runs)
        speed = f"{rate / baseline:5.2f}x" if baseline else "-"
        versus_fp32 = f"{rate / fp32:5.2f}x" if fp32 else "-"
        faster = f"{base_wall / wall:5.2f}x" if base_wall else "-"
        mfu = 100 * rate * flops / (peaks[dtype].tflops * 1e12)
        print(f"{flow:31} {rate:12,.0f} {speed:>6} {versus_fp32:>7} {mfu:5.1f}% {wall:10.1f} {faster:>6} {rss:11.0f}")
    alpaca = [next((runs for flow, runs in results.items() if flow.startswith(name + "@")), None)
              for name in ("seed-padded-alpaca", "pretrainer-packed-alpaca")]
    if all(alpaca):
        padded, packed = (statistics.median(r[0] for r in runs) for runs in alpaca)
        print(f"packed vs padded alpaca, useful tokens/s: {packed / padded:.2f}x")


if __name__ == "__main__":
    main()
