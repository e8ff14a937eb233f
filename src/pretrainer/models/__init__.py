"""Models: building HF causal LMs from a folder or a config, and the checks that precede it."""

from .build import (
    ModelSpec,
    add_multi_token_prediction,
    build_model,
    count_parameters,
    load_tokenizer,
    model_source,
    preflight,
    reads_checkpoint_in_slices,
)
from .chunked_loss import LossChunk, install_chunked_loss, resolve_loss_chunk, takes_head_call
from .hf_weights import LoadStats, mtp_shared_copies, pending_checkpoint, tied_output_names
from .init import has_meta_tensors, materialize
from .moe_routing import MoeRouting, find_experts, idle_expert_parameters
from .trainable import select_trainable

__all__ = ["LoadStats", "LossChunk", "ModelSpec", "MoeRouting", "add_multi_token_prediction", "build_model",
           "count_parameters", "find_experts", "has_meta_tensors", "idle_expert_parameters", "install_chunked_loss",
           "load_tokenizer", "materialize", "model_source", "mtp_shared_copies", "pending_checkpoint", "preflight",
           "reads_checkpoint_in_slices", "resolve_loss_chunk", "select_trainable", "takes_head_call",
           "tied_output_names"]
