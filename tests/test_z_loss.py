"""The output z-loss (`z_loss_coeff`): its value and gradient against autograd through whole logits, in the
chunked head and on plain logits; every engine (ddp, fsdp, megatron tp=2 with the vocabulary-parallel chunked
head, pp=2) against one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import read_metrics, train_losses
from multi_run import launch_cases
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.batch import IGNORE, HeadOutput
from pretrainer.models.chunked_loss import LinearCrossEntropy
from pretrainer.run.callbacks import OutputZLoss, StepResult, TrainState

COEFF = 0.05


def problem():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 37, 16, generator=generator, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(50, 16, generator=generator).requires_grad_()
    targets = torch.randint(0, 50, (2, 37), generator=generator)
    targets[0, :5] = IGNORE
    return hidden, weight, targets


def reference(hidden, weight, targets):
    """Cross-entropy sum, z sum and the gradient of ce + COEFF z, through the whole logits."""
    logits = F.linear(hidden, weight).reshape(-1, weight.shape[0])
    valid = targets.reshape(-1) != IGNORE
    ce = F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    z = (torch.logsumexp(logits, dim=-1).square() * valid).sum()
    return ce, z, torch.autograd.grad((ce + COEFF * z) * 0.5, (hidden, weight))


def test_the_chunked_z_loss_equals_autograd_through_whole_logits():
    hidden, weight, targets = problem()
    ce, z, grads = reference(hidden, weight, targets)
    chunked = LinearCrossEntropy.apply(hidden, weight, targets, 16, None, False, COEFF)
    assert chunked.shape == (3,)
    assert chunked[0].item() == pytest.approx(ce.item(), rel=1e-6)  # the value stays the cross-entropy
    assert chunked[2].item() == pytest.approx(z.item(), rel=1e-6)
    for got, want in zip(torch.autograd.grad(chunked[0] * 0.5, (hidden, weight)), grads):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)
    plain_grads = torch.autograd.grad(LinearCrossEntropy.apply(hidden, weight, targets, 16, None)[0], (hidden,))
    assert not torch.allclose(plain_grads[0] * 0.5, grads[0], atol=1e-4)  # the z-loss moves the gradient


def test_on_plain_logits_the_z_term_adds_its_gradient_and_keeps_the_value():
    hidden, weight, targets = problem()
    ce, z, grads = reference(hidden, weight, targets)
    logits = F.linear(hidden, weight)
    term = OutputZLoss(COEFF)
    term._sums = torch.zeros(2, dtype=torch.float64)
    summed = F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    with_z = term.add_to_loss(summed, HeadOutput(logits=logits), targets)
    term.end_step(StepResult(1, summed, torch.ones(2), torch.ones(()), 1e-3, True), TrainState(step=1))
    assert with_z.item() == summed.item()
    assert term._sums[0].item() == pytest.approx(z.item(), rel=1e-6)
    for got, want in zip(torch.autograd.grad(with_z * 0.5, (hidden, weight)), grads):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)


def test_a_negative_coefficient_is_refused():
    with pytest.raises(ConfigError, match="z_loss_coeff must be >= 0"):
        PreTrainingArguments(num_training_steps=2, micro_batch_size=1, dp=1, z_loss_coeff=-1)


def test_every_engine_trains_the_z_loss_as_one_process(base_config, tmp_path):
    """One process on whole logits is the reference; ddp and fsdp with the chunked head, megatron tp=2 with the
    vocabulary-parallel chunked head and pp=2 give its losses and z_loss per step (fp32, 1e-5)."""
    config = {**base_config, "z_loss_coeff": COEFF, "export_hf": False}
    single, without = tmp_path / "single", tmp_path / "without"
    PreTrainer(PreTrainingArguments(**{**config, "loss_chunk_size": 0, "save_dir": str(single)})).train()
    PreTrainer(PreTrainingArguments(**{**config, "z_loss_coeff": 0.0, "save_dir": str(without)})).train()
    cases = [{"name": name, "config": {**extra, "save_dir": str(tmp_path / name)}} for name, extra in {
        "ddp": {"engine": "ddp", "dp": 2, "micro_batch_size": 1, "loss_chunk_size": 24},
        "fsdp": {"engine": "fsdp", "dp": 2, "micro_batch_size": 1, "loss_chunk_size": 24},
        "tp2": {"engine": "megatron", "plugin_args": {"tp_degree": 2, "sequence_parallelism": True},
                "loss_chunk_size": 24},
        "pp2": {"engine": "megatron", "plugin_args": {"pp_degree": 2}},
    }.items()]
    done = launch_cases(config, cases, 2, tmp_path)
    assert (done.stdout + done.stderr).count("output z-loss 0.05") >= 4
    want = read_metrics(single)
    want_z = [row["z_loss"] for row in want if "z_loss" in row]
    assert len(want_z) == 6 and all(v > 0 for v in want_z)
    steps = sorted(train_losses(single))
    assert [train_losses(without)[s] for s in steps] != pytest.approx([train_losses(single)[s] for s in steps],
                                                                      rel=1e-5)  # the term trains
    for name in ("ddp", "fsdp", "tp2", "pp2"):
        have = read_metrics(tmp_path / name)
        assert [train_losses(tmp_path / name)[s] for s in steps] == pytest.approx(
            [train_losses(single)[s] for s in steps], rel=1e-5), name
        assert [row["z_loss"] for row in have if "z_loss" in row] == pytest.approx(want_z, rel=1e-5), name
