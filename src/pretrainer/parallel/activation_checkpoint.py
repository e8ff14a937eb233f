"""Activation checkpointing of decoder layers, for every engine.

- `full`: a layer keeps only its input; everything inside is recomputed in backward (least memory, about one extra
  forward of compute).
- `selective`: a layer keeps the outputs of its matrix multiplications and attention and recomputes only the cheap
  element-wise ops (norms, activations, rotary): most of the element-wise activations' memory for a few % of compute.

Megatron's `recompute_method` / `recompute_num_layers` (the megatron engine's settings) group the layers of a
pipeline stage for `full`: `uniform` checkpoints runs of `num_layers` layers as one unit, `block` the first
`num_layers` layers one by one. Elsewhere `full` checkpoints every layer on its own.

Layers are wrapped in place (the wrapper replaces the layer in its parent), before an engine shards them;
`apply_activation_checkpointing` is the one entry point every engine calls (see parallelize.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..config import ACTIVATION_CHECKPOINTING, ConfigError


@dataclass(frozen=True)
class RecomputeSettings:
    mode: str = "none"                # none | full | selective (config.ACTIVATION_CHECKPOINTING)
    method: str = "uniform"           # full, in pipeline stages: uniform | block
    num_layers: int | None = None     # full, in pipeline stages: layers per unit (uniform) or checkpointed (block)

    def describe(self) -> str:
        if self.mode == "full" and (self.method != "uniform" or self.num_layers):
            return f"full/{self.method}/{self.num_layers}"
        return self.mode

# Ops whose outputs `selective` keeps: the expensive ones.
SELECTIVE_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (their wrapper if checkpointed), by the class names in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(inner_layer(m)).__name__ in names]
    wrapped = {id(m._checkpoint_wrapped_module) for m in found if isinstance(m, CheckpointWrapper)}
    layers = [m for m in found if id(m) not in wrapped]
    if not layers:
        raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} (it declares no "
                          "_no_split_modules); use activation_checkpointing: none and engine: ddp or single")
    return layers


def inner_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside its activation-checkpointing wrapper (the module itself when not wrapped)."""
    return module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module


def apply_activation_checkpointing(model: torch.nn.Module, recompute: RecomputeSettings) -> None:
    mode = recompute.mode
    if mode == "none":
        return
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(f"key 'activation_checkpointing': {mode!r} is not one of "
                          f"{', '.join(ACTIVATION_CHECKPOINTING)}")
    if mode == "full" and hasattr(model, "set_recompute"):  # a pipeline stage checkpoints groups of its layers
        model.set_recompute(recompute.method, recompute.num_layers)
        return
    options = {}
    if mode == "selective":
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    layers = {id(layer) for layer in decoder_layers(model)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in layers:
                parent.register_module(name, checkpoint_wrapper(child, **options))
