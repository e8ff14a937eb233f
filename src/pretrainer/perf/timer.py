"""Where a step's time goes: data wait, compute (forward + backward), communication, optimizer.

Host phases (waiting for the DataLoader, host-side collectives) are timed with the host clock; device phases with CUDA
events on GPUs, read only when a row is logged (the one sync), and with the host clock on CPU, where work is
synchronous. Gradient all-reduces that DDP/FSDP overlap with backward count as compute (only a profiler separates them).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class StepPhases:
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
