"""Models: building HF causal LMs from a folder or a config, and the checks that precede it."""

from .build import ModelSpec, build_model, count_parameters, load_tokenizer, preflight
from .init import has_meta_tensors, materialize
from .trainable import select_trainable

__all__ = ["ModelSpec", "build_model", "count_parameters", "has_meta_tensors", "load_tokenizer", "materialize",
           "preflight", "select_trainable"]
