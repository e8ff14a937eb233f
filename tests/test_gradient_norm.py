"""The gradient norm the torch engines clip with and log (parallel/gradient_norm.py). Its sum over ranks and
layouts is checked by the engine runs (tests/test_engines.py, tests/test_megatron.py compare each step's norm
with one process's)."""

from __future__ import annotations

import pytest
import torch

from pretrainer.parallel.gradient_norm import clip_, global_norm, sums_of_squares


def test_cpu_sums_are_float64_piece_by_piece():
    grads = [torch.randn(3, 1000) * 1e3, torch.randn(5), torch.randn(0)]
    exact = [g.double().pow(2).sum().item() for g in grads]
    sums = sums_of_squares(grads, piece=7)  # many pieces, a short last one, an empty tensor
    assert sums.dtype == torch.float64 and sums.tolist() == pytest.approx(exact, rel=1e-6)


def test_the_norm_of_a_large_gradient_is_exact_and_clipping_reaches_the_limit():
    torch.manual_seed(0)
    grads = [torch.randn(16_000_000), torch.randn(10, 10)]  # 16M elements: where fp32 sums drift on a CPU
    exact = sum(g.double().pow(2).sum() for g in grads).sqrt().item()
    norm = global_norm(grads, 1, lambda total: None, torch.device("cpu"))
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(exact, rel=1e-6)
    clip_(grads, 1.0, norm)
    assert global_norm(grads, 1, lambda total: None, torch.device("cpu")).item() == pytest.approx(1.0, rel=1e-5)


def test_ranks_holding_copies_count_them_once():
    grad = torch.full((4,), 2.0)  # its norm is 4; each of 4 ranks holds a copy

    def four_identical_ranks(total: torch.Tensor) -> None:
        total.mul_(4)  # what an all-reduce over 4 ranks that added the same value gives

    assert global_norm([grad], 4, four_identical_ranks, torch.device("cpu")).item() == pytest.approx(4.0)
