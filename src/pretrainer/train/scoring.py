"""Log-likelihood scoring of continuations through an engine's own forward, as lm-evaluation-harness scores
multiple-choice tasks (docs/downstream-eval.md, 'What is scored').

A request is one (context, continuation) pair, tokenized as the harness does: the whole text and the context
are encoded apart and the continuation's tokens are what the whole has beyond the context (trailing spaces
of the context move into the continuation), after the BOS the training documents start with. Every rank runs
the same number of forwards (a stand-in batch where it has none left), so sharded engines gather their
parameters in step; the sums are added with the engine's `reduce_sum`, which counts one tensor-parallel /
pipeline rank per replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..batch import IGNORE, batch_targets, to_device


@dataclass(frozen=True)
class Request:
    tokens: tuple[int, ...]   # prefix, context and continuation tokens (the inputs are all but the last)
    start: int                # index of the continuation's first token in `tokens`


def encode_request(tokenizer, context: str, continuation: str, max_length: int) -> Request:
    """The request's tokens, cut from the left to fit `max_length` inputs: the context goes first (a
    continuation longer than `max_length` keeps its last tokens, as lm-evaluation-harness does)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False) if context else []
    tokens = [prefix_token(tokenizer), *whole]
    start = 1 + len(context_ids)
    if start == len(tokens):
        raise ValueError(f"the continuation {continuation!r} has no tokens of its own")
    cut = max(0, len(tokens) - 1 - max_length)
    return Request(tuple(tokens[cut:]), max(1, start - cut))


def prefix_token(tokenizer) -> int:
    """The token every scored text starts after: the BOS training documents begin with, else the EOS."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to start scored texts with")
    return token


def plan_batches(requests: list[Request], batch_tokens: int) -> list[list[int]]:
    """Request indices in batches of at most `batch_tokens` padded input tokens, longest first (one batch's
    rows have similar lengths, so little is padding)."""
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].tokens), i))
    batches, current = [], []
    for index in order:  # the first of a batch is its widest
        if current and (len(current) + 1) * (len(requests[current[0]].tokens) - 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def make_batch(requests: list[Request], indices: list[int]) -> dict:
    """Inputs and targets (only the continuation's tokens count) of a right-padded batch."""
    width = max(len(requests[i].tokens) for i in indices) - 1
    ids = torch.zeros((len(indices), width), dtype=torch.long)
    targets = torch.full((len(indices), width), IGNORE, dtype=torch.long)
    for row, index in enumerate(indices):
        request = requests[index]
        tokens = torch.tensor(request.tokens)
        ids[row, :len(tokens) - 1] = tokens[:-1]
        targets[row, request.start - 1:len(tokens) - 1] = tokens[request.start:]
    return {"input_ids": ids, "shift_labels": targets}


STAND_IN = {"input_ids": torch.zeros((1, 8), dtype=torch.long), "shift_labels": torch.full((1, 8), IGNORE)}


@torch.no_grad()
def score_requests(model: torch.nn.Module, engine, requests: list[Request], batch_tokens: int,
                   greedy: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(log-likelihoods, whether greedy decoding yields each continuation or None) of every request, the same
    on every rank. `greedy` needs the forward's logits (a model without a chunked loss head)."""
    was_training = model.training
    model.eval()
    batches = plan_batches(requests, batch_tokens)
    replicas, mine = engine.data_world_size, engine.data_rank
    rounds = -(-len(batches) // replicas)
    # row 0: each continuation's log-likelihood; row 1: its tokens that are not the argmax (greedy: none)
    sums = torch.zeros((2, len(requests)), dtype=torch.float64, device=engine.device)
    for number in range(rounds):
        position = number * replicas + mine
        indices = batches[position] if position < len(batches) else None
        batch = to_device(engine.shard_batch(make_batch(requests, indices) if indices else STAND_IN), engine.device)
        with engine.autocast():
            output = engine.forward(model, batch, per_token=True)
        if output is None or indices is None:  # a pipeline rank without the last stage, or a stand-in
            continue
        output = output.whole()
        logits = output.logits
        targets = batch_targets(batch)
        rows = torch.tensor(indices, device=engine.device)
        sums[0, rows] -= output.each_token_loss(targets).double().sum(dim=1)
        if greedy:
            if logits is None:
                raise ValueError("greedy matches need the model's logits: set loss_chunk_size=0")
            missed = (logits.argmax(dim=-1) != targets) & (targets != IGNORE)
            sums[1, rows] += missed.sum(dim=1).double()
    model.train(was_training)
    totals = engine.reduce_sum(sums).cpu().numpy()
    return totals[0], (totals[1] == 0) if greedy else None
