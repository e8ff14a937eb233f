"""Evaluation: token-weighted loss, perplexity and next-token accuracy over `eval_iters` batches."""

from __future__ import annotations

import math
from itertools import islice

import torch

from ..batch import IGNORE, batch_targets, to_device
from ..run.callbacks import Callback


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, engine, max_batches: int | None, prepare=lambda batch: batch) -> dict:
    """`prepare`: what each batch becomes first (a sequence-length stage's windows)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=engine.device)  # loss, correct predictions, tokens
    for batch in islice(loader, max_batches):
        batch = to_device(engine.shard_batch(prepare(batch)), engine.device)
        targets = batch_targets(batch)
        with engine.autocast():
            output = engine.forward(model, batch)
        if output is None:  # a pipeline rank without the last stage
            continue
        sums[0] += output.loss_sum(targets).double()
        sums[1] += output.correct_count(targets).double()
        sums[2] += (targets != IGNORE).sum()
    model.train(was_training)
    totals = engine.reduce_sum(sums)
    tokens = max(totals[2].item(), 1.0)
    loss = totals[0].item() / tokens
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_acc": totals[1].item() / tokens,
            "eval_tokens": int(totals[2].item())}


class Validator(Callback):
    """Evaluation as the loop's callback: every `interval` steps, and once at the end unless the last step just
    did; each writes an eval row."""

    def __init__(self, batches, engine, interval: int | None, max_batches: int | None, sources: dict | None = None,
                 prepare=lambda batch: batch):
        self.batches, self.engine, self.interval, self.max_batches = batches, engine, interval, max_batches
        self.prepare = prepare  # the windows of the current sequence-length stage (evaluated at its length)
        self.sources = sources or {}  # a mixture's sources: each one's eval batches, for eval_loss/<name>
        self.last_step: int | None = None

    def after_step(self, result, state, loop) -> None:
        if self.batches is not None and self.interval and state.step % self.interval == 0:
            self._evaluate(state.step, loop)

    def at_end(self, state, loop) -> None:
        if self.batches is not None and self.last_step != state.step:
            self._evaluate(state.step, loop)

    def _evaluate(self, step: int, loop) -> None:
        loop.log.eval_row(self.run(loop.model, step))
        loop.model.train()

    def run(self, model: torch.nn.Module, step: int) -> dict:
        self.last_step = step
        row = {"step": step, **evaluate(model, self.batches, self.engine, self.max_batches, self.prepare)}
        for name, batches in self.sources.items():  # eval_iters batches of each source's held-out windows
            row[f"eval_loss/{name}"] = evaluate(model, batches, self.engine, self.max_batches,
                                                self.prepare)["eval_loss"]
        return row
