"""Model FLOPs per trained token, the figure MFU uses: `6 N + 12 L H Q T` (PaLM appendix B; what torchtitan reports).

N counts the parameters of every matmul a token goes through: all but the input embedding table (a lookup), with the
output projection counted even when tied to it (the lm_head matmul is still done). 6 = forward (2) + backward (4) FLOPs
per parameter per token; frozen parameters (`trainable_parameters`) get no weight gradient, so 4 (their inputs' gradient
is still computed). The attention term covers the score and value matmuls (L layers, H heads, Q head size, T sequence
length) over the full square, as PaLM's formula does, even for causal attention, which computes half of it: MFUs stay
comparable with published ones. Recomputation is not counted (model FLOPs, not hardware FLOPs).

`performed_per_token` is what the hardware does instead; a measured peak is never below it (peak.py's `raise_peak`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.architecture import Architecture


@dataclass(frozen=True)
class FlopsCount:
    matmul_parameters: int  # N
    layers: int
    heads: int
    head_dim: int
    seq_length: int
    frozen_matmul_parameters: int = 0  # of N, those without a weight gradient
    idle_expert_parameters: int = 0    # routed experts' parameters a token does not go through (not in N)

    @property
    def per_token(self) -> float:
        trained = self.matmul_parameters - self.frozen_matmul_parameters
        return (6.0 * trained + 4.0 * self.frozen_matmul_parameters
                + 12.0 * self.layers * self.heads * self.head_dim * self.seq_length)

    def performed_per_token(self, recompute: str = "none") -> float:
        """FLOPs the hardware runs per token: causal attention (half the square), and with full recomputation
        each layer's forward once more (2 per matmul parameter, a third of attention)."""
        attention = 6.0 * self.layers * self.heads * self.head_dim * self.seq_length
        performed = self.per_token - attention
        if recompute == "full":
            performed += 2.0 * self.matmul_parameters + attention / 3
        return performed

    def describe(self) -> str:
        attention = f"12*{self.layers}*{self.heads}*{self.head_dim}*{self.seq_length}"
        if self.frozen_matmul_parameters:
            trained = self.matmul_parameters - self.frozen_matmul_parameters
            return (f"model FLOPs/token = 6N + 4F + 12*L*H*Q*T = 6*{trained:,} + 4*{self.frozen_matmul_parameters:,}"
                    f" (frozen) + {attention} = {self.per_token / 1e6:,.1f} MFLOP")
        active = f" (active parameters only; {self.idle_expert_parameters:,} expert parameters idle per token)" \
            if self.idle_expert_parameters else ""
        return (f"model FLOPs/token = 6N + 12*L*H*Q*T = 6*{self.matmul_parameters:,}{active} + {attention} = "
                f"{self.per_token / 1e6:,.1f} MFLOP (attention over the full square, as PaLM; recompute not "
                "counted)")


def flops_per_token(model: torch.nn.Module, seq_length: int, idle_expert_parameters: int = 0,
                    mtp_depths: int = 0) -> FlopsCount:
    """Count from the model itself (before sharding) and its HF config: an MoE model's active parameters only, and
    one layer's attention and one head pass per multi-token prediction depth (docs/performance.md)."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    head = output.weight.numel() if output is not None else embedding.numel()
    matmul = total - embedding.numel() + (embedding.numel() if tied else 0) + mtp_depths * head
    arch = Architecture.of(config)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and p is not embedding)
    if tied and not embedding.requires_grad:
        frozen += embedding.numel()  # the head's matmul, through the tied table
    return FlopsCount(matmul - idle_expert_parameters, arch.layers + mtp_depths, arch.heads, arch.head_dim, seq_length,
                      frozen, idle_expert_parameters)
