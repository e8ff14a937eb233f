"""The device a process runs on (`device`), and the compute dtype (`dtype`; `auto` decided by perf/dtype_choice.py)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..config import ConfigError
from ..perf.dtype_choice import choose_dtype, cpu_matrix_flags, cpu_speedup, slow_dtype_warning

logger = logging.getLogger("pretrainer")


def resolve_device(name: str) -> torch.device:
    """`device`: auto (the accelerator, else the CPU), or a device type that this machine has."""
    available = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if name == "auto":
        return torch.device(available.type) if available is not None else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"key 'device': {exc}") from None
    if device.type != "cpu" and (available is None or available.type != device.type):
        raise ConfigError(f"key 'device': {name!r}, but this machine has "
                          f"{'no accelerator' if available is None else 'a ' + available.type + ' device'}"
                          "; set device: auto (or cpu)")
    return device


def resolve_dtype(setting: str, device_type: str, agree: Callable = lambda value: value,
                  accelerator_bf16: bool | None = None) -> tuple[str, str | None]:
    """(compute dtype, why, for `auto`). `auto` is measured on CPUs, so every rank takes rank 0's choice (`agree`: a
    broadcast). `accelerator_bf16`: whether the accelerator has bf16 (default: asked of the device)."""
    on_cpu = device_type == "cpu"
    if setting != "auto":
        if on_cpu and setting != "fp32":
            warning = slow_dtype_warning(setting, cpu_speedup(setting), cpu_matrix_flags())
            if warning:
                logger.warning("%s", warning)
        return setting, None
    if accelerator_bf16 is None:
        accelerator_bf16 = torch.cuda.is_bf16_supported() if device_type == "cuda" else not on_cpu
    dtype, reason = choose_dtype(device_type, accelerator_bf16, cpu_speedup("bf16") if on_cpu else None,
                                 cpu_matrix_flags() if on_cpu else [])
    chosen = agree(dtype)
    if chosen != dtype:
        reason = f"rank 0's choice ({reason} on this rank, {dtype})"
    logger.info("dtype: auto -> %s: %s", chosen, reason)
    return chosen, reason
