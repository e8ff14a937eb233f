"""A processor's matmul peak: measured (several short trials, the best kept, with how busy the CPU was) and bounded from
the CPU itself (cores x clock x FLOPs per cycle of its widest vector or matrix unit). A measurement taken while other
processes share the cores reads low; it is recognised (this process got less than 85% of the CPU time its trials took,
more runnable tasks than cores, or trials that disagree by more than 1.5x) and marked provisional, so the next run
measures again (peak.py)."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import dtype_name

TRIALS = 5
TRIAL_SECONDS = 0.06   # each trial runs at least this long (and 3 matmuls)
LARGEST_CALL_SECONDS = 0.05  # matrices grow (256 .. 2048) while one matmul takes less than this
SIZES = (256, 512, 1024, 2048)
BUSY_SHARE, DISAGREEMENT = 0.85, 1.5

# FLOPs per cycle per core of the widest unit a CPU flag shows (an upper bound: the units a core really has
# may be fewer, e.g. AVX-512 split over 256-bit pipes).
FLOPS_PER_CYCLE = {
    "fp32": (("avx512f", 64), ("avx2", 32), ("sse2", 8)),   # 2 FMA units x 16 | 8 lanes x 2, or 4-wide mul + add
    "bf16": (("amx_bf16", 1024), ("avx512_bf16", 128)),      # AMX tiles; VDPBF16PS (2 x 32 lanes x 2)
    "fp16": (("amx_fp16", 1024), ("avx512_fp16", 128)),
}


@dataclass(frozen=True)
class GemmMeasurement:
    tflops: float        # the best trial
    trials: int
    spread: float        # the best trial over the worst
    cpu_share: float     # CPU time this process got over the trials' wall time x threads
    runnable: int        # tasks running or waiting for a core when it started (all processes)
    cores: int

    @property
    def busy(self) -> bool:
        """Taken while the CPU was shared: to be measured again."""
        return self.cpu_share < BUSY_SHARE or self.runnable > self.cores or self.spread > DISAGREEMENT

    def describe(self) -> str:
        return (f"best of {self.trials} trials, {self.cpu_share:.0%} of the CPU time"
                + (", taken while the CPU was busy: measured again next run" if self.busy else ""))


def measure_gemm(device: torch.device, dtype: torch.dtype) -> GemmMeasurement:
    """Square matmuls in `dtype`, the best of `TRIALS` (docs/performance.md, 'What every run measures')."""
    generator = torch.Generator().manual_seed(0)  # the run's own random state is left alone
    for size in SIZES:  # the last one tried is timed
        a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
        start = time.perf_counter()
        torch.mm(a, b)  # warm-up (library start-up, thread pool) and the call's duration
        _sync(device)
        if time.perf_counter() - start > LARGEST_CALL_SECONDS:
            break
    runnable, rates = _runnable_tasks(), []
    cpu_start, wall_start = _cpu_seconds(), time.perf_counter()
    for _ in range(TRIALS):
        reps, start = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - start < TRIAL_SECONDS:
            torch.mm(a, b)
            reps += 1
        _sync(device)
        rates.append(2 * size**3 * reps / (time.perf_counter() - start) / 1e12)
    wall = time.perf_counter() - wall_start
    share = (_cpu_seconds() - cpu_start) / (wall * torch.get_num_threads()) if device.type == "cpu" else 1.0
    return GemmMeasurement(max(rates), TRIALS, max(rates) / max(min(rates), 1e-12), min(share, 1.0), runnable,
                           _cores())


def cpu_bound(dtype: torch.dtype, threads: int) -> str:
    """The TFLOP/s of `threads` cores x the highest clock the CPU lists x FLOPs per cycle of its widest unit for
    `dtype`, with how it is made up; why there is none where the clock or the flags cannot be read."""
    flags, mhz = cpu_flags(), _max_mhz()
    name = dtype_name(dtype)
    table = FLOPS_PER_CYCLE.get(name, ()) + (FLOPS_PER_CYCLE["fp32"] if name != "fp32" else ())
    unit = next(((flag, per_cycle) for flag, per_cycle in table if flag in flags), None)
    if unit is None or mhz is None:
        return "no CPU bound (its flags or clock cannot be read)"
    flag, per_cycle = unit
    tflops = threads * mhz * 1e6 * per_cycle / 1e12
    return f"bound {tflops:,.3g} TFLOP/s = {threads} core(s) x {mhz / 1000:.2f} GHz x {per_cycle} FLOP/cycle ({flag})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _runnable_tasks() -> int:
    """Tasks running or waiting for a core, this process's own thread included (/proc/loadavg's 4th field)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return 0


def cpuinfo_values(field: str) -> list[str]:
    """The values of `field` in /proc/cpuinfo, one per processor listed (none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(field)]


def cpu_flags() -> set[str]:
    flags = cpuinfo_values("flags")
    return set(flags[0].split()) if flags else set()


def _max_mhz() -> float | None:
    """The highest clock the CPU lists: cpufreq's maximum, else the largest `cpu MHz` of /proc/cpuinfo."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1000
    except (OSError, ValueError):
        pass
    try:
        return max(map(float, cpuinfo_values("cpu MHz")), default=None)
    except ValueError:
        return None
