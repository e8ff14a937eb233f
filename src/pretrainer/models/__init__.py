"""Models: building HF causal LMs from a folder or a config, and the checks that precede it."""

from .build import ModelSpec, build_model, count_parameters, load_tokenizer, preflight
from .chunked_loss import install_chunked_loss, resolve_chunk_size
from .init import has_meta_tensors, materialize
from .trainable import select_trainable

__all__ = ["ModelSpec", "build_model", "count_parameters", "has_meta_tensors", "install_chunked_loss", "load_tokenizer",
           "materialize", "preflight", "resolve_chunk_size", "select_trainable"]
