"""The learning-rate schedules: linear warmup, then cosine, linear, constant or warmup-stable-decay (WSD).

Lengths arrive in updates (`ScheduleSettings` divides token lengths by the tokens of one update, so they may be
fractional). Update k (0-based) ends at position k + 1; warmup rises as position / warmup, so its last update reaches
the peak. Cosine and linear then decay over the remaining updates to `min_lr` at the last one. WSD stays at the peak
until the last `decay` positions and decays over them in `decay_shape`, reaching `min_lr` at the last update. A cooldown
branch from step N decays from the parent's lr at N the same way over its own length: with the parent stable at N, the
branch's updates get exactly the lrs of a WSD run ending at the branch's end with a decay of the branch's length.
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
    """Multiplier of the peak lr for the update numbered `step` (0-based). `decay` (updates, WSD): the decay phase's
    length; None: `wsd_decay_fraction` of the updates after warmup (all but the first, which is the peak)."""
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
    if style in ("cosine", "linear"):
        return min_ratio + (1 - min_ratio) * DECAY_SHAPES[style](progress)
    raise ValueError(f"unknown lr_decay_style {style!r}")


def schedule_multiplier(settings: ScheduleSettings, step: int) -> float:
    branch = settings.branch
    if branch is not None:  # a cooldown branch: from the parent's lr at its step down to min_lr
        progress = min(1.0, max(0.0, (step + 1 - branch.step) / settings.decay_steps))
        low = settings.min_ratio
        return low + (branch.lr_ratio - low) * DECAY_SHAPES[settings.decay_shape](progress)
    return lr_multiplier(step, total=settings.total_steps, warmup=settings.warmup_steps, style=settings.style,
                         min_ratio=settings.min_ratio, wsd_decay_fraction=settings.wsd_decay_fraction,
                         decay_shape=settings.decay_shape, decay=settings.decay_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, settings: ScheduleSettings) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule_multiplier(settings, step))


def realign_to_schedule(scheduler, base_lrs: list[float]) -> None:
    """Give each group the lr its schedule sets at the current step from this run's peaks `base_lrs`: after a resume
    onto another schedule (a cooldown branch, override_schedule) the saved lrs are the old schedule's."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    scheduler.base_lrs = list(base_lrs)
    values = [base * rule(scheduler.last_epoch) for base, rule in zip(base_lrs, scheduler.lr_lambdas)]
    for group, base, value in zip(scheduler.optimizer.param_groups, base_lrs, values):
        group["initial_lr"], group["lr"] = base, value
    scheduler._last_lr = values
