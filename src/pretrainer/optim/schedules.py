"""The learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay (WSD).

Lengths arrive in updates (`ScheduleSettings`: the config's token lengths are already divided by the tokens of
one update, so they may be fractional). Update k (0-based) ends at position k + 1; warmup rises as
position / warmup, so its last update reaches the peak. Cosine and linear then decay over the remaining
updates to `min_lr` at the last one. WSD stays at the peak until the last `decay` positions and decays over
them in the chosen shape (`decay_shape`), reaching `min_lr` at the last update.
"""

from __future__ import annotations

import math

import torch

from ..config import ScheduleSettings

DECAY_SHAPES = {  # the share of (peak - min) left at decay progress p in [0, 1]
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1 - math.sqrt(p),  # Hägele et al. 2024: matches cosine's final loss from a WSD run
}


def lr_multiplier(step: int, *, total: int, warmup: float, style: str, min_ratio: float,
                  wsd_decay_fraction: float = 0.2, decay_shape: str = "linear",
                  decay: float | None = None) -> float:
    """Multiplier of the peak lr for the update numbered `step` (0-based).

    `decay` (updates, WSD): the length of the decay phase; None: `wsd_decay_fraction` of the updates after
    warmup (all but the first, which is the peak).
    """
    position = step + 1
    if warmup and position < warmup:
        return position / warmup
    if style == "constant":
        return 1.0
    if style == "wsd":
        length = decay if decay is not None else wsd_decay_fraction * max(1.0, total - warmup - 1)
        progress = min(1.0, max(0.0, (position - (total - length)) / length))
        return min_ratio + (1 - min_ratio) * DECAY_SHAPES[decay_shape](progress)
    progress = min(1.0, max(0.0, (step - warmup) / max(1.0, total - warmup - 1)))
    if style == "cosine":
        return min_ratio + (1 - min_ratio) * DECAY_SHAPES["cosine"](progress)
    if style == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    raise ValueError(f"unknown lr_decay_style {style!r}")


def schedule_multiplier(settings: ScheduleSettings, step: int) -> float:
    return lr_multiplier(step, total=settings.total_steps, warmup=settings.warmup_steps, style=settings.style,
                         min_ratio=settings.min_ratio, decay_shape=settings.decay_shape,
                         decay=settings.decay_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, settings: ScheduleSettings) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule_multiplier(settings, step))
