"""Parallelism applied by free functions, in one order that every engine follows (as torchtitan's `parallelize`):

    context-parallel attention     the whole model (before pipeline stages are cut from it)
    pipeline stages                where tp or pp splits the model (always under megatron): this rank's stages,
                                   each then parallelized on its own; else the whole model is the one module
    tensor parallelism             the family's split (parallel/splits.py) on the tp mesh
    expert parallelism             the experts split over the ep mesh (expert_parallel.py)
    activation checkpointing       activation_checkpoint.py (full, selective; groups in pipeline stages)
    compile                        each decoder layer
    data parallelism               FSDP2's `fully_shard` or `replicate` (places and materialises the model)

Engines keep the process groups, the step, the collectives and checkpoint I/O; `parallelize` is what turns a
model (or a stage) into what an engine runs.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from ..models import cpu_attention
from .activation_checkpoint import RecomputeSettings, apply_activation_checkpointing, decoder_layers
from .precision import Precision

logger = logging.getLogger("pretrainer")

# FSDP2 warns on every rank when a wrapped module returns a view (a stage's hidden states, a tensor-parallel head's
# logits): an in-place op on it would skip its all-gather. Harmless: the loop, losses and stages use them out of place.
WRAPPED_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


def outputs_used_out_of_place() -> None:
    if not any(f[1] is not None and f[1].pattern == WRAPPED_VIEW_WARNING for f in warnings.filters):
        warnings.filterwarnings("ignore", message=WRAPPED_VIEW_WARNING, category=UserWarning)
        logger.debug("FSDP2's warning for wrapped modules returning views is silenced: outputs are used out of place")


@dataclass(frozen=True)
class Parallelism:
    """What `parallelize` applies to one module, each step optional."""
    tensor_parallel: Callable[[torch.nn.Module], None] | None = None
    expert_parallel: Callable[[torch.nn.Module], None] | None = None
    recompute: RecomputeSettings = RecomputeSettings()
    compile: Precision | None = None  # compile each decoder layer for this precision
    data_parallel: Callable[[torch.nn.Module], torch.nn.Module] | None = None  # returns the module to run


def parallelize(module: torch.nn.Module, steps: Parallelism) -> torch.nn.Module:
    """Apply `steps` to `module` in the order above; returns what the engine runs."""
    if steps.tensor_parallel is not None:
        steps.tensor_parallel(module)
    if steps.expert_parallel is not None:
        steps.expert_parallel(module)
    apply_activation_checkpointing(module, steps.recompute)
    if steps.compile is not None:
        compile_layers(module, steps.compile)
    if steps.data_parallel is not None:
        module = steps.data_parallel(module)
    return module


def compile_layers(model: torch.nn.Module, precision: Precision) -> None:
    """`torch.compile` each decoder layer in place (as torchtitan does): identical layers share one compiled
    graph, the compile stays inside FSDP2's wrapping, and state-dict keys do not change."""
    if precision.device.type == "cpu" and precision.dtype != "fp32":
        cpu_attention.install(model)
    for layer in decoder_layers(model):
        layer.compile()


@dataclass(frozen=True)
class ExpertSharding:
    """Data parallelism of expert-parallel experts: their DTensors (sharded by expert over ep) are sharded again
    (FSDP, on their second dimension so that the two splits never share a dimension) or replicated over the
    ranks holding the same experts (`mesh`); their gradients are averaged over that mesh."""
    modules: list[torch.nn.Module]
    mesh: object


def shard_layers(module: torch.nn.Module, mesh, layers: list[torch.nn.Module], precision: Precision | None = None,
                 reshard_after_forward: bool = True, cpu_offload: bool = False,
                 experts: ExpertSharding | None = None) -> None:
    """FSDP2: each decoder layer its own unit (gathered just before use), the root the rest; split `experts` their own
    units in their layers. Below fp32, compute in `precision` and reduce gradients in fp32 (shards stay fp32)."""
    options = {"reshard_after_forward": reshard_after_forward}
    if precision is not None and precision.dtype != "fp32":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
    if cpu_offload:  # pin_memory needs an accelerator; without one it must be off
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    for expert_module in experts.modules if experts is not None else ():
        fully_shard(expert_module, mesh=experts.mesh, shard_placement_fn=lambda _: Shard(1), **options)
    for layer in layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(module, mesh=mesh, **options)
    outputs_used_out_of_place()


def replicate_layers(module: torch.nn.Module, mesh, layers: list[torch.nn.Module],
                     experts: ExpertSharding | None = None) -> None:
    """DDP on FSDP2's machinery: gradients all-reduced over `mesh` layer by layer; split `experts` over their mesh."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for expert_module in experts.modules if experts is not None else ():
        replicate(expert_module, mesh=experts.mesh)
    for layer in layers:
        replicate(layer, mesh=mesh)
    replicate(module, mesh=mesh)
    outputs_used_out_of_place()
