"""Several trainings in one torchrun job (one process group), so a test module pays the start-up of the
processes once (tests/test_engines.py, tests/test_megatron.py).

    torchrun --nproc_per_node N tests/multi_run.py CASES.json

CASES.json: {"base": {config}, "cases": [{"name": ..., "config": {keys}, "overrides": ["key=value", ...],
"hooks": bool}, ...]}. Cases run in order, so a case may resume from the checkpoint an earlier one left in
the same save_dir, as a rerun of the same command would.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from helpers import write_layout_check
from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.parallel.world import destroy_process_group

HOOK_CALLS: Counter = Counter()


def make_hooks(model_path: str, seq_length: int) -> dict:
    """All four seed hooks: a model from its config, random-token datasets, a batch function that masks the
    first 4 targets of every row, and Megatron's masked-mean loss. Each counts its calls in HOOK_CALLS."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def model_provider(pre_process=True, post_process=True):
        HOOK_CALLS["model"] += 1
        config = AutoConfig.from_pretrained(model_path)
        config.use_cache = False
        return AutoModelForCausalLM.from_config(config)

    def datasets_provider(train_val_test_num_samples):
        HOOK_CALLS["datasets"] += 1
        rng = np.random.default_rng(5)
        train = list(rng.integers(3, 4096, size=(64, seq_length + 1)))
        valid = [{"text": row} for row in rng.integers(3, 4096, size=(8, seq_length + 1))]
        return train, valid, None

    def get_batch(data_iterator):
        HOOK_CALLS["get_batch"] += 1
        batch = next(data_iterator)
        loss_mask = torch.ones_like(batch["input_ids"], dtype=torch.float32)
        loss_mask[:, :4] = 0
        return batch["input_ids"], batch["shift_labels"], loss_mask, None, None

    def loss_function(loss_mask, output_tensor):
        HOOK_CALLS["loss"] += 1
        loss = (output_tensor * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach()}

    return {"custom_model_provider_function": model_provider,
            "custom_megatron_datasets_provider_function": datasets_provider,
            "custom_get_batch_function": get_batch, "custom_loss_function": loss_function}


def hook_config(base: dict) -> dict:
    """The base config turned into a hooks run: model and data come from the hooks."""
    config = {k: v for k, v in base.items() if k not in ("model_path", "train_data")}
    return {**config, "tokenizer_path": base["model_path"], "megatron_dataset_flag": True}


def run_case(base: dict, case: dict) -> None:
    config = {**(hook_config(base) if case.get("hooks") else base), **case.get("config", {})}
    args = PreTrainingArguments.from_dict(config, case.get("overrides", []))
    if case.get("hooks"):
        args.update_distributed_train_args(make_hooks(base["model_path"], base["seq_length"]))
    trainer = PreTrainer(args)
    trainer.train()
    write_layout_check(trainer)  # what the engine holds beside what the planner says it holds
    if case.get("hooks"):
        Path(args.run_dir, f"hook_calls_rank{os.environ.get('RANK', '0')}.json").write_text(
            json.dumps(dict(HOOK_CALLS)))
        HOOK_CALLS.clear()


FAILED = "multi_run: case failed: "  # a line each rank prints before it re-raises


def launch_cases(base: dict, cases: list[dict], nproc: int, folder: Path):
    """Run `cases` in one torchrun job of `nproc` processes (from a test); a failure names the case(s) that
    failed, with the job's output. Returns the finished job (its output)."""
    from launch import describe, run, torchrun

    spec = folder / "cases.json"
    spec.write_text(json.dumps({"base": base, "cases": cases}))
    done = run(torchrun(nproc, Path(__file__), spec), timeout=900)
    failed = sorted({line.split(FAILED, 1)[1] for line in (done.stdout + done.stderr).splitlines() if FAILED in line})
    assert done.returncode == 0, f"failed case(s): {', '.join(failed) or '(none reported)'}\n{describe(done)}"
    return done


def report_native_faults() -> None:
    """A rank that aborts or faults prints every thread's Python stack (faulthandler) and native stack (c10's
    handler, which then calls faulthandler's): what the test's failure message shows (launch.describe)."""
    faulthandler.enable(all_threads=True)
    if sys.platform.startswith("linux"):
        torch._C._set_print_stack_traces_on_fatal_signal(True)


def main() -> None:
    report_native_faults()
    spec = json.loads(Path(sys.argv[1]).read_text())
    for case in spec["cases"]:
        start = time.perf_counter()
        try:
            run_case(spec["base"], case)
        except BaseException:
            print(f"{FAILED}{case['name']} (rank {os.environ.get('RANK', '0')})", file=sys.stderr, flush=True)
            raise
        if os.environ.get("RANK", "0") == "0":  # where a shared job's time goes (the test's output on failure)
            print(f"multi_run: case {case['name']}: {time.perf_counter() - start:.1f} s", flush=True)
    destroy_process_group(barrier=True)  # once, last, with gloo's workers let finish (parallel/world.py)


if __name__ == "__main__":
    main()
