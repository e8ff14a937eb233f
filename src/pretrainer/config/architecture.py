"""A decoder's numbers, read from its HF config in one place: the planner (model shape, activation probes), the megatron
engine's config parser and `other_megatron_args` checks, and the FLOPs count all read an `Architecture`, so a family
that names a field its own way (GPT-2's `n_inner`, Falcon's `num_kv_heads`, `multi_query` or `ffn_hidden_size`) is
handled once; transformers' `attribute_map` gives the common names (`hidden_size` for GPT-2's `n_embd`, ...)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int           # key/value heads (grouped-query attention; = heads without it, 1 for multi-query)
    head_dim: int
    intermediate: int       # the MLP's width (of a dense layer)
    vocab: int
    tied: bool              # the output head shares the input embedding's table
    max_positions: int | None

    @classmethod
    def of(cls, config) -> "Architecture":
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) \
            or (1 if getattr(config, "multi_query", False) else heads)
        intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) \
            or getattr(config, "ffn_hidden_size", None) or 4 * hidden
        return cls(model_type=str(getattr(config, "model_type", "")), layers=int(config.num_hidden_layers),
                   hidden=hidden, heads=heads, kv_heads=int(kv_heads),
                   head_dim=int(getattr(config, "head_dim", None) or hidden // heads), intermediate=int(intermediate),
                   vocab=int(config.vocab_size), tied=bool(getattr(config, "tie_word_embeddings", False)),
                   max_positions=getattr(config, "max_position_embeddings", None))
