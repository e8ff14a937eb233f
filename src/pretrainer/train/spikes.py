"""The optional spike rules (`loss_spike_factor`, `spike_zscore`), which skip an update: weights, optimizer state and
schedule stay as they were (docs/optimization.md, 'Spike rules').

Only accepted steps join the windows, so a run of spikes cannot raise the mean that judges them. The rules run
inside the engine's optimizer step, once the gradient norm is known, and read the loss with it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

FACTOR_WINDOW = 50       # accepted losses in the factor rule's running mean
FACTOR_MIN_HISTORY = 5


class SpikeGuard:
    def __init__(self, factor: float | None, zscore: float | None, window: int):
        self.factor, self.zscore, self.window = factor, zscore, window
        self.losses: deque[float] = deque(maxlen=max(FACTOR_WINDOW, window))
        self.norms: deque[float] = deque(maxlen=window)
        self.reason: str | None = None  # why the current step's update is skipped
        self._loss = float("nan")       # the current step's

    @staticmethod
    def of(args) -> "SpikeGuard | None":
        if not args.loss_spike_factor and not args.spike_zscore:
            return None
        return SpikeGuard(args.loss_spike_factor, args.spike_zscore, args.spike_window)

    def rule(self, loss_sum: torch.Tensor, targets: torch.Tensor):
        """The step's skip rule for the engine's optimizer step: the step's loss is read with the gradient norm, in one
        transfer (the non-finite check reads the norm anyway), so the rules add no wait of their own for the device."""
        def decide(grad_norm: torch.Tensor) -> bool:
            loss, norm = torch.stack([loss_sum.double() / targets.double().clamp(min=1),
                                      grad_norm.detach().double().to(loss_sum.device)]).tolist()
            self._loss, self.reason = loss, None
            if not (math.isfinite(loss) and math.isfinite(norm)):  # the non-finite check's to skip
                return False
            self.reason = self._loss_reason(loss) or self._zscore_reason("gradient norm", norm, list(self.norms))
            return self.reason is not None
        return decide

    def _loss_reason(self, loss: float) -> str | None:
        recent = list(self.losses)[-FACTOR_WINDOW:]
        if self.factor and len(recent) >= FACTOR_MIN_HISTORY and loss > self.factor * statistics.fmean(recent):
            return f"loss spike: {loss:.4g} is above {self.factor:g} x the mean of the last {len(recent)} accepted " \
                   "steps"
        return self._zscore_reason("loss", loss, list(self.losses)[-self.window:])

    def _zscore_reason(self, name: str, value: float, history: list[float]) -> str | None:
        if not self.zscore or len(history) < max(2, self.window // 2):
            return None
        mean, deviation = statistics.fmean(history), statistics.pstdev(history)
        if deviation > 0 and value - mean > self.zscore * deviation:
            return f"{name} spike: {value:.4g} is {(value - mean) / deviation:.1f} standard deviations above the " \
                   f"mean {mean:.4g} of the last {len(history)} accepted steps (spike_zscore {self.zscore:g})"
        return None

    def after_update(self, applied: bool, grad_norm) -> None:
        if applied:
            self.losses.append(self._loss)
            self.norms.append(float(grad_norm))

    def state_dict(self) -> dict:
        return {"loss": list(self.losses), "grad_norm": list(self.norms)}

    def load_state_dict(self, history) -> None:
        if isinstance(history, list):  # written before the gradient-norm window existed: losses only
            history = {"loss": history, "grad_norm": []}
        self.losses.extend(history.get("loss", []))
        self.norms.extend(history.get("grad_norm", []))
