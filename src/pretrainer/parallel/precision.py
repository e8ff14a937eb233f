"""Torch engines' mixed precision: fp32 master weights, bf16/fp16 compute by autocast, fp16's dynamic loss scaling."""

from __future__ import annotations

import contextlib

import torch

from ..config import torch_dtype


class Precision:
    def __init__(self, dtype: str, device: torch.device):
        self.dtype = dtype
        self.device = device
        self.compute_dtype = torch_dtype(dtype)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    def autocast(self):
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
