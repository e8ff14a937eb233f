"""A parameter's name as the config's name globs (`trainable_parameters`, `muon_params`) and HF weight files write
it: the module path without the segments that wrappers insert (activation checkpointing, torch.compile's module
wrapper, FSDP1). One rule, used wherever a laid-out model's names meet the user's or the files'."""

from __future__ import annotations

WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def parameter_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)
