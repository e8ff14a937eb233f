"""Run by tests/test_moe.py under torchrun (2 ranks, gloo): the expert-parallel token exchange against each
rank computing every expert itself, forward and backward, for several routings (uniform, skewed to two
experts, each rank keeping its tokens home so nothing crosses). Writes OUT/rank<R>.json with the largest differences."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pretrainer.parallel.expert_exchange import ExpertExchange
from pretrainer.parallel.world import destroy_process_group

dist.init_process_group("gloo")
rank, ranks = dist.get_rank(), dist.get_world_size()
EXPERTS, TOP_K, HIDDEN, OUT = 4, 2, 8, 6
local = EXPERTS // ranks
weights_all = torch.randn(EXPERTS, HIDDEN, OUT, generator=torch.Generator().manual_seed(3))


def routings(tokens: int):
    g = torch.Generator().manual_seed(10 + rank)
    yield "uniform", torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    skewed = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    skewed[: tokens * 3 // 4, 0] = 0  # most tokens to expert 0 (on rank 0)
    skewed[: tokens * 3 // 4, 1] = 1
    yield "skewed", skewed
    own = torch.stack([torch.randperm(local, generator=g)[:TOP_K] + rank * local for _ in range(tokens)])
    yield "stay-home", own  # each rank's tokens go only to its own experts: nothing crosses


worst = {}
for tokens in (5, 12):
    for name, indices in routings(tokens):
        hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(20 + rank), requires_grad=True)
        gates = torch.rand(tokens, TOP_K, generator=torch.Generator().manual_seed(30 + rank), requires_grad=True)
        upstream = torch.randn(tokens, OUT, generator=torch.Generator().manual_seed(40 + rank))

        # every expert here, on this rank's own tokens
        full = weights_all.clone().requires_grad_(True)
        reference = sum(gates[:, j:j + 1] * torch.bmm(hidden.unsqueeze(1), full[indices[:, j]]).squeeze(1)
                        for j in range(TOP_K))
        (reference * upstream).sum().backward()
        ref_hidden, ref_gates, ref_weights = hidden.grad.clone(), gates.grad.clone(), full.grad.clone()
        dist.all_reduce(ref_weights)  # every rank's tokens' share of each expert's gradient
        hidden.grad = gates.grad = None

        # this rank's experts only, tokens exchanged
        mine = weights_all[rank * local:(rank + 1) * local].clone().requires_grad_(True)
        exchange = ExpertExchange(EXPERTS)
        rows, routes = exchange.dispatch(hidden, indices)
        pieces = torch.split(rows, routes.tokens_per_expert.tolist())
        outputs = torch.cat([piece @ mine[e] for e, piece in enumerate(pieces)]) if rows.numel() else \
            rows.new_zeros((0, OUT)) + mine.sum() * 0
        combined = exchange.combine(outputs, routes, gates)
        (combined * upstream).sum().backward()
        worst[f"{name}-{tokens}"] = {
            "forward": float((combined - reference).detach().abs().max()),
            "hidden_grad": float((hidden.grad - ref_hidden).abs().max()),
            "gate_grad": float((gates.grad - ref_gates).abs().max()),
            "expert_grad": float((mine.grad - ref_weights[rank * local:(rank + 1) * local]).abs().max()),
            "received": routes.received, "sent": routes.sent}

Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
(Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(worst))
destroy_process_group(barrier=True)  # gloo's workers idle and joined first: a bare destroy may abort at exit
