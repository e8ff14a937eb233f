"""The numbers of a model the estimate needs, read from its HF config without building it.

A one-layer copy of the model is built on the meta device (no memory, any size): its embedding, output head,
first decoder layer and the rest give exact parameter counts for every architecture transformers builds;
the full model has `num_hidden_layers` such layers. A Mixture-of-Experts model may mix dense and MoE layers
(DeepSeek-V3's first_k_dense_replace, Qwen-MoE's mlp_only_layers): it is built whole on the meta device, and
a layer counts the mean of its layers; the routed experts' parameters a token does not use are counted too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..config import expert_shape
from ..config.architecture import Architecture
from ..models import find_experts, idle_expert_parameters
from ..models.mtp import add_mtp_layers
from ..parallel.activation_checkpoint import decoder_layers
from ..perf import FlopsCount


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layer_parameters: int       # one decoder layer
    embedding_parameters: int   # the input table
    head_parameters: int        # the output head (0 when tied to the input table)
    other_parameters: int       # final norm and anything else outside the layers
    layer_matrix_parameters: int = 0  # of one decoder layer, in matrices (2-D and up): what Muon updates
    largest_matrix: int = 0     # elements of the largest matrix in a layer (Muon orthogonalises one at a time)
    idle_expert_parameters: int = 0  # routed experts' parameters a token does not go through (MoE)
    expert_parameters: int = 0  # routed experts' parameters, all layers (what expert parallelism splits)
    expert_layers: int = 0      # MoE layers (each exchanges its tokens under expert parallelism)
    moe_block_parameters: int = 0  # MoE blocks whole (router, routed and shared experts), all layers
    experts: int = 0            # routed experts per MoE layer
    top_k: int = 0              # experts each token goes to
    mtp_depths: int = 0         # multi-token prediction depths (models/mtp.py): after the layers, beside the head
    mtp_layer_parameters: int = 0  # of one depth: a decoder layer, its 2H -> H projection and three norms

    @property
    def tied(self) -> bool:
        return self.head_parameters == 0

    @property
    def parameters(self) -> int:
        return (self.layers * self.layer_parameters + self.embedding_parameters + self.head_parameters
                + self.other_parameters + self.mtp_depths * self.mtp_layer_parameters)

    @property
    def layer_expert_parameters(self) -> int:
        """Routed experts' parameters of a decoder layer, averaged over the layers as `layer_parameters` is."""
        return self.expert_parameters // self.layers

    @property
    def layer_moe_block_parameters(self) -> int:
        """MoE block parameters of a decoder layer, averaged over the layers as `layer_parameters` is."""
        return self.moe_block_parameters // self.layers

    @property
    def matmul_parameters(self) -> int:
        """Parameters a token multiplies with: all but the input lookup, the head counted even when tied, and once
        more for each multi-token prediction depth."""
        return (self.parameters - self.embedding_parameters + (self.vocab * self.hidden if self.tied else 0)
                + self.mtp_depths * self.vocab * self.hidden)

    def flops(self, seq_length: int) -> FlopsCount:
        """Counted on the active parameters, as the run counts them (perf/flops.py)."""
        return FlopsCount(self.matmul_parameters - self.idle_expert_parameters, self.layers + self.mtp_depths,
                          self.heads, self.head_dim, seq_length, idle_expert_parameters=self.idle_expert_parameters)

    def describe(self) -> str:
        return (f"{self.model_type}, {self.parameters / 1e9:.3g}B parameters ({self.layers} layers, hidden "
                f"{self.hidden}, {self.heads} heads / {self.kv_heads} kv, ffn {self.intermediate}, vocab {self.vocab}"
                f"{', tied embeddings' if self.tied else ''}"
                + (f", {self.mtp_depths} multi-token prediction depth(s)" if self.mtp_depths else "")
                + (f"; {(self.parameters - self.idle_expert_parameters) / 1e9:.3g}B active per token"
                   if self.idle_expert_parameters else "") + ")")


def one_layer_config(config, layers: int = 1):
    """A copy of `config` with `layers` decoder layers (what the probes build)."""
    small = copy.deepcopy(config)
    small.num_hidden_layers = layers
    for key in ("layer_types", "mlp_only_layers", "sliding_window_pattern"):
        value = getattr(small, key, None)
        if isinstance(value, list):
            setattr(small, key, value[:layers])
    small.use_cache = False
    return small


def model_shape(config, vocab_size: int | None = None, mtp_depths: int = 0) -> ModelShape:
    """`vocab_size`: the rows the run trains (a grown vocabulary), when it differs from the config's;
    `mtp_depths`: the run's multi-token prediction depths."""
    from transformers import AutoModelForCausalLM

    experts = expert_shape(config, "the model config")
    small = one_layer_config(config) if experts is None else copy.deepcopy(config)
    if vocab_size:
        small.vocab_size = vocab_size
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(small, dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())  # a tied table once
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    head = 0 if output is None or output.weight is embedding else output.weight.numel()
    layers = decoder_layers(model)
    in_layer = [p for one in layers for p in one.parameters()]
    in_layers = sum(p.numel() for p in in_layer)
    matrices = [p.numel() for p in in_layer if p.dim() >= 2]
    idle = idle_expert_parameters(model, experts) if experts is not None else 0
    routed = find_experts(model) if experts is not None else []
    blocks = [m for m in model.modules() if any(child in routed for child in m.children())]
    arch = Architecture.of(config)
    mtp_layer = sum(p.numel() for p in add_mtp_layers(model, 1)[0].parameters()) if mtp_depths else 0
    return ModelShape(
        model_type=arch.model_type, layers=arch.layers, hidden=arch.hidden, heads=arch.heads, kv_heads=arch.kv_heads,
        head_dim=arch.head_dim, intermediate=arch.intermediate, vocab=small.vocab_size,
        layer_parameters=round(in_layers / len(layers)), embedding_parameters=embedding.numel(), head_parameters=head,
        other_parameters=total - in_layers - embedding.numel() - head,
        layer_matrix_parameters=round(sum(matrices) / len(layers)), largest_matrix=max(matrices, default=0),
        idle_expert_parameters=idle, expert_parameters=sum(p.numel() for m in routed for p in m.parameters()),
        expert_layers=len(routed), moe_block_parameters=sum(p.numel() for b in blocks for p in b.parameters()),
        experts=experts.experts if experts else 0, top_k=experts.top_k if experts else 0, mtp_depths=mtp_depths,
        mtp_layer_parameters=mtp_layer)
