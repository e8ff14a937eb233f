"""The seed's four custom Megatron hooks, set with `pretrain_args.update_distributed_train_args(extra_args={...})`.

Same keys, roles and signatures as openMind's Megatron path (Megatron's `pretrain_gpt.py` conventions, adapted to this
engine: HF models, host batches as dicts); they work on every engine. Each hook's contract: docs/megatron.md,
'Custom hooks'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..batch import IGNORE, HeadOutput
from ..config import HOOK_KEYS, ConfigError


class Hooks:
    def __init__(self, plugin_args: dict | None):
        plugin = plugin_args or {}
        for key in HOOK_KEYS:
            value = plugin.get(key)
            if value is not None and not callable(value):
                raise ConfigError(f"plugin_args.{key} must be a function, got {type(value).__name__}; set it in "
                                  "your script with pretrain_args.update_distributed_train_args(extra_args={...})")
        self.datasets_provider = plugin.get("custom_megatron_datasets_provider_function")
        self.get_batch_fn = plugin.get("custom_get_batch_function")
        self.model_provider = plugin.get("custom_model_provider_function")
        self.loss_function = plugin.get("custom_loss_function")

    def build_model(self) -> torch.nn.Module:
        model = self.model_provider(pre_process=True, post_process=True)
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise ConfigError("custom_model_provider_function must return an HF causal LM (an nn.Module with "
                              f".config), got {type(model).__name__}")
        return model

    def next_batch(self, stream) -> dict:
        if self.get_batch_fn is None:
            return next(stream)
        return _as_batch(self.get_batch_fn(stream))

    def loss(self, output: HeadOutput, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's summed token loss."""
        if self.loss_function is None:
            return output.loss_sum(targets)
        per_token = F.cross_entropy(output.logits.float().transpose(1, 2), targets.clamp(min=0), reduction="none")
        loss_mask = (targets != IGNORE).float()
        result = self.loss_function(loss_mask, per_token)
        loss = result[0] if isinstance(result, (tuple, list)) else result
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigError("custom_loss_function must return (loss, {...}) with loss a scalar tensor, got "
                              f"{type(loss).__name__}")
        return loss * loss_mask.sum()


def _as_batch(result) -> dict:
    if isinstance(result, dict):
        if "input_ids" not in result:
            raise ConfigError("custom_get_batch_function returned a dict without input_ids")
        return result
    if not isinstance(result, (tuple, list)) or len(result) != 5:
        raise ConfigError("custom_get_batch_function must return (tokens, labels, loss_mask, attention_mask, "
                          f"position_ids) or a dict, got {type(result).__name__}")
    tokens, labels, loss_mask, attention_mask, position_ids = result
    if attention_mask is not None:
        raise ConfigError("custom_get_batch_function: attention_mask must be None here (attention is causal; use "
                          "reset_attention_mask for per-document attention)")
    labels = torch.as_tensor(labels).long()
    if loss_mask is not None:
        labels = labels.masked_fill(torch.as_tensor(loss_mask) == 0, IGNORE)
    batch = {"input_ids": torch.as_tensor(tokens).long(), "shift_labels": labels}
    if position_ids is not None:
        batch["position_ids"] = torch.as_tensor(position_ids).long()
    return batch
