"""Whether low precision pays on this device, decided from the hardware rather than assumed.

On CPUs, bf16 matmuls are fast only where the cores have bf16 units (Intel AMX `amx_bf16`, AVX-512 `avx512_bf16`):
measured, 2-7x fp32 there and about 1/20 of fp32 elsewhere (an AMD EPYC without them). `cpu_speedup` measures the ratio
with small square matmuls (a second or less) and caches it per processor, thread count and torch version beside the GEMM
peak; `choose_dtype` and `slow_dtype_warning` turn it into `dtype: auto`'s choice and the warning an explicit
low-precision dtype gets, as pure functions of their inputs (tested without the machine they describe).
"""

from __future__ import annotations

import time

import torch

from ..config import torch_dtype
from .cpu_peak import cpu_flags
from .machine_cache import cached_measurement
from .peak import processor_name

PROBE_SIZE = 512
MATRIX_FLAGS = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16")


def cpu_matrix_flags() -> list[str]:
    """The CPU's flags that give bf16/fp16 matrix units (from /proc/cpuinfo; empty where unreadable)."""
    flags = cpu_flags()
    return [flag for flag in MATRIX_FLAGS if flag in flags]


def cpu_speedup(dtype_name: str) -> float:
    """Measured matmul rate of `dtype_name` over fp32 on this CPU (cached)."""
    threads = torch.get_num_threads()
    key = f"speedup|{processor_name(torch.device('cpu'))}|threads={threads}|{dtype_name}|torch={torch.__version__}"
    return cached_measurement(key, lambda: _rate(torch_dtype(dtype_name)) / _rate(torch.float32))


def _rate(dtype: torch.dtype) -> float:
    generator = torch.Generator().manual_seed(0)  # the run's own random state is left alone
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator).to(dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=generator).to(dtype)
    torch.mm(a, b)  # warm-up
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < 0.1:
        torch.mm(a, b)
        reps += 1
    return reps / (time.perf_counter() - start)


def choose_dtype(device_type: str, accelerator_bf16: bool, cpu_bf16_speedup: float | None,
                 flags: list[str] = ()) -> tuple[str, str]:
    """`dtype: auto` (docs/configuration.md): (dtype, why); never fp16, which needs loss scaling."""
    if device_type != "cpu":
        if accelerator_bf16:
            return "bf16", f"the {device_type} device supports bf16"
        return "fp32", f"the {device_type} device has no bf16; set dtype: fp16 for its half precision"
    units = f"; matrix flags: {' '.join(flags)}" if flags else "; no bf16 matrix units in its flags"
    if cpu_bf16_speedup is not None and cpu_bf16_speedup > 1.0:
        return "bf16", f"a bf16 matmul runs {cpu_bf16_speedup:.1f}x fp32 on this CPU (measured{units})"
    slower = 1 / max(cpu_bf16_speedup or 1e-9, 1e-9)
    return "fp32", f"a bf16 matmul runs {slower:.0f}x slower than fp32 on this CPU (measured{units})"


def slow_dtype_warning(dtype_name: str, speedup: float, flags: list[str] = ()) -> str | None:
    """The warning for an explicit `dtype` that is slower than fp32 on this CPU; None where it is not."""
    if speedup >= 1.0:
        return None
    units = f" (matrix flags: {' '.join(flags)})" if flags else " (no bf16/fp16 matrix units in its flags)"
    return (f"dtype={dtype_name} on this CPU{units}: a {dtype_name} matmul runs {1 / max(speedup, 1e-9):.0f}x "
            f"slower than fp32 here (measured); add `dtype=fp32`, or `dtype=auto` to choose by the hardware")
