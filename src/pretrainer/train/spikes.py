"""The optional loss-spike rule: skip an update whose loss exceeds `factor` x the running mean."""

from __future__ import annotations

from collections import deque

WINDOW = 50  # accepted steps in the running mean
MIN_HISTORY = 5  # the rule applies once this many steps are in it


class LossSpikeGuard:
    def __init__(self, factor: float):
        self.factor = factor
        self.history: deque[float] = deque(maxlen=WINDOW)

    def is_spike(self, loss: float) -> bool:
        """Whether to skip this step; an accepted step's loss joins the running mean."""
        if len(self.history) >= MIN_HISTORY and loss > self.factor * (sum(self.history) / len(self.history)):
            return True
        self.history.append(loss)
        return False

    def state_dict(self) -> list[float]:
        return list(self.history)

    def load_state_dict(self, history: list[float]) -> None:
        self.history = deque(history, maxlen=WINDOW)
