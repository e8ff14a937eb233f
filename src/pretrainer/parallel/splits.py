"""How each model family is split over ranks, kept apart from the model code and the engine.

A split knows two things about a model family's module layout:
- `parts(model)`: where its embedding, decoder layers, final norm, output head and rotary embedding live (pipeline
  stages are cut from these);
- `tensor_parallel(stage, mesh, sequence_parallel)`: the DTensor layouts of its linears, embeddings and norms
  (Megatron's column/row split: q/k/v and gate/up by output features, o and down by input features, so each layer
  needs one all-reduce — or, with sequence parallelism, one reduce-scatter and one all-gather per block, and norms run
  on a 1/tp slice of the sequence). A Mixture-of-Experts block is not split (see `moe_blocks`).

Activations between modules stay plain local tensors: [batch, seq/tp, hidden] with sequence parallelism, [batch, seq,
hidden] without; the pipeline sends those.

A model type reaches a split through its model-config parser (`pretrainer.models.registry`), which names it in
`megatron_lm_default_args["parallel_split"]`. Add a family with `register_split(name, parts, tensor_parallel)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..config import ConfigError
from ..models import find_experts
from .activation_checkpoint import inner_layer


@dataclass
class ModelParts:
    embed_tokens: torch.nn.Module
    layers: list[torch.nn.Module]
    norm: torch.nn.Module
    lm_head: torch.nn.Module
    rotary_emb: torch.nn.Module


@dataclass(frozen=True)
class ModelSplit:
    name: str
    parts: Callable[[torch.nn.Module], ModelParts]
    tensor_parallel: Callable  # (stage, tp_mesh, sequence_parallel) -> None


SPLITS: dict[str, ModelSplit] = {}


def register_split(name: str, parts: Callable, tensor_parallel: Callable) -> ModelSplit:
    SPLITS[name] = ModelSplit(name, parts, tensor_parallel)
    return SPLITS[name]


def get_split(name: str) -> ModelSplit:
    if name not in SPLITS:
        raise ConfigError(f"no model split named {name!r} (known: {', '.join(SPLITS)}); register one with "
                          "pretrainer.parallel.splits.register_split")
    return SPLITS[name]


# ------------------------------------------------------------------ the Llama family (Llama, Mistral, Qwen2)
def llama_parts(model: torch.nn.Module) -> ModelParts:
    decoder = model.model
    return ModelParts(decoder.embed_tokens, list(decoder.layers), decoder.norm, model.lm_head, decoder.rotary_emb)


def llama_tensor_parallel(stage, mesh, sequence_parallel: bool) -> None:
    """Apply the Llama layouts to the parts this stage holds (`stage.embed_tokens` etc., each may be None)."""
    sequence = Shard(1) if sequence_parallel else Replicate()
    # the first stage's embedding, or the last stage's copy of it (multi-token prediction under pipelining)
    for embedding in (stage.embed_tokens, getattr(stage, "mtp_embed_tokens", None)):
        if embedding is not None:
            parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence))
    for layer in stage.layers.values():
        # an MoE block is left whole: under sequence parallelism it routes this rank's tokens (moe_blocks)
        dense = not find_experts(inner_layer(layer).mlp)
        plan = {name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}
        plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=sequence)
        if dense:
            plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                         "mlp.down_proj": RowwiseParallel(output_layouts=sequence)})
        if sequence_parallel:
            plan.update({name: SequenceParallel(use_local_output=True)
                         for name in ("input_layernorm", "post_attention_layernorm")})
            # the decoder layer calls self_attn with keyword arguments, mlp positionally
            plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                   desired_input_kwarg_layouts={"hidden_states": Replicate()})
            if dense:
                plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(inner_layer(layer), mesh, plan)
    if stage.norm is not None and sequence_parallel:
        parallelize_module(stage.norm, mesh, SequenceParallel(use_local_output=True))
    if stage.lm_head is not None:
        parallelize_module(stage.lm_head, mesh, ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()))
        if stage.embed_tokens is not None and stage.tied:  # both are sharded by vocabulary rows: tie them again
            stage.lm_head.weight = stage.embed_tokens.weight


def moe_blocks(stage) -> list[torch.nn.Module]:
    """The MoE blocks (a decoder layer's `mlp` holding routed experts) of this stage's layers, which tensor
    parallelism leaves whole and the engine sums over tp (docs/moe.md, 'On the megatron engine: tp x ep')."""
    return [inner_layer(layer).mlp for layer in stage.layers.values() if find_experts(inner_layer(layer).mlp)]


register_split("llama", llama_parts, llama_tensor_parallel)


WHOLE_ATTENTION = {"olmoe": "its q/k norms span every head", "deepseek_v3": "its attention is multi-head latent"}


def refuse_tensor_parallel(stage, mesh, sequence_parallel: bool) -> None:
    model_type = str(getattr(stage.config, "model_type", "this model"))
    reason = WHOLE_ATTENTION.get(model_type, "its attention is not laid out like Llama's")
    raise ConfigError(f"plugin_args.tp_degree: {model_type}'s attention is not split over tensor-parallel ranks "
                      f"({reason}); use tp_degree 1 with pp_degree, dp and expert_parallel_degree")


# Llama's module layout with its attention kept whole (WHOLE_ATTENTION): pipeline stages, dp and expert parallelism only
register_split("llama-whole-attention", llama_parts, refuse_tensor_parallel)
