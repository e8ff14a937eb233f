"""Activation checkpointing: what is recomputed in backward, and that results do not change."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from pretrainer import ConfigError
from pretrainer.parallel.activation_checkpoint import RecomputeSettings, apply_activation_checkpointing, decoder_layers


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops(model_dir, mode: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    apply_activation_checkpointing(model, RecomputeSettings(mode))
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    counter = OpCounter()
    with counter:
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return model, counter.counts, loss.item(), grads


def test_full_recomputes_the_layers_and_selective_only_the_cheap_ops(tiny_model):
    _, plain, loss, grads = backward_ops(tiny_model, "none")
    model, full, full_loss, full_grads = backward_ops(tiny_model, "full")
    _, selective, sel_loss, sel_grads = backward_ops(tiny_model, "selective")
    assert all(isinstance(layer, CheckpointWrapper) for layer in decoder_layers(model))
    assert full["mm"] > plain["mm"]  # matmuls run again in backward
    assert selective["mm"] == plain["mm"]  # saved, not recomputed
    assert selective.get("rsqrt", 0) > plain.get("rsqrt", 0)  # norms recomputed
    assert full_loss == loss == sel_loss
    torch.testing.assert_close(full_grads, grads)
    torch.testing.assert_close(sel_grads, grads)
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()  # names unchanged by the wrapper


def test_unknown_mode_is_refused():
    from pretrainer import PreTrainingArguments

    with pytest.raises(ConfigError, match="activation_checkpointing 'some' is not one of"):
        PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, activation_checkpointing="some")
