"""The learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay (WSD)."""

from __future__ import annotations

import math

import torch

from ..config import ScheduleSettings


def lr_multiplier(step: int, *, total: int, warmup: int, style: str, min_ratio: float,
                  wsd_decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak lr for the update numbered `step` (0-based).

    Warmup rises linearly and reaches the peak on its last step; decay then runs over the remaining
    steps down to `min_ratio` at the final step.
    """
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    decay_steps = max(1, total - warmup - 1)
    progress = min(1.0, (step - warmup) / decay_steps)
    if style == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if style == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    if style == "wsd":  # warmup, stable, then a linear decay over the last fraction of the steps
        decay_start = 1 - wsd_decay_fraction
        if progress <= decay_start:
            return 1.0
        return min_ratio + (1 - min_ratio) * (1 - (progress - decay_start) / wsd_decay_fraction)
    raise ValueError(f"unknown lr_decay_style {style!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, settings: ScheduleSettings) -> torch.optim.lr_scheduler.LambdaLR:
    def multiplier(step: int) -> float:
        return lr_multiplier(step, total=settings.total_steps, warmup=settings.warmup_steps, style=settings.style,
                             min_ratio=settings.min_ratio, wsd_decay_fraction=settings.wsd_decay_fraction)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
