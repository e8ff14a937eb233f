"""Causal attention for compiled decoder layers training in bf16/fp16 on a CPU.

The forward is torch's CPU flash-attention kernel, as with `sdpa`. Its backward is the slow part of a bf16 step on CPUs
with matrix units (about 4x the forward's time for a 512-token window: most of the step's non-matmul time), so the
backward is written out here: per block of queries, the probabilities are recomputed from the forward's log-sum-exp with
batched matmuls and the gradients follow from them (the flash-attention backward, without its tiling over keys). Inside
a compiled layer the compiler fuses each block's element-wise work, and the step runs 12-15% faster than with `sdpa` on
the 25M benchmark model (docs/performance.md). Without compile the written-out backward is slower than the kernel's, so
it is installed only with `compile: true`.

Everything else goes to `sdpa` unchanged: masks other than the plain causal one (padding, document masking), sliding
windows, softcapping, dropout, evaluation and generation.
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

logger = logging.getLogger(__name__)

NAME = "pretrainer_cpu_flash"
BLOCK_BYTES = 64 * 2**20  # one block's fp32 probabilities at most (the query block shrinks for long windows)


def install(model_or_stage: torch.nn.Module) -> bool:
    """Use this attention where the model would use `sdpa` (its config's attention implementation)."""
    config = model_or_stage.config
    if config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks `sdpa` gets: None where plain causal suffices
    config._attn_implementation = NAME
    logger.info("attention: CPU flash forward with a compiled block-wise backward (bf16 on CPU, compile: true)")
    return True


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface function: [batch, heads, seq, dim] in, [batch, seq, heads, dim] out."""
    plain_causal = (attention_mask is None and getattr(module, "is_causal", True) and query.shape[2] > 1
                    and query.shape[2] == key.shape[2] and not (dropout and module.training)
                    and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None)
    if not (plain_causal and torch.is_grad_enabled() and query.device.type == "cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if torch.is_autocast_enabled("cpu"):  # rotary embeddings leave queries and keys in fp32 under autocast
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = CausalAttention.apply(query.contiguous(), key.contiguous(), value.contiguous(), scale)
    return out.transpose(1, 2).contiguous(), None


class CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale: float):
        out, log_sum_exp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True,
                                                                                      scale=scale)[:2]
        ctx.save_for_backward(query, key, value, out, log_sum_exp)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, log_sum_exp = ctx.saved_tensors
        return (*causal_attention_backward(query, key, value, out, log_sum_exp, grad_out.contiguous(), ctx.scale),
                None)


def causal_attention_backward(query, key, value, out, log_sum_exp, grad_out, scale: float):
    """Gradients of causal softmax attention for [batch, heads, seq, dim] inputs, from the forward's output
    and per-query log-sum-exp of the scaled scores. Matmuls in the inputs' dtype, the rest in fp32."""
    batch, heads, seq, dim = query.shape
    rows = batch * heads
    q, k, v, o, do = (t.reshape(rows, seq, dim) for t in (query, key, value, out, grad_out))
    lse = log_sum_exp.reshape(rows, seq).float()
    grad_q = torch.empty_like(q)
    grad_k = torch.zeros(rows, seq, dim, dtype=torch.float32, device=q.device)
    grad_v = torch.zeros(rows, seq, dim, dtype=torch.float32, device=q.device)
    # the softmax's backward needs, per query, the dot product of its output and that output's gradient
    delta = (do.float() * o.float()).sum(-1)
    block = max(16, min(256, BLOCK_BYTES // (4 * rows * seq)))
    for start in range(0, seq, block):
        end = min(seq, start + block)  # queries [start, end) see keys [0, end)
        qi, doi, kj, vj = q[:, start:end], do[:, start:end], k[:, :end], v[:, :end]
        probs = torch.exp(torch.bmm(qi, kj.transpose(1, 2)).float() * scale - lse[:, start:end, None])
        later = torch.arange(end, device=q.device)[None, :] > torch.arange(start, end, device=q.device)[:, None]
        probs = probs.masked_fill(later, 0.0)
        grad_v[:, :end] += torch.bmm(probs.to(q.dtype).transpose(1, 2), doi).float()
        grad_scores = probs * (torch.bmm(doi, vj.transpose(1, 2)).float() - delta[:, start:end, None]) * scale
        grad_scores = grad_scores.to(q.dtype)
        grad_q[:, start:end] = torch.bmm(grad_scores, kj)
        grad_k[:, :end] += torch.bmm(grad_scores.transpose(1, 2), qi).float()
    shape = (batch, heads, seq, dim)
    return grad_q.view(shape), grad_k.to(k.dtype).view(shape), grad_v.to(v.dtype).view(shape)
