"""The engine interface the training loop talks to, and the single-process engine.

An engine owns devices, process groups, model wrapping, mixed precision,
the optimizer step and what goes into a checkpoint. The loop never branches on
the engine: data-parallel and model-parallel engines implement the same
methods.
"""

from __future__ import annotations

import contextlib
import logging
import os
from abc import ABC, abstractmethod

import torch

from ..config import ConfigError

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        try:
            return torch.device(name)
        except RuntimeError as exc:
            raise ConfigError(f"key 'device': {exc}") from None
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device(accelerator.type) if accelerator is not None else torch.device("cpu")


class Precision:
    """fp32 master weights; bf16/fp16 compute by autocast; fp16 adds dynamic loss scaling."""

    def __init__(self, dtype: str, device: torch.device):
        self.dtype = dtype
        self.device = device
        self.compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
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


class Engine(ABC):
    name: str

    def __init__(self, args):
        self.args = args
        self.device = resolve_device(args.device)
        self.precision = Precision(args.dtype, self.device)
        if self.device.type == "cpu" and args.dtype != "fp32":
            logger.warning("dtype=%s on CPU: most CPUs have no fast %s matrix units and run it many times slower "
                           "than fp32; add `dtype=fp32` unless this CPU has them", args.dtype, args.dtype)
        self.rank = 0
        self.world_size = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @abstractmethod
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place and wrap the model (DDP/FSDP/...); return what the loop calls forward on."""

    def no_sync(self, model: torch.nn.Module):
        """Context for accumulation micro-batches that must not communicate gradients."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.scale(loss).backward()

    def step(self, model: torch.nn.Module, optimizer, max_norm: float | None) -> tuple[torch.Tensor, bool]:
        """Unscale, clip, step. Returns (grad norm before clipping, whether the update was applied)."""
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            return grad_norm, scaler.get_scale() >= scale_before
        optimizer.step()
        return grad_norm, True

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def reduce_count(self, count: int) -> int:
        """Sum a host-side integer over ranks (one process: itself, without touching the device)."""
        return count

    def barrier(self) -> None:
        pass

    def model_state_dict(self, model: torch.nn.Module) -> dict:
        return model.state_dict()

    def load_model_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        model.load_state_dict(state)

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        """The whole model's weights on CPU, for HF export (on the main rank)."""
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"engine={self.name} world_size={self.world_size} device={self.device} dtype={self.args.dtype}"


class SingleEngine(Engine):
    """One process, one device."""

    name = "single"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)


def create_engine(args) -> Engine:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("ACCELERATE_USE_MEGATRON_LM", "false") == "true":
        raise ConfigError("ACCELERATE_USE_MEGATRON_LM=true (an accelerate config with distributed_type: MEGATRON_LM) "
                          "asks for the Megatron engine, which is not available in this version; launch with a "
                          "single-process config instead")
    if args.engine in ("auto", "single"):
        if world_size != 1:
            raise ConfigError(f"the launch started {world_size} processes (WORLD_SIZE={world_size}) but only the "
                              "single-process engine is available; launch one process")
        engine = SingleEngine(args)
    else:  # guarded by config validation
        raise ConfigError(f"key 'engine': unknown engine {args.engine!r}")
    args.check_world_size(engine.world_size)
    return engine
