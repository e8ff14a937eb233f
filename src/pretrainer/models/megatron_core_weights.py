"""Llama-family weights between Hugging Face and Megatron-Core `GPTModel` layouts, whole or tensor-parallel.

Megatron-Core fuses q/k/v into `linear_qkv` by query group (for each of the G KV heads: its Q/G query heads, its key
head, its value head; rows of `head_dim`) and the SwiGLU gate and up projections into `linear_fc1` (gate rows first).
The norms live inside the following linear with the Transformer Engine layer spec (`linear_qkv.layer_norm_weight`,
`linear_fc1.layer_norm_weight`), as modules of their own with the local spec (`input_layernorm`, `pre_mlp_layernorm`).

Tensor-parallel shards follow Megatron's column/row split: `linear_qkv` by whole query groups, `linear_fc1` by gate rows
and up rows separately (rank r holds [gate_r; up_r]), `linear_proj`/`linear_fc2` by input features, embedding and output
layer by vocabulary rows; norms are replicated.
"""

from __future__ import annotations

import torch

from ..config import ConfigError
from .registry import NetworkShape


def _layer_names(fused_norms: bool) -> dict:
    """HF layer tensor names -> Megatron-Core's, for the tensors that only change name."""
    names = {"self_attn.o_proj.weight": "self_attention.linear_proj.weight",
             "mlp.down_proj.weight": "mlp.linear_fc2.weight"}
    if fused_norms:
        return {**names, "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    return {**names, "input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}


def hf_to_mcore(state: dict, shape: NetworkShape, fused_norms: bool = False) -> dict:
    """A whole HF Llama/Mistral/Qwen2 state dict in Megatron-Core GPTModel names and layouts."""
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": state["model.norm.weight"]}
    if shape.untied_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    names = _layer_names(fused_norms)
    for layer in range(shape.num_layers):
        prefix, target = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf_name, mcore_name in names.items():
            out[target + mcore_name] = state[prefix + hf_name]
        for kind in ("weight", "bias"):
            parts = [state.get(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"{target}self_attention.linear_qkv.{kind}"] = _fuse_qkv(*parts, shape)
        out[f"{target}mlp.linear_fc1.weight"] = torch.cat([state[prefix + "mlp.gate_proj.weight"],
                                                           state[prefix + "mlp.up_proj.weight"]])
    return out


def mcore_to_hf(state: dict, shape: NetworkShape, fused_norms: bool = False) -> dict:
    """The inverse of `hf_to_mcore` (tied models get `lm_head.weight` = the embedding)."""
    embedding = state["embedding.word_embeddings.weight"]
    out = {"model.embed_tokens.weight": embedding, "model.norm.weight": state["decoder.final_layernorm.weight"],
           "lm_head.weight": state.get("output_layer.weight", embedding)}
    names = _layer_names(fused_norms)
    for layer in range(shape.num_layers):
        prefix, source = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf_name, mcore_name in names.items():
            out[prefix + hf_name] = state[source + mcore_name]
        for kind in ("weight", "bias"):
            fused = state.get(f"{source}self_attention.linear_qkv.{kind}")
            if fused is not None:
                for p, part in zip("qkv", _split_qkv(fused, shape)):
                    out[f"{prefix}self_attn.{p}_proj.{kind}"] = part
        gate, up = state[f"{source}mlp.linear_fc1.weight"].chunk(2)
        out[prefix + "mlp.gate_proj.weight"], out[prefix + "mlp.up_proj.weight"] = gate, up
    return out


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: NetworkShape) -> torch.Tensor:
    groups, rest = shape.num_query_groups, q.shape[1:]
    return torch.cat([t.reshape(groups, -1, *rest) for t in (q, k, v)], dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, shape: NetworkShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, head = shape.num_query_groups, shape.kv_channels
    per_group = shape.num_attention_heads // groups * head
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, per_group + 2 * head, *rest)
    q, k, v = grouped.split([per_group, head, head], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# ------------------------------------------------------------------------------------- tensor parallel
def _split_rule(name: str):
    """How a Megatron-Core tensor is split over tensor-parallel ranks: (dim, is_fc1) or None (replicated)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight") or \
            name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return 0, False
    if name.endswith("linear_fc1.weight"):
        return 0, True
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return 1, False
    return None


def tensor_parallel_shard(state: dict, shape: NetworkShape, rank: int, size: int) -> dict:
    """Rank `rank`'s part of a whole Megatron-Core state dict, for tensor-parallel size `size`."""
    shape.check_tensor_parallel(size)
    if shape.vocab_size % size:
        raise ConfigError(f"vocab_size {shape.vocab_size} is not divisible by tp_degree={size}; pad the "
                          "vocabulary (Megatron's make_vocab_size_divisible_by) or choose another tp_degree")
    out = {}
    for name, tensor in state.items():
        rule = _split_rule(name)
        if rule is None:
            out[name] = tensor
        elif rule[1]:
            gate, up = tensor.chunk(2)
            out[name] = torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
        else:
            out[name] = tensor.chunk(size, dim=rule[0])[rank].contiguous()
    return out


def tensor_parallel_merge(shards: list[dict]) -> dict:
    """The whole Megatron-Core state dict from every tensor-parallel rank's part, in rank order."""
    out = {}
    for name in shards[0]:
        rule = _split_rule(name)
        parts = [shard[name] for shard in shards]
        if rule is None:
            out[name] = parts[0]
        elif rule[1]:
            halves = [p.chunk(2) for p in parts]
            out[name] = torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
        else:
            out[name] = torch.cat(parts, dim=rule[0])
    return out
