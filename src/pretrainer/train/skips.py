"""Skipped updates: a step whose update is dropped (a non-finite gradient norm, or a loss spike) is counted and
logged; too many in a row stop the run without saving, since the state that produced them is suspect."""

from __future__ import annotations

import logging

from .errors import TrainingDiverged

logger = logging.getLogger("pretrainer")


class SkippedUpdates:
    def __init__(self, limit: int | None):
        self.limit = limit          # max_skipped_updates: this many in a row stop the run (0/None: never)
        self.total = 0              # in the run (saved with checkpoints)
        self.in_a_row = 0

    def record(self, step: int, applied: bool, grad_norm, reason: str | None) -> dict | None:
        """After `step`'s optimizer step: the metrics row of a skipped update (None when it was applied).
        `reason`: a spike rule's; None: the gradient norm was not finite."""
        if applied:
            self.in_a_row = 0
            return None
        reason = reason or "non-finite gradient norm"
        self.total += 1
        self.in_a_row += 1
        logger.warning("step %d: %s (gradient norm %s), update skipped (%d in a row, %d in the run)", step, reason,
                       float(grad_norm), self.in_a_row, self.total)
        if self.limit and self.in_a_row >= self.limit:
            raise TrainingDiverged(f"{self.in_a_row} updates in a row were skipped (last at step {step}: {reason}); "
                                   "the run stops without saving this state. Resume from the last checkpoint with a "
                                   "lower lr, more warmup or clip_grad, or raise max_skipped_updates")
        return {"step": step, "skipped_update": True, "reason": reason, "grad_norm": float(grad_norm),
                "skipped_in_a_row": self.in_a_row}

    def load(self, total) -> None:
        self.total = int(total)
