"""A checkpoint in the format pretrainer wrote before its saved state became registered components (commit
bf69caf), kept in tests/data/checkpoint-bf69caf/ with the losses that commit's code gave when it resumed from it.
test_train.py resumes it with today's code. This file both describes that run and made the folder:

    git worktree add /tmp/old bf69caf
    PYTHONPATH=/tmp/old/src .venv/bin/python tests/stored_checkpoint.py    # rewrites tests/data/checkpoint-bf69caf

(a 2-layer Llama of hidden size 16, so that model and AdamW state take about 2 MB).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import small_corpus_file, train_losses, write_tiny_model  # noqa: E402

STORED = Path(__file__).parent / "data" / "checkpoint-bf69caf"
SAVED_AT = 3


def stored_run_config(work: Path, save_dir: Path) -> dict:
    """The run the stored checkpoint belongs to (model and corpus written into `work`)."""
    model = write_tiny_model(work / "model", hidden_size=16, intermediate_size=32, num_attention_heads=2,
                             num_key_value_heads=1)
    return {"num_training_steps": 6, "micro_batch_size": 2, "dp": 1, "gradient_accumulation_steps": 2,
            "seq_length": 32, "dtype": "fp32", "model_path": str(model),
            "train_data": str(small_corpus_file(work / "docs.jsonl")), "save_dir": str(save_dir), "lr": 1e-3,
            "warmup_steps": 2, "eval_interval": 3, "eval_iters": 2, "save_interval": SAVED_AT, "seed": 7,
            "loss_spike_factor": 100.0, "write_report": False, "export_hf": False, "data_cache_path": str(work / "c")}


def main() -> None:
    from pretrainer import PreTrainer, PreTrainingArguments

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = stored_run_config(work, work / "run")
        PreTrainer(PreTrainingArguments(**config, exit_interval=SAVED_AT)).train()
        shutil.rmtree(STORED, ignore_errors=True)
        shutil.copytree(work / "run" / "checkpoints" / f"step-{SAVED_AT}",
                        STORED / "checkpoints" / f"step-{SAVED_AT}")
        (STORED / "checkpoints" / "latest").write_text(f"step-{SAVED_AT}")
        PreTrainer(PreTrainingArguments(**config)).train()  # resumed from it
        resumed = {step: loss for step, loss in train_losses(work / "run").items() if step > SAVED_AT}
        (STORED / "resumed_losses.json").write_text(json.dumps(resumed, indent=1) + "\n")
    print(f"wrote {STORED}")


if __name__ == "__main__":
    main()
