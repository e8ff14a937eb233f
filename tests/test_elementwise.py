"""The planner's count of the bytes a decoder layer's element-wise kernels move (plan/elementwise.py)."""

from __future__ import annotations

import pytest
import torch

from helpers import QUICKSTART_MODEL


def small(family: str):
    from transformers import LlamaConfig, MptConfig

    if family == "llama":
        return LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=688,
                           vocab_size=512, num_hidden_layers=2)
    return MptConfig(d_model=256, n_heads=4, expansion_ratio=4, vocab_size=512, n_layers=2, max_seq_len=128)


def test_the_fake_tensor_count_is_what_the_real_kernels_move():
    """The same forward and backward on real tensors, counted by the same rule, moves the same bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pretrainer.plan import elementwise

    config = AutoConfig.from_pretrained(QUICKSTART_MODEL / "config.json")
    torch.manual_seed(0)
    real = elementwise.decoder_traffic(AutoModelForCausalLM.from_config(config, dtype=torch.float32), 64)
    fake = elementwise._model_traffic(config, 64, None, torch.float32)
    assert real == fake and real[0] > 0 and real[1] > real[0]


def test_the_count_follows_the_family_and_the_tensor_parallel_split():
    """HF's Llama layer (fp32 RMSNorm passes, rotary, SwiGLU) moves several times what MPT's (fused LayerNorm, no
    rotary, GELU) does at the same width; backward moves more than forward; a tensor-parallel rank moves less, and
    with sequence parallelism the norms and residual adds split too, leaving 1/tp of the whole."""
    from pretrainer.plan.elementwise import layer_traffic

    llama, mpt = (layer_traffic(small(family), 128, "bf16", False) for family in ("llama", "mpt"))
    assert mpt.total < 0.3 * llama.total and llama.forward < llama.backward
    # autocast keeps the residual stream and the norms' inputs in fp32
    assert layer_traffic(small("llama"), 128, "bf16", True).total > 1.5 * llama.total
    tp2 = layer_traffic(small("llama"), 128, "bf16", False, tp=2)
    tp2_sp = layer_traffic(small("llama"), 128, "bf16", False, tp=2, sequence_parallel=True)
    assert tp2_sp.total < tp2.total < llama.total
    assert tp2_sp.total == pytest.approx(llama.total / 2, rel=0.02)


def test_a_mixture_of_experts_layer_is_counted_by_formula():
    """Its routing reads the tokens' values: the Llama-layer formula of its widths stands in, each token through
    its top_k experts."""
    from transformers import MixtralConfig

    from pretrainer.plan.elementwise import FORMULA_ROWS, layer_traffic

    config = MixtralConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
                           num_local_experts=4, num_experts_per_tok=2, vocab_size=512, num_hidden_layers=2)
    traffic = layer_traffic(config, 64, "bf16", False)
    assert traffic.total == pytest.approx(2 * (FORMULA_ROWS["hidden"] * 128 + FORMULA_ROWS["ffn"] * 2 * 256))


def test_the_plan_states_the_traffic_it_counted(tmp_path):
    """On a GPU the step line says how many bytes a layer's element-wise kernels move per token on a rank."""
    import shutil

    from pretrainer import PreTrainingArguments
    from pretrainer.plan import render
    from pretrainer.plan.command import plan_for_command

    shutil.copytree(QUICKSTART_MODEL, tmp_path / "model")
    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, seq_length=128,
                                model_path=str(tmp_path / "model"))
    step = next(line for line in render.text(plan_for_command(args, 8, None, "H100", None)).splitlines()
                if line.startswith("step:"))
    assert "element-wise kernels moving" in step and "KiB per token and layer on a rank" in step, step
    on_cpu = render.text(plan_for_command(args, 1, None, "cpu", None))
    assert "element-wise" not in on_cpu
