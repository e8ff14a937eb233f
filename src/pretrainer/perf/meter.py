"""Per-interval training figures (loss, useful tokens/s overall and per device, MFU, step-phase times), accumulated as
device tensors and read once per logged row, so no other step waits for the device."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
import time
from collections import defaultdict

import torch

from .flops import FlopsCount
from .peak import DevicePeak, raise_peak

logger = logging.getLogger(__name__)


class StepPhases:
    """Where a step's time goes: data wait, compute (forward + backward), communication, optimizer. Host phases are
    timed with the host clock, device phases with CUDA events read only when a row is logged (on CPU: host clock).
    Gradient all-reduces that DDP/FSDP overlap with backward count as compute (only a profiler separates them)."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self._host = defaultdict(float)  # seconds
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def host(self, name: str):
        start = time.perf_counter()
        yield
        self._host[name] += time.perf_counter() - start

    @contextlib.contextmanager
    def device(self, name: str):
        if not self.events:
            with self.host(name):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((name, start, end))

    def collect(self) -> dict[str, float]:
        """Milliseconds per phase since the last call."""
        out = {f"{name}_ms": 1000 * seconds for name, seconds in self._host.items()}
        if self._pending:
            self._pending[-1][2].synchronize()
            for name, start, end in self._pending:
                out[f"{name}_ms"] = out.get(f"{name}_ms", 0.0) + start.elapsed_time(end)
        self._host.clear()
        self._pending.clear()
        return out


class IntervalMeter:
    def __init__(self, engine, flops: FlopsCount, peak: DevicePeak, recompute: str = "none"):
        self.engine, self.flops, self.peak, self.recompute = engine, flops, peak, recompute
        self.performed_per_token = flops.performed_per_token(recompute)
        self._warned = False
        self.phases = StepPhases(engine.device)
        # not yet in the train state's tokens
        self.pending_targets = torch.zeros((), dtype=torch.int64, device=engine.device)
        self._reset()

    def use_seq_length(self, seq_length: int) -> None:
        """Count attention's FLOPs at `seq_length` from now on (a sequence-length stage)."""
        self.flops = dataclasses.replace(self.flops, seq_length=seq_length)
        self.performed_per_token = self.flops.performed_per_token(self.recompute)

    def _reset(self) -> None:
        device = self.engine.device
        self.loss = torch.zeros((), dtype=torch.float64, device=device)  # this rank's token-loss sum
        self.counts = torch.zeros(2, dtype=torch.int64, device=device)  # global [targets, useful inputs]
        self.steps, self.seconds = 0, 0.0

    def add(self, loss: torch.Tensor, counts: torch.Tensor, seconds: float) -> None:
        self.loss += loss
        self.counts += counts
        self.pending_targets += counts[0]
        self.steps += 1
        self.seconds += seconds

    def take_targets(self) -> int:
        """Targets trained on since the last call (all ranks): one device read."""
        value = int(self.pending_targets.item())
        self.pending_targets.zero_()
        return value

    def row(self) -> dict:
        """The interval's figures (a collective: every rank calls it at the same step), then a fresh interval."""
        engine = self.engine
        loss_sum = engine.reduce_sum(self.loss).item()
        targets, inputs = self.counts.tolist()
        if targets == 0:
            logger.warning("%d step(s) without a single target token: every label is -100 or padding (prompt "
                           "masking longer than seq_length?); nothing was learned from them", self.steps)
        tokens_per_s = inputs / self.seconds
        per_device = tokens_per_s / engine.world_size
        phases = {k: v / self.steps for k, v in self.phases.collect().items()}
        self._check_peak(per_device)
        row = {"loss": loss_sum / max(targets, 1), "tokens_per_s": tokens_per_s,
               "tokens_per_s_per_device": per_device,
               "mfu": per_device * self.flops.per_token / (self.peak.tflops * 1e12),
               "step_tokens": inputs // self.steps, "elapsed_ms": 1000 * self.seconds / self.steps, **phases}
        row.update(memory_row(engine))
        self._reset()
        return row


    def _check_peak(self, tokens_per_s_per_device: float) -> None:
        """When a device does more than its peak: raise a measured one, report a rated or configured one, explain
        MFU above 100% from PaLM's full attention square (docs/performance.md). Every rank decides alike."""
        done = tokens_per_s_per_device * self.performed_per_token / 1e12
        counted = tokens_per_s_per_device * self.flops.per_token / 1e12
        if max(done, counted) > self.peak.tflops and self.peak.cache_key is not None:
            raised = max(done, counted)
            if self.engine.is_main:
                logger.warning("this run does %.3g TFLOP/s per device (%.3g in model FLOPs), more than the measured "
                               "peak %.3g (%s): the peak was measured low, on a busy CPU; raised to %.3g and cached",
                               done, counted, self.peak.tflops, self.peak.source, raised)
            self.peak = raise_peak(self.peak, raised, write=self.engine.is_main)
        elif done > self.peak.tflops and not self._warned:
            self._warned = True
            logger.warning("this run does %.3g TFLOP/s per device, more than the peak %.3g it is measured against "
                           "(%s): that peak is too low, so MFU reads above 100%%", done, self.peak.tflops,
                           self.peak.source)
        elif counted > self.peak.tflops and not self._warned:
            self._warned = True
            logger.warning("MFU above 100%%: model FLOPs count attention over the full square (PaLM's convention), "
                           "twice what causal attention computes; the device ran at %.0f%% of its peak",
                           100 * done / self.peak.tflops)


def memory_row(engine) -> dict:
    """Peak memory, the largest over ranks: CUDA max allocated and reserved, or the process's peak RSS."""
    device = engine.device
    if device.type == "cuda":
        return {"peak_mem_mb": engine.reduce_max(torch.cuda.max_memory_allocated(device) / 2**20),
                "peak_reserved_mb": engine.reduce_max(torch.cuda.max_memory_reserved(device) / 2**20)}
    return {"peak_mem_mb": engine.reduce_max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
