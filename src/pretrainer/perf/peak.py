"""The peak FLOP/s that MFU is measured against: a table of rated dense peaks for common accelerators,
a short measured GEMM rate (cached) on CPUs and unknown devices, or the config's `peak_tflops`.

Table values are the vendors' dense figures (never the 2:4-sparsity ones) in TFLOP/s per device, for
bf16/fp16 tensor cores, TF32, and plain fp32.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import dtype_name

logger = logging.getLogger(__name__)

# (name pattern, bf16/fp16, tf32, fp32); checked in order, so specific names come before their prefixes.
RATED_TFLOPS = (
    (r"GB200|B200", 2250.0, 1100.0, 80.0),
    (r"H100.*PCIe", 756.0, 378.0, 51.0),
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

    def describe(self) -> str:
        return f"peak {self.tflops:,.3g} TFLOP/s per device ({self.source})"


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
    """The best rate of square matmuls (1024 and 2048) in `dtype`, measured once per machine/threads/dtype."""
    threads = torch.get_num_threads()
    key = f"{device.type}|{processor_name(device)}|threads={threads}|{dtype_name(dtype)}|torch={torch.__version__}"
    tflops = cached_measurement(key, lambda: _measure(device, dtype))
    return DevicePeak(tflops, f"measured {dtype_name(dtype)} GEMM, {threads} thread(s), cached in {cache_path()}")


def cached_measurement(key: str, measure) -> float:
    """A measurement of this machine, taken once under `key` and kept in `cache_path()` (measured again
    where the cache cannot be written)."""
    path = cache_path()
    table = _read_json(path)
    if key not in table:
        value = measure()
        table = {**_read_json(path), key: value}  # read again: another process may have added its own
        _write_json(path, table)
    return table[key]


def _measure(device: torch.device, dtype: torch.dtype) -> float:
    best = 0.0
    generator = torch.Generator().manual_seed(0)  # the run's own random state is left alone
    for n in (1024, 2048):
        a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
        torch.mm(a, b)  # warm-up (library start-up, thread pool)
        _sync(device)
        reps, start = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - start < 0.3:
            torch.mm(a, b)
            reps += 1
        _sync(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start) / 1e12)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def processor_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "pretrainer" / "gemm_peak.json"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, table: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: measure again next time
        logger.info("could not cache the measured GEMM peak in %s (%s)", path, exc)
