"""Which parameters train (`trainable_parameters`): all, the embeddings only (the first stage after a
vocabulary extension: the new rows learn while the body stays fixed), or those matching glob patterns over
parameter names. Frozen parameters get no gradient and no optimizer state."""

from __future__ import annotations

import fnmatch
import logging

import torch

from ..config import ConfigError

logger = logging.getLogger(__name__)


def select_trainable(model: torch.nn.Module, setting: str | list[str]) -> int:
    """Freeze what `setting` leaves out, before an engine wraps the model; returns the trainable count."""
    named = {}
    for name, param in model.named_parameters():  # tied weights once, under their first name
        named.setdefault(id(param), (name, param))
    if setting == "all":
        return sum(p.numel() for _, p in named.values() if p.requires_grad)
    if setting == "embeddings":
        keep = {id(model.get_input_embeddings().weight)}
        head = model.get_output_embeddings()
        if head is not None:
            keep.add(id(head.weight))
    else:
        patterns = [setting] if isinstance(setting, str) else list(setting)
        keep = set()
        for pattern in patterns:
            matched = {key for key, (name, _) in named.items() if fnmatch.fnmatchcase(name, pattern)}
            if not matched:
                examples = ", ".join(name for name, _ in list(named.values())[:4])
                raise ConfigError(f"trainable_parameters: pattern {pattern!r} matches no parameter; names look like "
                                  f"{examples} (or use all / embeddings)")
            keep |= matched
    for key, (_, param) in named.items():
        param.requires_grad_(key in keep)
    trainable = sum(p.numel() for key, (_, p) in named.items() if key in keep)
    total = sum(p.numel() for _, p in named.values())
    logger.info("trainable parameters: %s of %s (%.1f%%; trainable_parameters: %s)", f"{trainable:,}",
                f"{total:,}", 100 * trainable / max(total, 1), setting)
    return trainable
