"""Context parallelism (`context_parallel_degree`, cp) for the ddp, fsdp and megatron engines: each sequence is split
over the cp ranks of a data replica, which see the same batches (docs/long-context.md).

The keys and values are all-gathered (differentiable: the backward sums all ranks' gradients for each rank's part),
not passed in a ring as torch's `context_parallel` does: that runs on any torch.distributed backend, gloo included,
and any attention mask shape. Document masking (`reset_attention_mask`) is refused; `reset_position_ids` works
(positions feed RoPE; the causal mask uses window order).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..batch import IGNORE, batch_targets
from ..config import ConfigError

logger = logging.getLogger(__name__)

ATTENTION_NAME = "pretrainer_context_parallel"
# The layout of the forward (and of its backward, where activation checkpointing recomputes attention) in
# progress. A module variable, not a context variable: a GPU's autograd runs the backward in its own thread.
_current: "ContextParallel | None" = None


@dataclass
class ContextParallel:
    degree: int
    rank: int            # index within the cp group
    group: object        # the cp group's ProcessGroup
    multiple: int = 1    # chunk sizes are a multiple of this (sequence parallelism splits them over tp)

    def chunks(self, length: int) -> tuple[int, int]:
        """(chunk size, padded length) for a window of `length` tokens."""
        pieces = 2 * self.degree
        size = -(-length // (pieces * self.multiple)) * self.multiple
        return size, size * pieces

    def order(self, length: int) -> torch.Tensor:
        """Window indices held by every rank, rank by rank (rank r: chunks r and 2cp-1-r)."""
        size, padded = self.chunks(length)
        chunk = torch.arange(padded).view(2 * self.degree, size)
        return torch.cat([torch.cat([chunk[r], chunk[2 * self.degree - 1 - r]]) for r in range(self.degree)])

    def local_indices(self, length: int) -> torch.Tensor:
        return self.order(length).view(self.degree, -1)[self.rank]

    def shard(self, batch: dict, min_length: int = 0) -> dict:
        """This rank's part of a host batch (input_ids, shift_labels, position_ids), its windows padded to at
        least `min_length` tokens (pipeline stages exchange fixed shapes)."""
        mask = batch.get("attention_mask")
        if mask is not None and not bool((mask[:, 1:] <= mask[:, :-1]).all()):  # rows other than ones, then zeros
            raise ConfigError("context_parallel_degree: batches with an attention_mask other than right padding "
                              "(padding inside a row, or document masking) cannot be split over ranks; use packed "
                              "data without reset_attention_mask, or context_parallel_degree: 1")
        ids, targets = batch["input_ids"], batch_targets(batch)
        rows, length = ids.shape
        window = max(length, min_length)
        _, padded = self.chunks(window)
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length).expand(rows, length)
        extra = padded - length
        if extra:  # a short window: padding at the end is never attended to by real tokens (causal)
            ids = F.pad(ids, (0, extra), value=0)
            targets = F.pad(targets, (0, extra), value=IGNORE)
            positions = F.pad(positions, (0, extra), value=0)
        mine = self.local_indices(window)
        kept = {key: batch[key] for key in ("source",) if key in batch}  # per-row values stay whole
        return {"input_ids": ids[:, mine], "shift_labels": targets[:, mine], "position_ids": positions[:, mine],
                "cp_length": window, **kept}

    @contextlib.contextmanager
    def active(self, length: int):
        """Attention uses this layout for a window of `length` tokens inside the block (forward or backward)."""
        global _current
        previous, _current = _current, self
        self._order = self.order(length)
        try:
            yield
        finally:
            _current = previous


def active_positions(device: torch.device) -> torch.Tensor | None:
    """`[1, local tokens]` window positions of this rank's tokens in the forward in progress (None outside a
    context-parallel forward): RoPE for modules that are not handed the batch's positions (pipeline stages)."""
    layout = _current
    return None if layout is None else layout._order.view(layout.degree, -1)[layout.rank].to(device)[None]


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface function: local queries against the cp group's keys and values."""
    layout = _current
    if layout is None:  # outside a context-parallel forward (e.g. generate): plain causal attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    keys, values = _gather_sequence(key, layout.group), _gather_sequence(value, layout.group)
    order = layout._order.to(query.device)
    mine = order.view(layout.degree, -1)[layout.rank]
    allowed = order[None, :] <= mine[:, None]  # causal over window positions
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, dropout_p=dropout if
                                         module.training else 0.0, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    """`[batch, heads, seq, dim]` of every rank of `group`, concatenated along seq in rank order; the backward
    sends each rank the sum of all ranks' gradients for its part."""
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    by_sequence = tensor.permute(2, 0, 1, 3).contiguous()  # the collective gathers along dim 0
    gathered = wait_tensor(all_gather_single_autograd(by_sequence, 0, group))
    return gathered.permute(1, 2, 0, 3)


def install(model: torch.nn.Module, degree: int) -> None:
    """Route the model's attention through `attention` (registered once with transformers)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, attention)
    model.set_attn_implementation(ATTENTION_NAME)
    logger.info("context parallelism: every sequence split over %d ranks (2 chunks each, load-balanced); "
                "attention all-gathers keys and values over them", degree)


def context_parallel_degrees(world_size: int, seq_length: int) -> list[int]:
    """1, and the cp degrees worth planning for this world and sequence: 2-8 ranks, chunks of 512+ tokens."""
    return [1] + [cp for cp in (2, 4, 8) if not (world_size % cp or seq_length % (2 * cp)
                                                   or seq_length // cp < 1024)]
