"""MPT's attention through `scaled_dot_product_attention` instead of transformers' explicit scores.

transformers' MPT (its only attention for the family) multiplies queries by keys, adds the ALiBi bias and keeps the
softmax of the whole [heads, seq, seq] score matrix for backward, in fp32 and again in the compute dtype: about 2 GiB
per sequence and layer for MPT-70B at 2,048 tokens. Here the bias and the causal (or padding) mask go to the fused
kernel as one additive mask, and the kernel keeps only its output and log-sum-exp (flash / memory-efficient attention on
GPUs, flash on CPUs).

ALiBi's bias for key j is slope x (j - last position): the same shift for every key of a row, which the softmax ignores.
In bf16 its large values far from the last position would lose the differences between neighbouring keys, so the mask
holds slope x (j - i) instead: the same softmax, small where it matters.

The mask is built once per forward by the first layer that needs it, shared by the others and held weakly (it lives only
as long as autograd keeps it); generation with a cache, or a query shorter than its keys, takes transformers' own path.
"""

from __future__ import annotations

import logging
import types
import weakref

import torch

logger = logging.getLogger(__name__)


class _MaskOfTheForward:
    """The additive mask of the forward in flight, keyed by the bias and mask tensors that every layer gets."""

    def __init__(self):
        self._key: tuple = (lambda: None, None, 0, None)
        self._mask = lambda: None
        self.padded = True  # the model got an attention mask (padding): the mask is the batch's, else one for all

    def note_inputs(self, module, args, kwargs) -> None:
        """Forward pre-hook of the MPT model: whether this forward has a padding mask (without one, transformers
        still hands each layer a causal mask per sequence; one [1, heads, seq, seq] mask serves them all)."""
        given = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        self.padded = given is not None

    def get(self, position_bias: torch.Tensor, attention_mask: torch.Tensor | None, length: int,
            dtype: torch.dtype) -> torch.Tensor:
        bias_ref, mask_ref, old_length, old_dtype = self._key
        mask = self._mask()
        same = (bias_ref() is position_bias and (mask_ref() if mask_ref else None) is attention_mask
                and (old_length, old_dtype) == (length, dtype))
        if mask is None or not same:
            mask = _additive_mask(position_bias, attention_mask if self.padded else None, length, dtype)
            self._key = (weakref.ref(position_bias), None if attention_mask is None else weakref.ref(attention_mask),
                         length, dtype)
            self._mask = weakref.ref(mask)
        return mask


def _additive_mask(position_bias, attention_mask, length: int, dtype) -> torch.Tensor:
    """[batch or 1, heads, length, length]: slope x (j - i) where key j is visible from query i, else the
    dtype's lowest value (what transformers fills the masked scores with)."""
    bias = position_bias[:, -1, -length:].float()                  # [heads, length]: slope x (j - last)
    relative = bias[:, None, :] - bias[:, :, None]                 # slope x (j - i)
    if attention_mask is None:
        visible = torch.ones(length, length, dtype=torch.bool, device=bias.device).tril()
        hidden = ~visible[None, None]
    else:
        hidden = attention_mask[..., -length:, -length:]
    return relative[None].to(dtype).masked_fill(hidden, torch.finfo(dtype).min)


def _forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    batch, length = hidden_states.shape[:2]
    if cache is not None or position_bias is None:
        return self._transformers_forward(hidden_states, position_bias, cache=cache, attention_mask=attention_mask,
                                          **kwargs)
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (t.reshape(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
                         for t in qkv.chunk(3, dim=2))
    mask = self._shared_mask.get(position_bias, attention_mask, length, query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=self.attn_dropout_p if self.training else 0.0,
        scale=self.softmax_scale)
    return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1)), None


def install(model: torch.nn.Module, announce: bool = True) -> bool:
    """Give each MPT attention module of `model` the fused path; False when it has none. `announce`: say so in the
    log (a run's model; not the planner's probes)."""
    try:
        from transformers.models.mpt.modeling_mpt import MptAttention, MptModel
    except ImportError:
        return False
    modules = [m for m in model.modules() if isinstance(m, MptAttention)]
    if not modules:
        return False
    shared = _MaskOfTheForward()
    for base in (m for m in model.modules() if isinstance(m, MptModel)):
        base.register_forward_pre_hook(shared.note_inputs, with_kwargs=True)
    for module in modules:
        module._transformers_forward = module.forward
        module._shared_mask = shared
        module.forward = types.MethodType(_forward, module)
    if announce:
        logger.info("attention: MPT's runs through scaled_dot_product_attention (ALiBi and the causal mask as one "
                    "additive mask; no score matrix kept for backward)")
    return True
