"""Longer contexts: RoPE scaling from the config (refusal with a hint, runs at 4x the model's positions, an
export that carries the scaling), and the chunked output-head loss (the plain loss and gradients, on every
engine that takes it)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import read_metrics, train_losses
from multi_run import launch_cases
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.batch import IGNORE, forward_head, loss_sum
from pretrainer.models.chunked_loss import LinearCrossEntropy, install_chunked_loss, resolve_chunk_size

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4},
    "dynamic": {"rope_type": "dynamic", "factor": 4},
    "yarn": {"rope_type": "yarn", "factor": 4},
    "llama3": {"rope_type": "llama3", "factor": 4, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
}


def test_a_sequence_longer_than_the_positions_is_refused_with_the_key_to_set(base_config):
    with pytest.raises(ConfigError, match=r"key 'seq_length': 512 exceeds the model's max_position_embeddings "
                                          r"\(128, .*extend the positions with rope_scaling, e\.g\. rope_scaling: "
                                          r"\{rope_type: yarn, factor: 4\}"):
        PreTrainer(PreTrainingArguments(**{**base_config, "seq_length": 512}))
    with pytest.raises(ConfigError, match=r"rope_scaling needs rope_type, one of linear, dynamic, yarn"):
        PreTrainingArguments(**{**base_config, "rope_scaling": {"factor": 4}})
    with pytest.raises(ConfigError, match=r"rope_scaling.factor must be a number >= 1"):
        PreTrainingArguments(**{**base_config, "rope_scaling": {"rope_type": "yarn", "factor": "4x"}})
    with pytest.raises(ConfigError, match=r"key 'rope_scaling': .*low_freq_factor"):  # transformers' own check
        PreTrainer(PreTrainingArguments(**{**base_config, "seq_length": 512,
                                           "rope_scaling": {"rope_type": "llama3", "factor": 4}}))


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_each_scaling_trains_at_four_times_the_positions_and_the_export_carries_it(kind, base_config, tmp_path):
    from transformers import AutoConfig

    config = {**base_config, "seq_length": 512, "micro_batch_size": 1, "gradient_accumulation_steps": 1,
              "num_training_steps": 2, "warmup_steps": 1, "eval_interval": 0, "save_interval": 0,
              "rope_scaling": SCALINGS[kind], "rope_theta": 20000.0, "save_dir": str(tmp_path / kind)}
    PreTrainer(PreTrainingArguments(**config)).train()
    assert all(loss == loss for loss in train_losses(tmp_path / kind).values())
    exported = AutoConfig.from_pretrained(tmp_path / kind / "hf")
    rope = exported.rope_parameters
    assert rope["rope_type"] == kind and rope["factor"] == 4 and rope["rope_theta"] == 20000.0
    assert exported.max_position_embeddings == (128 if kind == "dynamic" else 512)
    if kind == "yarn":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / kind / "hf")
        prompt = torch.randint(3, 4000, (1, 300))  # past the model's original 128 positions
        assert model.generate(prompt, max_new_tokens=3, do_sample=False).shape == (1, 303)


def test_the_chunked_loss_equals_the_plain_loss_and_gradients():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 50, (2, 37), generator=generator)
    targets[0, :5] = IGNORE
    plain = F.cross_entropy(F.linear(hidden, weight).reshape(-1, 50), targets.reshape(-1), ignore_index=IGNORE,
                            reduction="sum")
    plain_grads = torch.autograd.grad(plain * 0.5, (hidden, weight))
    chunked, correct = LinearCrossEntropy.apply(hidden, weight, targets, 16, None)
    chunked_grads = torch.autograd.grad(chunked * 0.5, (hidden, weight))
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    predicted = F.linear(hidden, weight).argmax(-1)
    assert correct.item() == ((predicted == targets) & (targets != IGNORE)).sum().item()
    for got, want in zip(chunked_grads, plain_grads):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert resolve_chunk_size("auto", 8, 256, 4096) == 0 and resolve_chunk_size(64, 1, 1, 1) == 64
    assert resolve_chunk_size("auto", 4, 8192, 65000) == 258  # 8.5 GB of logits: chunks of 64 MB


def test_a_chunked_head_returns_the_loss_in_training_and_logits_elsewhere(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    batch = {"input_ids": torch.randint(3, 4000, (2, 24)), "shift_labels": torch.randint(3, 4000, (2, 24))}
    plain = loss_sum(forward_head(model, batch, takes_call=False), batch["shift_labels"])
    assert install_chunked_loss(model, 10, explicit=True)
    chunked = loss_sum(forward_head(model, batch, takes_call=True), batch["shift_labels"])
    assert chunked.dim() == 0 and chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    assert model(input_ids=batch["input_ids"]).logits.shape == (2, 24, 4096)  # outside training: logits
    assert sorted(model.state_dict()) == sorted(AutoModelForCausalLM.from_config(model.config).state_dict())


def test_the_chunked_loss_trains_like_the_plain_one_on_every_engine(base_config, tmp_path):
    single = tmp_path / "single"
    PreTrainer(PreTrainingArguments(**{**base_config, "micro_batch_size": 4, "loss_chunk_size": 0,
                                       "save_dir": str(single)})).train()
    (tmp_path / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    cases = [{"name": name, "config": {**extra, "save_dir": str(tmp_path / name)}} for name, extra in {
        "ddp": {"engine": "ddp"}, "fsdp": {"engine": "fsdp"},
        "zero3": {"deepspeed": str(tmp_path / "zero3.json")}}.items()]
    done = launch_cases({**base_config, "dp": 2, "loss_chunk_size": 24, "export_hf": False}, cases, 2, tmp_path)
    assert (done.stdout + done.stderr).count("cross-entropy run in chunks of 24 tokens") == 3
    want, want_eval = train_losses(single), read_metrics(single)
    for name in ("ddp", "fsdp", "zero3"):
        have = train_losses(tmp_path / name)
        assert [have[s] for s in sorted(want)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-5), name
        evals = [v for row in read_metrics(tmp_path / name) if "eval_loss" in row for v in (row["eval_loss"],
                                                                                            row["eval_acc"])]
        expected = [v for row in want_eval if "eval_loss" in row for v in (row["eval_loss"], row["eval_acc"])]
        assert len(evals) == 4 and evals == pytest.approx(expected, rel=1e-5), name


def test_context_parallel_on_two_ranks_trains_like_one_process_and_resumes_on_one(base_config, tmp_path):
    """cp=2: each rank holds half of every sequence (chunks 0+3 and 1+2); ddp, fsdp and a yarn-scaled run
    give the single process's per-step losses; a cp=2 checkpoint continues on one process."""
    yarn = {"seq_length": 64, "rope_scaling": {"rope_type": "yarn", "factor": 2}}
    references = {}
    for name, extra in {"plain": {}, "yarn": yarn}.items():
        references[name] = tmp_path / f"single-{name}"
        PreTrainer(PreTrainingArguments(**{**base_config, **extra, "save_dir": str(references[name])})).train()
    cases = [
        {"name": "ddp-cp2", "config": {"engine": "ddp", "save_dir": str(tmp_path / "ddp")}},
        {"name": "fsdp-cp2", "config": {"engine": "fsdp", "save_dir": str(tmp_path / "fsdp")}},
        {"name": "fsdp-cp2-yarn", "config": {"engine": "fsdp", **yarn, "save_dir": str(tmp_path / "yarn")}},
        {"name": "ddp-cp2-recompute", "config": {"engine": "ddp", "activation_checkpointing": "full",
                                                 "save_dir": str(tmp_path / "recompute")}},
        {"name": "cp2-exit", "config": {"engine": "ddp", "exit_interval": 3, "save_dir": str(tmp_path / "moved")}},
    ]
    done = launch_cases({**base_config, "context_parallel_degree": 2, "export_hf": False}, cases, 2, tmp_path)
    assert (done.stdout + done.stderr).count("every sequence split over 2 ranks") == 5
    PreTrainer(PreTrainingArguments(**{**base_config, "save_dir": str(tmp_path / "moved")})).train()
    for name, reference in (("ddp", "plain"), ("fsdp", "plain"), ("yarn", "yarn"), ("recompute", "plain"),
                            ("moved", "plain")):
        want, have = read_metrics(references[reference]), read_metrics(tmp_path / name)
        for key in ("loss", "eval_loss", "eval_acc"):
            expected = [row[key] for row in want if key in row]
            assert [row[key] for row in have if key in row] == pytest.approx(expected, rel=1e-4), (name, key)


def test_context_parallel_refuses_what_it_cannot_split(base_config, tmp_path):
    with pytest.raises(ConfigError, match=r"context_parallel_degree.*needs several processes and engine ddp, "
                                          r"fsdp or megatron"):
        PreTrainer(PreTrainingArguments(**{**base_config, "context_parallel_degree": 2}))
    with pytest.raises(ConfigError, match=r"cannot split sequences whose attention stops at document boundaries"):
        PreTrainingArguments(**{**base_config, "context_parallel_degree": 2, "reset_attention_mask": True})
    from pretrainer.parallel.context_parallel import ContextParallel

    layout = ContextParallel(2, 1, None)
    assert layout.local_indices(8).tolist() == [2, 3, 4, 5] and layout.local_indices(6).tolist() == [2, 3, 4, 5]
    batch = {"input_ids": torch.arange(12).view(2, 6), "shift_labels": torch.arange(12).view(2, 6),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1]])}
    with pytest.raises(ConfigError, match="attention_mask other than right padding"):
        layout.shard(batch)
    right_padded = {"input_ids": batch["input_ids"], "attention_mask": torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]]),
                    "shift_labels": torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, -100, -100, -100]])}
    assert layout.shard(right_padded)["shift_labels"].tolist() == [[3, 4, 5, 6], [9, -100, -100, -100]]
    first = ContextParallel(2, 0, None).shard(right_padded)  # chunks 0 and 3 of 6 tokens padded to 8
    assert first["shift_labels"].tolist() == [[1, 2, -100, -100], [7, 8, -100, -100]]
    assert first["position_ids"].tolist() == [[0, 1, 0, 0], [0, 1, 0, 0]]
