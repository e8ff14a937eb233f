"""Muon for the hidden matrices, AdamW for the rest, as one optimizer (docs/optimization.md, 'Muon').

Newton-Schulz needs the whole matrix: a parameter sharded over ranks (a DTensor) has its update gathered and
orthogonalised on every rank holding a piece, each keeping its own piece, so the step equals one process's.
One optimizer object (an `AdamW` whose groups marked `muon` take the Muon update), so the schedule, clipping, skipped
updates and DCP checkpoints see a single optimizer and the AdamW groups keep torch's fused kernel and state names.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..config import MUON_ADJUST_LR

# The quintic iteration's coefficients (Keller Jordan's, also torch.optim.Muon's): a steep slope at zero
# so few steps push every singular value into about [0.7, 1.2].
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The Newton-Schulz approximation of U V^T for each matrix in the last two dimensions of `update`
    (a 3-D tensor: one matrix per expert), computed in `dtype`; returned in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)  # spectral norm <= Frobenius norm <= 1
    fused = torch.addmm if x.dim() == 2 else torch.baddbmm  # addmm: the same kernels, so rounding, as torch.optim.Muon
    for _ in range(steps):
        gram = x @ x.mT
        x = fused(x, fused(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def lr_scale(shape: torch.Size, rule: str) -> float:
    """The lr factor for a matrix of `shape` ([..., out, in]) under `muon_adjust_lr` (docs/optimization.md)."""
    rows, cols = shape[-2], shape[-1]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral":
        return math.sqrt(rows / cols)
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"unknown muon_adjust_lr {rule!r}; use one of {', '.join(MUON_ADJUST_LR)}")


def own_piece(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full`, laid out as `like` (a local slice: every rank holds `full`)."""
    if not isinstance(like, DTensor):
        return full
    replicated = DTensor.from_local(full, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)
    return replicated.redistribute(like.device_mesh, like.placements)


class MuonAdamW(torch.optim.AdamW):
    """AdamW over the groups with `muon: False`, Muon over those with `muon: True` (each parameter at least 2-D; a 3-D
    one stacks one matrix per expert). Muon groups take `momentum`, `nesterov`, `ns_steps`, `adjust_lr` and `ns_dtype`
    (bf16 | fp32: the iteration's precision), besides `lr` and `weight_decay` (decoupled, lr x wd)."""

    def __init__(self, params, *, momentum: float, nesterov: bool, ns_steps: int, adjust_lr: str,
                 ns_dtype: str, **adamw):
        super().__init__(params, **adamw)
        for group in self.param_groups:
            group.setdefault("muon", False)
            if group["muon"]:
                for key, value in (("momentum", momentum), ("nesterov", nesterov), ("ns_steps", ns_steps),
                                   ("adjust_lr", adjust_lr), ("ns_dtype", ns_dtype)):
                    group.setdefault(key, value)
                lr_scale(torch.Size([1, 1]), group["adjust_lr"])  # an unknown rule fails here, not at step 1
                for param in group["params"]:
                    if param.dim() < 2:
                        raise ValueError(f"Muon takes matrices; a parameter of shape {tuple(param.shape)} is in "
                                         "a Muon group")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        try:  # AdamW's own step (its fused kernel, its state) over the AdamW groups only
            self.param_groups = [g for g in groups if not g["muon"]]
            super().step()
        finally:
            self.param_groups = groups
        for group in groups:
            if group["muon"]:
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad)
                state["step"] = torch.tensor(0.0)  # a count of updates, as AdamW's state has (its loader wants one)
            state["step"] += 1
            buffer = state["momentum_buffer"]
            buffer.lerp_(param.grad, 1 - momentum)
            update = param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            if isinstance(update, DTensor):  # the full matrix: an all-gather over the mesh dimensions that shard it
                update = update.full_tensor()
            full = orthogonalize(update, group["ns_steps"], NS_DTYPES[group["ns_dtype"]]).to(param.dtype)
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(own_piece(full, param), alpha=-lr * lr_scale(param.shape, group["adjust_lr"]))
