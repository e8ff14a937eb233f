"""The CPU attention for compiled bf16 layers (models/cpu_attention.py): its written-out backward gives the
gradients of torch's own attention, it steps aside for every case it does not cover, and a compiled bf16
run on CPU uses it and trains like the eager bf16 run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import train_losses
from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.models import cpu_attention


def sdpa_gradients(query, key, value, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    F.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad_out)
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("seq", [40, 300])  # one block of queries, and several (the last one short)
def test_the_written_out_backward_gives_torchs_attention_gradients(seq, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    query, key, value, grad_out = (torch.randn(2, 3, seq, 16, generator=generator) for _ in range(4))
    monkeypatch.setattr(cpu_attention, "BLOCK_BYTES", 4 * 6 * seq * 64)  # blocks of 64 queries
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True)[:2]
    got = cpu_attention.causal_attention_backward(query, key, value, out, lse, grad_out, 16 ** -0.5)
    for mine, theirs in zip(got, sdpa_gradients(query, key, value, grad_out)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_attention_matches_sdpa_in_bf16_with_grouped_heads_and_steps_aside_for_masks():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.training, module.num_key_value_groups = True, True, 2
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 4, 64, 16, generator=generator, requires_grad=True)
    key, value = (torch.randn(2, 2, 64, 16, generator=generator, requires_grad=True) for _ in range(2))
    results = []
    for function in (cpu_attention.attention, sdpa_attention_forward):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = function(module, query, key, value, None, scaling=0.25)
        grads = torch.autograd.grad(out.float().square().sum(), (query, key, value))
        results.append((out.float(), *grads))
    for mine, theirs in zip(*results):  # bf16 rounding: relative to each tensor's scale
        assert (mine - theirs).abs().max() <= 2e-2 * theirs.abs().max()
    # a padding mask goes to sdpa unchanged
    mask = torch.ones(2, 1, 64, 64, dtype=torch.bool).tril()
    mask[1, :, :, 50:] = False
    with torch.no_grad():
        masked = cpu_attention.attention(module, query, key, value, mask, scaling=0.25)[0]
        assert torch.equal(masked, sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)[0])


def test_a_compiled_bf16_run_on_cpu_uses_it_and_trains_like_eager_bf16(base_config, tmp_path):
    config = {**base_config, "dtype": "bf16", "num_training_steps": 3, "eval_interval": 0, "save_interval": 0,
              "export_hf": False}
    PreTrainer(PreTrainingArguments(**{**config, "save_dir": str(tmp_path / "eager")})).train()
    compiled = PreTrainer(PreTrainingArguments(**{**config, "compile": True, "save_dir": str(tmp_path / "c")}))
    assert compiled.model.config._attn_implementation == cpu_attention.NAME
    compiled.train()
    eager, got = train_losses(tmp_path / "eager"), train_losses(tmp_path / "c")
    assert [got[s] for s in (1, 2, 3)] == pytest.approx([eager[s] for s in (1, 2, 3)], rel=2e-2)
