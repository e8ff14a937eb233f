"""Model FLOPs per trained token: `6 N + 12 L H Q T` (PaLM appendix B; what torchtitan and Megatron report).

N counts the parameters of every matrix multiply a token goes through — all parameters except the input
embedding table (a lookup), with the output projection counted even when it is tied to the embedding
(the lm_head matmul is still done). 6 = forward (2) + backward (4) FLOPs per parameter per token. The
attention term covers the score and value matmuls (L layers, H heads, Q head size, T sequence length),
counted over the full square as the formula does, also for causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlopsCount:
    matmul_parameters: int  # N
    layers: int
    heads: int
    head_dim: int
    seq_length: int

    @property
    def per_token(self) -> float:
        return 6.0 * self.matmul_parameters + 12.0 * self.layers * self.heads * self.head_dim * self.seq_length

    def describe(self) -> str:
        return (f"model FLOPs/token = 6N + 12*L*H*Q*T = 6*{self.matmul_parameters:,} + 12*{self.layers}*{self.heads}"
                f"*{self.head_dim}*{self.seq_length} = {self.per_token / 1e6:,.1f} MFLOP")


def flops_per_token(model: torch.nn.Module, seq_length: int) -> FlopsCount:
    """Count from the model itself (before sharding) and its HF config."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    matmul = total - embedding.numel() + (embedding.numel() if tied else 0)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return FlopsCount(matmul, config.num_hidden_layers, heads, head_dim, seq_length)
