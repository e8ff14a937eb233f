"""Materialise a meta-device model and initialise it the same way on every engine.

Each module is initialised by the model's own `_init_weights` rule under a seed derived from (run seed, module name), on
full-size tensors of that one module; parameters an engine has already sharded (DTensors) get their local shard of that
full tensor. The result does not depend on the engine, the world size or the order modules are visited, and no rank
holds more than one module's full weights at a time.

A model built for a checkpoint (`hf_weights.attach_checkpoint`) is filled from its files instead: each parameter and
saved buffer found there is read (only this rank's slice); only what the files lack (RoPE's computed buffers) goes
through the init rule.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config import Parametrization
from ..config.names import parameter_name
from .hf_weights import take_checkpoint
from .parametrization import init_scales


def has_meta_tensors(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device, seed: int,
                partition: Callable[[list[torch.nn.Parameter]], None] | None = None,
                parametrization: Parametrization | None = None) -> None:
    """Allocate storage for every meta tensor on `device`, then fill (from files) or initialise module by module.
    `partition` (DeepSpeed ZeRO-3) shards each module's parameters once filled, so only one module is ever whole
    and storage is allocated module by module. `parametrization` scales the init rule's std per parameter role."""
    scales = init_scales(model, parametrization) if parametrization is not None else {}
    checkpoint = take_checkpoint(model)
    if checkpoint is not None:
        checkpoint.check(model)
    if partition is None:
        model.to_empty(device=device)
    filled: set[int] = set()  # a tied parameter is one object under two modules: read once
    allocated: dict[int, torch.nn.Parameter] = {}  # module by module: meta parameter -> its allocated one
    for name, module in model.named_modules():
        tensors = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
        if not tensors:
            continue
        if partition is not None:
            tensors = _allocate_module(module, device, allocated)
            if not tensors:
                continue
        _fill_or_init(model, module, name, tensors, checkpoint, seed, filled, scales)
        if partition is not None:
            partition([t for key, t in tensors.items() if key in module._parameters])
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if checkpoint is not None:
        checkpoint.finish()


@torch.no_grad()
def materialize_modules(model: torch.nn.Module, modules: list[torch.nn.Module], device: torch.device, seed: int,
                        checkpoint=None, parametrization: Parametrization | None = None) -> None:
    """Allocate and fill (from `checkpoint`, a CheckpointTensors, where it holds them) or initialise the meta
    tensors of `modules` only, in a model whose other tensors are real (layers added to a loaded model): the same
    values as `materialize` gives them in a model built on the meta device."""
    wanted = {id(m) for top in modules for m in top.modules()}
    scales = init_scales(model, parametrization) if parametrization is not None else {}
    filled: set[int] = set()
    for name, module in model.named_modules():
        if id(module) not in wanted:
            continue
        tensors = _allocate_module(module, device, {})
        if tensors:
            _fill_or_init(model, module, name, tensors, checkpoint, seed, filled, scales)


def _fill_or_init(model, module: torch.nn.Module, name: str, tensors: dict, checkpoint, seed: int,
                  filled: set[int], scales: dict[str, float] | None = None) -> None:
    """One module's tensors: read from the checkpoint where it holds them, the rest by the init rule."""
    prefix = f"{name}." if name else ""
    # parameters, and buffers a checkpoint keeps (DeepSeek-V3's e_score_correction_bias)
    kept = [*module._parameters, *(k for k in module._buffers if k not in module._non_persistent_buffers_set)]
    stored = {key: checkpoint.locate(prefix + key) for key in kept if key in tensors} if checkpoint else {}
    stored = {key: found for key, found in stored.items() if found is not None}
    if len(stored) < len(tensors):
        _init_module(model, module, name, tensors, seed, scales or {})
    for key, found in stored.items():
        if id(_get(module, key)) not in filled:
            checkpoint.fill(_get(module, key), found)
            filled.add(id(_get(module, key)))


def _allocate_module(module: torch.nn.Module, device: torch.device, allocated: dict) -> dict:
    """Storage for one module's own meta tensors; a parameter already allocated under another module (a tied
    head) is that same parameter again. Returns the tensors still to fill."""
    tensors = {}
    for key, parameter in list(module._parameters.items()):
        if parameter is None:
            continue
        if id(parameter) in allocated:
            module._parameters[key] = allocated[id(parameter)]
            continue
        new = torch.nn.Parameter(torch.empty_like(parameter, device=device), requires_grad=parameter.requires_grad)
        allocated[id(parameter)] = module._parameters[key] = tensors[key] = new
    for key, buffer in list(module._buffers.items()):
        if buffer is not None:
            module._buffers[key] = tensors[key] = torch.empty_like(buffer, device=device)
    return tensors


def _init_module(model, module: torch.nn.Module, name: str, tensors: dict, seed: int, scales: dict[str, float]
                 ) -> None:
    originals = {}
    for key, tensor in tensors.items():
        if isinstance(tensor, DTensor):  # swap in a full-size stand-in for the init rule to fill
            full = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.to_local().device)
            originals[key] = tensor
            _set(module, key, torch.nn.Parameter(full, requires_grad=tensor.requires_grad)
                 if isinstance(tensor, torch.nn.Parameter) else full)
    device = next(iter(tensors.values())).device
    devices = [device.index or 0] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if device.type != "cpu" else "cuda"):
        # Wrapper modules (activation checkpointing) do not change which seed a layer gets.
        torch.manual_seed((seed * 1_000_003 + zlib.crc32(parameter_name(name).encode())) % 2**63)
        model._init_weights(module)
    prefix = f"{name}." if name else ""
    for key in module._parameters:  # the parametrization's factor on the init rule's values (std, or a norm's 1)
        if key in tensors and scales.get(parameter_name(prefix + key), 1.0) != 1.0:
            _get(module, key).mul_(scales[parameter_name(prefix + key)])
    for key, sharded in originals.items():
        full = _get(module, key)
        local = distribute_tensor(full.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None).to_local()
        sharded.to_local().copy_(local)
        _set(module, key, sharded)


def _get(module: torch.nn.Module, key: str) -> torch.Tensor:
    return module._parameters[key] if key in module._parameters else module._buffers[key]


def _set(module: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    (module._parameters if key in module._parameters else module._buffers)[key] = value
