"""Expert parallelism (`expert_parallel_degree`, ep): the routed experts of every MoE layer split over ep ranks.

Each experts module (transformers' fused [experts, ...] weights) becomes DTensors sharded by expert over the ep mesh.
Its forward keeps the MoE block's interface (hidden states, top-k indices, top-k weights) and runs through the token
exchange (expert_exchange.py): each rank routes its own tokens with the whole router, sends every assignment to the rank
holding its expert, runs its local experts with the model's own experts code on its local weights (so eager, batched_mm
and grouped_mm all work, with the model's arithmetic), and gets the outputs back, weighted. A checkpoint holds each
expert tensor whole (DCP reassembles the shards), so it loads on any layout; the export gathers them.

Every rank of an ep group must run every forward together (the exchange is a collective), as FSDP's gathers already
require. Gradients: an expert's gradient on its rank already sums what every rank of its ep group sent it, and the
engine reduces it over the ranks holding the same experts only (dp / ep of them, where other gradients are averaged
over dp): the engine's `gradient_scale` (1 / ep) evens that out.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..models import find_experts
from .expert_exchange import ExpertExchange


class _LocalExperts:
    """The experts module as its own forward sees it, holding only this rank's experts: the local weights under
    the module's names and `num_experts` = the local count; everything else is the module's."""

    def __init__(self, module: torch.nn.Module, weights: dict[str, torch.Tensor], experts: int):
        self.__dict__.update(_module=module, _weights=weights, num_experts=experts)

    def __getattr__(self, name: str):
        weights = self.__dict__["_weights"]
        return weights[name] if name in weights else getattr(self.__dict__["_module"], name)


def shard_experts(model: torch.nn.Module, mesh, gradient_scale: float) -> list[torch.nn.Module]:
    """Split every experts module over the ep `mesh`, route its forward through the token exchange and scale its
    gradients by `gradient_scale`; on the meta device or on loaded weights (each rank keeps its slice)."""
    modules = find_experts(model)
    for module in modules:
        for name, parameter in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(parameter.data, mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, torch.nn.Parameter(sharded, requires_grad=parameter.requires_grad))
        exchange = ExpertExchange(module.num_experts, mesh.get_group())
        module.forward = _expert_parallel_forward(module, exchange, gradient_scale)
    return modules


def expert_ranks(model: torch.nn.Module) -> int:
    """Ranks `model`'s routed experts are split over by expert: the `ep` size of their DTensors' mesh (1: every rank
    holds every expert, or a dense model). Experts this rank does not hold (another stage's, on meta) say nothing."""
    for module in find_experts(model):
        for parameter in module.parameters(recurse=False):
            if parameter.is_meta:
                break
            names = (parameter.device_mesh.mesh_dim_names or ()) if isinstance(parameter, DTensor) else ()
            return parameter.device_mesh.size(names.index("ep")) if "ep" in names else 1
    return 1


def _expert_parallel_forward(module: torch.nn.Module, exchange: ExpertExchange, gradient_scale: float):
    model_forward = type(module).forward  # the model's experts code (transformers' interface picks eager, ...)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if top_k_weights.shape[-1] != top_k_index.shape[-1]:  # weights over every expert: take each slot's
            top_k_weights = top_k_weights.gather(-1, top_k_index)
        rows, routes = exchange.dispatch(hidden_states, top_k_index)
        local_index = torch.repeat_interleave(torch.arange(exchange.local, device=rows.device),
                                              routes.tokens_per_expert).unsqueeze(-1)
        weights = {name: _ScaleGradient.apply(p.to_local() if isinstance(p, DTensor) else p, gradient_scale)
                   for name, p in module.named_parameters(recurse=False)}
        # each received row through its one local expert at weight 1; the token's own weights apply on return
        outputs = model_forward(_LocalExperts(module, weights, exchange.local), rows, local_index,
                                torch.ones_like(local_index, dtype=rows.dtype))
        return exchange.combine(outputs, routes, top_k_weights)

    return forward


class _ScaleGradient(torch.autograd.Function):
    """The identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
