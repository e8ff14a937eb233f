"""MPT's attention through the fused kernel (models/mpt_attention.py): the same logits and gradients as
transformers' explicit scores, one mask per forward, what the planner counts for it, and a run that uses it."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from helpers import QUICKSTART_MODEL, train_losses
from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.models import mpt_attention


def tiny_mpt_config(**overrides):
    from transformers import MptConfig

    settings = dict(d_model=96, n_heads=6, n_layers=3, expansion_ratio=2, max_seq_len=128, vocab_size=4096,
                    no_bias=True)  # 6 heads: ALiBi's slopes for a head count that is not a power of two
    settings.update(overrides)
    return MptConfig(**settings)


def pair():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(tiny_mpt_config(), dtype=torch.float32)
    ours = copy.deepcopy(theirs)
    assert mpt_attention.install(ours) and not mpt_attention.install(torch.nn.Linear(2, 2))
    return theirs, ours


@pytest.mark.parametrize("padded", [False, True])
def test_logits_and_gradients_are_transformers_mpts(padded):
    theirs, ours = pair()
    ids = torch.randint(0, 4096, (3, 50), generator=torch.Generator().manual_seed(1))
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, :7] = 0  # left padding in one sequence
    outputs = [model(input_ids=ids, attention_mask=mask, use_cache=False) for model in (theirs, ours)]
    kept = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(outputs[1].logits[kept], outputs[0].logits[kept], rtol=1e-5, atol=1e-5)
    for out in outputs:
        out.logits[kept].float().logsumexp(-1).mean().backward()
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_one_mask_serves_every_layer_and_lives_only_as_long_as_autograd_keeps_it(monkeypatch):
    _, ours = pair()
    built = []
    original = mpt_attention._additive_mask
    monkeypatch.setattr(mpt_attention, "_additive_mask", lambda *a: built.append(original(*a)) or built[-1])
    ids = torch.randint(0, 4096, (4, 40), generator=torch.Generator().manual_seed(2))
    loss = ours(input_ids=ids, labels=ids, use_cache=False).loss
    assert len(built) == 1 and built[0].shape == (1, 6, 40, 40)  # three layers, four sequences: one mask
    shared = ours.transformer.blocks[0].attn._shared_mask
    del built[:]
    assert shared._mask() is not None  # saved by the attention kernels for backward
    loss.backward()
    del loss
    assert shared._mask() is None


def test_the_planner_counts_no_score_matrix(monkeypatch):
    """Saved bytes per layer grow with the sequence, not with its square, as the planner probes MPT; with
    transformers' attention the scores' softmax (fp32 and bf16 copies) would dominate."""
    from pretrainer.plan import activations

    config = tiny_mpt_config(d_model=512, n_heads=8, max_seq_len=8192)
    activations._probe.cache_clear()
    short, long = (activations.probe(config, seq, "bf16", autocast=False).per_layer for seq in (1024, 4096))
    assert long <= 4.1 * short
    monkeypatch.setattr(mpt_attention, "install", lambda model, announce=True: False)
    activations._probe.cache_clear()
    theirs = activations.probe(config, 4096, "bf16", autocast=False).per_layer
    activations._probe.cache_clear()
    assert theirs - long > 5 * 8 * 4096 * 4096  # at least the fp32 softmax and its bf16 copy, less ours


def test_a_run_trains_mpt_through_it_like_transformers_attention(tmp_path, small_corpus, monkeypatch):
    folder = tmp_path / "mpt"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QUICKSTART_MODEL / name, folder / name)
    tiny_mpt_config(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(folder)
    config = dict(num_training_steps=3, micro_batch_size=2, dp=1, gradient_accumulation_steps=2, seq_length=32,
                  dtype="fp32", model_path=str(folder), train_data=str(small_corpus), lr=1e-3, warmup_steps=1,
                  eval_interval=0, save_interval=0, export_hf=False, write_report=False, seed=3)
    fused = PreTrainer(PreTrainingArguments(**config, save_dir=str(tmp_path / "fused")))
    assert all(hasattr(m.attn, "_shared_mask") for m in fused.model.transformer.blocks)
    fused.train()
    monkeypatch.setattr(mpt_attention, "install", lambda model, announce=True: False)
    PreTrainer(PreTrainingArguments(**config, save_dir=str(tmp_path / "scores"))).train()
    got, expected = train_losses(tmp_path / "fused"), train_losses(tmp_path / "scores")
    assert len(got) == 3 and [got[s] for s in got] == pytest.approx([expected[s] for s in got], rel=1e-5)
