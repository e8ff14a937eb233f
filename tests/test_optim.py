"""Learning-rate schedules and AdamW parameter groups."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pretrainer import PreTrainingArguments
from pretrainer.config import OptimizerSettings, ScheduleSettings
from pretrainer.optim import build_optimizer, build_scheduler, lr_multiplier, parameter_groups


def lrs(style: str, total: int = 10, warmup: int = 2, min_ratio: float = 0.1, **kw) -> list[float]:
    return [lr_multiplier(s, total=total, warmup=warmup, style=style, min_ratio=min_ratio, **kw) for s in range(total)]


def test_warmup_reaches_peak_on_its_last_step_then_each_style_decays_to_min():
    for style in ("cosine", "linear", "wsd"):
        values = lrs(style)
        assert values[:2] == [0.5, 1.0]
        assert values[-1] == pytest.approx(0.1)
        assert all(a >= b for a, b in zip(values[1:], values[2:]))
    assert lrs("constant")[2:] == [1.0] * 8
    assert lrs("cosine")[2 + 7 // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    assert lrs("linear")[5] == pytest.approx(0.1 + 0.9 * (1 - 3 / 7))


def test_wsd_is_stable_until_the_decay_fraction():
    values = lrs("wsd", total=22, warmup=2, wsd_decay_fraction=0.25)
    assert values[2:17] == [1.0] * 15
    assert values[17] < 1.0 and values[-1] == pytest.approx(0.1)


def test_scheduler_follows_config_and_steps_once_per_update():
    model = torch.nn.Linear(2, 2)
    args = PreTrainingArguments(num_training_steps=10, micro_batch_size=1, dp=1, lr=1e-3, min_lr=1e-4,
                                warmup_fraction=0.2, lr_decay_style="linear")
    optimizer = build_optimizer(model, OptimizerSettings.of(args), torch.device("cpu"))
    scheduler = build_scheduler(optimizer, ScheduleSettings.of(args))
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[0] == pytest.approx(5e-4) and seen[1] == pytest.approx(1e-3) and seen[-1] == pytest.approx(1e-4)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)


def test_no_weight_decay_on_norms_biases_and_embeddings(tiny_model):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert "model.embed_tokens.weight" in skipped and "model.norm.weight" in skipped
    assert "model.layers.0.input_layernorm.weight" in skipped
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "lm_head.weight" in decayed
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
