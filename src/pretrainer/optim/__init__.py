"""The optimizer and the learning-rate schedule, built from their settings (`config.optimization`)."""

from .adamw import build_optimizer, parameter_groups
from .schedules import build_scheduler, lr_multiplier

__all__ = ["build_optimizer", "build_scheduler", "lr_multiplier", "parameter_groups"]
