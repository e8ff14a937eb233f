"""The peak FLOP/s that MFU is measured against: a table of rated dense peaks for common accelerators, a measured GEMM
rate (cached; cpu_peak.py) on CPUs and unknown devices, or the config's `peak_tflops`. A run that does more than a
measured peak raises it (`raise_peak`): the peak is at least what was done."""

from __future__ import annotations

import logging
import platform
import re
import time
from dataclasses import dataclass, replace

import torch

from ..config import dtype_name
from .cpu_peak import cpu_bound, cpuinfo_values, measure_gemm
from .machine_cache import cache_path, read_entry, write_entry

logger = logging.getLogger(__name__)

# the vendors' dense TFLOP/s per device (never the 2:4-sparsity figures): (name pattern, bf16/fp16 tensor cores, tf32,
# fp32); checked in order, so specific names come before their prefixes.
RATED_TFLOPS = (
    (r"GB200|B200", 2250.0, 1100.0, 80.0),
    (r"H100.*PCIe", 756.0, 378.0, 51.0),
    # SXM boards held to 500 W (torchtitan's published cluster): the NVL figure, the lower bound its authors give
    (r"H100.*500W", 835.0, 418.0, 60.0),
    (r"H100.*NVL", 835.0, 418.0, 60.0),
    (r"GH200|H200|H100|H800", 989.0, 494.0, 67.0),
    (r"H20\b", 148.0, 74.0, 44.0),
    (r"A100|A800", 312.0, 156.0, 19.5),
    (r"A10G", 70.0, 35.0, 31.2),
    (r"A10\b", 125.0, 62.5, 31.2),
    (r"L40S", 362.0, 183.0, 91.6),
    (r"L4\b", 121.0, 60.0, 30.3),
    (r"V100", 125.0, 0.0, 15.7),  # fp16 tensor cores; no bf16 or TF32
    (r"MI300X", 1307.0, 653.0, 163.4),
    (r"MI250X", 383.0, 0.0, 47.9),
)


@dataclass(frozen=True)
class DevicePeak:
    tflops: float  # per device, in the run's compute dtype
    source: str
    cache_key: str | None = None  # a measured peak: where it is cached (a run may raise it)
    bound: str = ""               # the CPU's own upper bound, as text

    def describe(self) -> str:
        bound = f"; {self.bound}" if self.bound else ""
        return f"peak {self.tflops:,.3g} TFLOP/s per device ({self.source}{bound})"


def device_peak(device: torch.device, dtype: torch.dtype, override_tflops: float | None = None) -> DevicePeak:
    if override_tflops:
        return DevicePeak(float(override_tflops), "config peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        rated = rated_peak(name, dtype)
        if rated:
            return DevicePeak(rated, f"rated dense {dtype_name(dtype)} of {name}")
    return measured_peak(device, dtype)


def rated_peak(name: str, dtype: torch.dtype) -> float | None:
    for pattern, half, tf32, fp32 in RATED_TFLOPS:
        if re.search(pattern, name):
            if dtype in (torch.bfloat16, torch.float16):
                return half
            uses_tf32 = torch.get_float32_matmul_precision() != "highest"
            return (tf32 or fp32) if uses_tf32 else fp32
    return None


def measured_peak(device: torch.device, dtype: torch.dtype) -> DevicePeak:
    """The best rate of square matmuls in `dtype` here, measured once and cached (docs/performance.md)."""
    threads = torch.get_num_threads()
    key = (f"gemm|{device.type}|{processor_name(device)}|threads={threads}|{dtype_name(dtype)}|"
           f"torch={torch.__version__}")
    entry = read_entry(key)
    if not isinstance(entry, dict) or entry.get("busy"):
        measured = measure_gemm(device, dtype)
        kept = entry.get("tflops", 0.0) if isinstance(entry, dict) else 0.0
        entry = {"tflops": max(measured.tflops, kept), "how": measured.describe(), "busy": measured.busy,
                 "when": time.strftime("%Y-%m-%d %H:%M:%S"), "runnable_tasks": measured.runnable,
                 "cores": measured.cores, "trials": measured.trials, "spread": round(measured.spread, 3)}
        write_entry(key, entry)
    bound = cpu_bound(dtype, threads) if device.type == "cpu" else ""
    return DevicePeak(entry["tflops"], f"measured {dtype_name(dtype)} GEMM, {threads} thread(s), {entry['how']}, "
                      f"cached in {cache_path()}", key, bound)


def raise_peak(peak: DevicePeak, achieved_tflops: float, write: bool = True) -> DevicePeak:
    """A measured peak that a run exceeded, raised to what it did (written to the cache with `write`)."""
    how = f"raised to what a run did on {time.strftime('%Y-%m-%d %H:%M:%S')}"
    if write and peak.cache_key is not None:
        write_entry(peak.cache_key, {**(read_entry(peak.cache_key) or {}), "tflops": achieved_tflops, "how": how,
                                     "busy": False})
    source = ", ".join(peak.source.split(", ")[:2] + [how])  # "measured fp32 GEMM, 2 thread(s), raised ..."
    return replace(peak, tflops=achieved_tflops, source=source)


def processor_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    names = cpuinfo_values("model name")
    return names[0] if names else platform.processor() or platform.machine()


