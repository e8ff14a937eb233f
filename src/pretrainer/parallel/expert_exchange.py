"""Expert parallelism's token exchange: each token's hidden state goes to the rank holding each expert it was
routed to, and the experts' outputs come back, weighted, to the token's rank.

With `ep` ranks in a group and E experts, rank r holds experts [r * E/ep, (r + 1) * E/ep). A router call of T tokens,
top-k, makes T * k assignments. `ExpertExchange.dispatch` sorts them by expert (so by owning rank), exchanges how many
each rank sends to each of another's local experts (one small all-to-all), and sends the hidden states with
`all_to_all_single` at uneven splits; the received rows are regrouped by local expert, the layout a grouped GEMM takes.
`combine` sends the experts' outputs back the same way and sums each token's weighted outputs. Both directions are
differentiable (torch.distributed.nn's all-to-all): a backward sends the gradients along the reverse routes.

This module moves tokens only; the engines that hold expert slices build on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Routes:
    """One dispatch, kept for its combine."""
    order: torch.Tensor            # assignments sorted by expert (indices into the flattened [T, k])
    tokens: torch.Tensor           # the token of each sorted assignment
    sent: list[int]                # rows sent to each rank
    received: list[int]            # rows received from each rank
    by_expert: torch.Tensor        # permutation of received rows into local-expert order
    tokens_per_expert: torch.Tensor  # received rows per local expert (in that order)
    token_count: int


class ExpertExchange:
    def __init__(self, experts: int, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_world_size(group)
        if experts % self.ranks:
            raise ValueError(f"{experts} experts cannot be split evenly over {self.ranks} expert-parallel ranks")
        self.local = experts // self.ranks
        self.experts = experts

    def dispatch(self, hidden: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, Routes]:
        """`hidden` [T, H] and `indices` [T, k]: the rows this rank's local experts must run, grouped by local
        expert, and the routes back."""
        top_k = indices.shape[-1]
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // top_k
        counts = torch.bincount(flat, minlength=self.experts)  # to each (rank, local expert), in rank order
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)  # [source rank, local expert]
        sent = counts.view(self.ranks, self.local).sum(1).tolist()
        received = incoming.view(self.ranks, self.local).sum(1).tolist()
        rows = _AllToAll.apply(hidden[tokens], received, sent, self.group)
        local_ids = torch.arange(self.local, device=hidden.device).repeat(self.ranks)
        by_expert = torch.argsort(torch.repeat_interleave(local_ids, incoming), stable=True)
        per_expert = incoming.view(self.ranks, self.local).sum(0)
        return rows[by_expert], Routes(order, tokens, sent, received, by_expert, per_expert, hidden.shape[0])

    def combine(self, outputs: torch.Tensor, routes: Routes, weights: torch.Tensor) -> torch.Tensor:
        """The local experts' `outputs` (rows in `dispatch`'s order) sent home; per token the sum of its
        experts' outputs times their routing `weights` [T, k]."""
        back = torch.empty_like(outputs)
        back = back.index_copy(0, routes.by_expert, outputs)  # the order the rows arrived in
        home = _AllToAll.apply(back, routes.sent, routes.received, self.group)
        weighted = home * weights.reshape(-1)[routes.order].unsqueeze(-1).to(home.dtype)
        out = outputs.new_zeros((routes.token_count, outputs.shape[-1]))
        return out.index_add(0, routes.tokens, weighted)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single at uneven splits: `send[r]` rows to each rank r, `receive[r]` rows from each, forward and
    backward (the gradient goes back along the same routes)."""

    @staticmethod
    def forward(ctx, rows, receive, send, group):
        ctx.receive, ctx.send, ctx.group = receive, send, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None
