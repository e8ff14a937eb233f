"""Downstream evaluation: multiple-choice tasks scored by log-likelihood in the training loop (`scoring.py`).

Each task reports `acc`, `acc_norm` (as lm-evaluation-harness's) and `bpb` (as OLMo's downstream evaluator); their
definitions: docs/downstream-eval.md, 'What is scored'. Files are read and tokenized once, when the run starts.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from ..config import BatchSizes, ConfigError, DownstreamTask
from ..data.readers import DataError
from ..data.tasks import ChoiceRecord, read_task
from ..run.callbacks import Callback
from .scoring import Request, encode_request, score_requests

logger = logging.getLogger("pretrainer")


@dataclass
class ScoredTask:
    """A task read and tokenized: its records, and one request per (record, choice) in record order."""
    task: DownstreamTask
    records: list[ChoiceRecord]
    requests: list[Request]
    choice_chars: np.ndarray   # per request
    choice_bytes: np.ndarray   # per request

    @staticmethod
    def load(task: DownstreamTask, tokenizer, max_length: int) -> "ScoredTask":
        records = read_task(task)
        requests, chars, sizes = [], [], []
        for record in records:
            for choice in record.choices:
                try:
                    requests.append(encode_request(tokenizer, record.context, task.target_delimiter + choice,
                                                   max_length))
                except ValueError as exc:
                    raise DataError(f"{record.where}: {exc}") from None
                chars.append(max(len(choice), 1))
                sizes.append(max(len(choice.encode("utf-8")), 1))
        return ScoredTask(task, records, requests, np.array(chars, dtype=np.float64),
                          np.array(sizes, dtype=np.float64))

    def metrics(self, logliks: np.ndarray) -> dict:
        """acc, acc_norm and bpb from every request's log-likelihood."""
        correct = correct_norm = bits = 0.0
        start = 0
        for record in self.records:
            end = start + len(record.choices)
            scores = logliks[start:end]
            correct += float(np.argmax(scores) == record.gold)
            correct_norm += float(np.argmax(scores / self.choice_chars[start:end]) == record.gold)
            bits += -scores[record.gold] / (math.log(2) * self.choice_bytes[start + record.gold])
            start = end
        count = len(self.records)
        return {"acc": correct / count, "acc_norm": correct_norm / count, "bpb": bits / count}


def score_tasks(model, engine, tasks: list[ScoredTask], batch_tokens: int) -> dict[str, dict]:
    """{task name: {acc, acc_norm, bpb}}: all tasks' requests go through the model in one pass."""
    requests = [request for task in tasks for request in task.requests]
    logliks, _ = score_requests(model, engine, requests, batch_tokens, greedy=False)
    out, start = {}, 0
    for task in tasks:
        out[task.task.name] = task.metrics(logliks[start:start + len(task.requests)])
        start += len(task.requests)
    return out


def format_scores(scores: dict[str, dict]) -> str:
    return " | ".join(f"{name} acc {v['acc']:.4f} acc_norm {v['acc_norm']:.4f} bpb {v['bpb']:.4f}"
                      for name, v in scores.items())


class DownstreamEvaluator(Callback):
    """Downstream scoring as the loop's callback: each task every `every` steps (default `eval_interval`) and once
    at the end; the rows it writes and the time it takes (kept apart from the training steps')."""

    def __init__(self, tasks: tuple[DownstreamTask, ...], tokenizer, engine, sizes: BatchSizes,
                 default_every: int | None, run_started: float):
        """Scored batches hold as many tokens as a training micro-batch; contexts are cut to seq_length."""
        if tasks and tokenizer is None:
            raise ConfigError("downstream_evals: scoring tasks needs the tokenizer; set tokenizer_path (or "
                              "model_path to a folder with one)")
        self.engine, self.batch_tokens, self.run_started = engine, sizes.micro_batch_tokens, run_started
        started = time.perf_counter()
        self.tasks = [ScoredTask.load(task, tokenizer, sizes.seq_length) for task in tasks]
        self.every = {t.task.name: t.task.every or default_every for t in self.tasks}
        self.last_step: int | None = None
        self.seconds = time.perf_counter() - started
        if self.tasks:
            logger.info("downstream evaluation: %s (%d choices to score each time; read in %.1f s)",
                        ", ".join(f"{t.task.name} ({len(t.records)} records)" for t in self.tasks),
                        sum(len(t.requests) for t in self.tasks), self.seconds)

    def after_step(self, result, state, loop) -> None:
        self._score([t for t in self.tasks if self.every[t.task.name] and state.step % self.every[t.task.name] == 0],
                    state, loop)

    def at_end(self, state, loop) -> None:
        self._score(self.tasks if self.last_step != state.step else [], state, loop)
        if self.tasks and self.engine.is_main:  # the time scoring took, next to the run's (kept out of step times)
            seconds = time.perf_counter() - self.run_started
            logger.info("downstream evaluation took %.1f s in all, %.1f%% of the run's %.1f s so far (kept out of "
                        "step times and tokens/s)", self.seconds, 100 * self.seconds / seconds, seconds)

    def _score(self, tasks: list[ScoredTask], state, loop) -> None:
        if tasks:
            loop.log.record({**self.run(loop.model, state.step, tasks), "tokens": loop.count_tokens()})
            loop.model.train()

    def run(self, model, step: int, tasks: list[ScoredTask]) -> dict:
        """The metrics row after scoring `tasks` at `step` (the scores logged by the main rank)."""
        started = time.perf_counter()
        scores = score_tasks(model, self.engine, tasks, self.batch_tokens)
        seconds = time.perf_counter() - started
        self.seconds += seconds
        self.last_step = step
        if self.engine.is_main:
            logger.info("downstream step %d (%.1f s): %s", step, seconds, format_scores(scores))
        return {"step": step, **{f"eval/{name}/{key}": value for name, values in scores.items()
                                 for key, value in values.items()}, "downstream_seconds": seconds}
