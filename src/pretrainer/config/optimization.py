"""The optimizer's and the learning-rate schedule's settings, read once from the config: the optimizer builder,
the schedule and DeepSpeed's JSON blocks all take these instead of the arguments."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    clip_grad: float | None

    @staticmethod
    def of(args) -> "OptimizerSettings":
        return OptimizerSettings(args.lr, (args.adam_beta1, args.adam_beta2), args.adam_eps, args.weight_decay,
                                 args.clip_grad)


@dataclass(frozen=True)
class ScheduleSettings:
    lr: float                # the peak
    min_lr: float
    total_steps: int
    warmup_steps: int
    style: str               # cosine | linear | constant | wsd
    wsd_decay_fraction: float

    @staticmethod
    def of(args) -> "ScheduleSettings":
        return ScheduleSettings(args.lr, args.min_lr, args.num_training_steps, args.warmup_steps_resolved(),
                                args.lr_decay_style, args.wsd_decay_fraction)

    @property
    def min_ratio(self) -> float:
        return self.min_lr / self.lr

    def describe(self) -> str:
        return f"{self.lr:g} ({self.style}, warmup {self.warmup_steps} steps, min {self.min_lr:g})"
