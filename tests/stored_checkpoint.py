"""Checkpoints written by earlier mains, kept in tests/data/ with the losses that main's code gave when it resumed
from them; test_train.py resumes each with today's code.

- checkpoint-bf69caf/: the format before saved state became registered components (commit bf69caf): a dense run.
- checkpoint-1544acc/{dense,moe,mixture}/: main at 1544acc, the last before the engines became one torch-native
  backend: a dense run, a Qwen3-MoE run with its balancing losses, and a two-source mixture.

Each is step 3 of a 6-step run of a model small enough that model and AdamW state take a few MB. This file both
describes those runs and made the folders, with the code of the commit each is named after:

    git worktree add /tmp/old bf69caf
    PYTHONPATH=/tmp/old/src .venv/bin/python tests/stored_checkpoint.py bf69caf   # rewrites checkpoint-bf69caf
    git worktree add /tmp/old 1544acc
    PYTHONPATH=/tmp/old/src .venv/bin/python tests/stored_checkpoint.py 1544acc   # rewrites checkpoint-1544acc
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import small_corpus_file, train_losses, write_tiny_model, write_tiny_moe  # noqa: E402

DATA = Path(__file__).parent / "data"
STORED = DATA / "checkpoint-bf69caf"
ONE_BACKEND = DATA / "checkpoint-1544acc"  # written before the engines became one backend
STORED_RUNS = ("dense", "moe", "mixture")
SAVED_AT = 3
SMALL = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)


def stored_run_config(work: Path, save_dir: Path) -> dict:
    """The run the stored checkpoint of bf69caf belongs to (model and corpus written into `work`)."""
    model = write_tiny_model(work / "model", **SMALL)
    return {"num_training_steps": 6, "micro_batch_size": 2, "dp": 1, "gradient_accumulation_steps": 2,
            "seq_length": 32, "dtype": "fp32", "model_path": str(model),
            "train_data": str(small_corpus_file(work / "docs.jsonl")), "save_dir": str(save_dir), "lr": 1e-3,
            "warmup_steps": 2, "eval_interval": 3, "eval_iters": 2, "save_interval": SAVED_AT, "seed": 7,
            "loss_spike_factor": 100.0, "write_report": False, "export_hf": False, "data_cache_path": str(work / "c")}


def one_backend_run_config(name: str, work: Path, save_dir: Path) -> dict:
    """One of the runs of checkpoint-1544acc (a STORED_RUNS name), its model and corpus written into `work`."""
    config = stored_run_config(work, save_dir)
    if name == "moe":
        model = write_tiny_moe(work / "moe", "qwen3_moe", **SMALL, moe_intermediate_size=16, head_dim=8)
        config.update(model_path=str(model), moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    if name == "mixture":
        lines = Path(config["train_data"]).read_text(encoding="utf-8").splitlines(keepends=True)
        halves = {"early": lines[:75], "late": lines[75:]}
        for source, part in halves.items():
            (work / f"{source}.jsonl").write_text("".join(part), encoding="utf-8")
        config["train_data"] = [{"name": "early", "path": str(work / "early.jsonl"), "weight": 0.7},
                                {"name": "late", "path": str(work / "late.jsonl"), "weight": 0.3}]
    return config


def store(config: dict, folder: Path) -> None:
    """Step SAVED_AT of the run `config` into `folder`, with the losses this code gives when it resumes from it."""
    from pretrainer import PreTrainer, PreTrainingArguments

    run = Path(config["save_dir"])
    PreTrainer(PreTrainingArguments(**config, exit_interval=SAVED_AT)).train()
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(run / "checkpoints" / f"step-{SAVED_AT}", folder / "checkpoints" / f"step-{SAVED_AT}")
    (folder / "checkpoints" / "latest").write_text(f"step-{SAVED_AT}")
    PreTrainer(PreTrainingArguments(**config)).train()  # resumed from it
    resumed = {step: loss for step, loss in train_losses(run).items() if step > SAVED_AT}
    (folder / "resumed_losses.json").write_text(json.dumps(resumed, indent=1) + "\n")
    print(f"wrote {folder}")


def main(which: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if which == "bf69caf":
            store(stored_run_config(work, work / "run"), STORED)
            return
        for name in STORED_RUNS:
            store(one_backend_run_config(name, work / name, work / name / "run"), ONE_BACKEND / name)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "1544acc")
