"""The run's dtype names and the torch dtypes they stand for: the one table every layer reads."""

from __future__ import annotations

DTYPES = ("bf16", "fp16", "fp32")


def torch_dtype(name: str):
    """`bf16` -> torch.bfloat16, ... (torch is imported here, on first use: the config loads without it)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> `bf16`; other dtypes by their torch name."""
    return next((name for name in DTYPES if torch_dtype(name) == dtype), str(dtype))
