"""How the new rows of an extended vocabulary should start: `new_token_init` subtoken_mean vs mean vs normal.

    .venv/bin/python bench/new_token_init.py [--pretrain-steps 300] [--steps 60] [--add 1000] [--folder DIR]

1. The quickstart model (5.0M parameters, byte-level BPE of 4,096 tokens trained on English) is pretrained
   from random weights on English (CPython docs) and Chinese (examples/data/zh_reviews.txt) documents
   alternating, so it learns Chinese through byte pieces; it is exported as an HF folder.
2. Its tokenizer is extended with `--add` Chinese tokens learned on the same reviews.
3. The exported model continues on the Chinese reviews with the extended tokenizer, once per
   `new_token_init`, everything else equal (same seed, data, schedule, all parameters trained); the eval
   set is zh_reviews_held_out.txt. Printed: the first step's loss, the loss after `--steps` steps and the
   held-out loss then (all in the extended tokenizer's tokens, so the three are comparable with each other).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from common import REPO, metrics, pretrainer

DATA = REPO / "examples" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--add", type=int, default=1000)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/pretrainer-bench-new-token-init"))
    ns = parser.parse_args()
    folder = ns.folder
    folder.mkdir(parents=True, exist_ok=True)
    english = (DATA / "python_docs.jsonl").read_text(encoding="utf-8").splitlines()
    chinese = [json.dumps({"text": line}, ensure_ascii=False)
               for line in (DATA / "zh_reviews.txt").read_text(encoding="utf-8").splitlines()]
    mixed = folder / "mixed.jsonl"
    mixed.write_text("\n".join(line for pair in zip(english, chinese) for line in pair) + "\n", encoding="utf-8")
    common = ["dtype=fp32", "micro_batch_size=8", "dp=1", "gradient_accumulation_steps=1", "seq_length=256",
              "lr=2e-3", "min_lr=2e-4", "eval_iters=10", "write_report=false", "save_interval=0", "seed=42",
              "log_interval=1"]
    base = folder / "base"
    if not (base / "hf" / "config.json").is_file():
        print(f"pretraining the quickstart model for {ns.pretrain_steps} steps on English + Chinese ...", flush=True)
        pretrainer("train", "examples/quickstart.yaml", *common, f"num_training_steps={ns.pretrain_steps}",
                   f"train_data={mixed}", "warmup_steps=30", f"eval_interval={ns.pretrain_steps}", f"save_dir={base}")
    extended = folder / "extended"
    pretrainer("tokenizer", "extend", "--tokenizer", base / "hf", "--input", DATA / "zh_reviews.txt", "--add",
               ns.add, "--output", extended)
    rows = []
    for init in ("subtoken_mean", "mean", "normal"):
        save_dir = folder / f"continue-{init}"
        shutil.rmtree(save_dir, ignore_errors=True)  # a finished run there would be resumed, not redone
        print(f"continuing with new_token_init={init} ...", flush=True)
        pretrainer("train", "examples/quickstart.yaml", *common, f"num_training_steps={ns.steps}",
                   f"model_path={base / 'hf'}", f"tokenizer_path={extended}", f"new_token_init={init}",
                   f"train_data={DATA / 'zh_reviews.txt'}", f"eval_data={DATA / 'zh_reviews_held_out.txt'}",
                   "warmup_steps=5", f"eval_interval={ns.steps}", "export_hf=false", f"save_dir={save_dir}")
        losses = {row["step"]: row["loss"] for row in metrics(save_dir) if "loss" in row}
        evals = {row["step"]: row["eval_loss"] for row in metrics(save_dir) if "eval_loss" in row}
        rows.append((init, losses[1], losses[ns.steps], evals[ns.steps]))
    print(f"\n{ns.add} new tokens; continued {ns.steps} steps of 8 x 256 tokens\n")
    print(f"| new_token_init | loss, step 1 | loss, step {ns.steps} | held-out loss, step {ns.steps} |")
    print("|---|---|---|---|")
    for init, first, last, held in rows:
        print(f"| {init} | {first:.3f} | {last:.3f} | {held:.3f} |")


if __name__ == "__main__":
    main()
