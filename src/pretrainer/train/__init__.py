"""Training: the PreTrainer loop, optimizer and schedules, checkpoints, evaluation, metrics, export."""

from .trainer import PreTrainer

__all__ = ["PreTrainer"]
