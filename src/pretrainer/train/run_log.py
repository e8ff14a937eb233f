"""The run's rows, in one place: metrics.jsonl and the trackers (main rank), the history kept in memory
(`PreTrainer.log_history`), rows produced inside a step and written after it, the throughput meter and the
progress bar; the interval's train row as the loop's callback, and what the loop hands its callbacks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..perf import IntervalMeter, device_peak
from ..run.callbacks import Callback, TrainState
from .metrics import MetricsLog, Progress, format_eval_line, format_train_line
from .trackers import open_trackers

logger = logging.getLogger("pretrainer")


class RunLog:
    def __init__(self, args, engine, flops, recompute: str, history: list[dict], callbacks=()):
        self.is_main = engine.is_main
        trackers = open_trackers(args.report_to, args.run_dir, args.project_name, args.to_dict()) \
            if engine.is_main else []
        self.metrics = MetricsLog(args.run_dir, enabled=engine.is_main, trackers=trackers)
        self.meter = IntervalMeter(engine, flops, device_peak(engine.device, engine.precision.compute_dtype,
                                                              args.peak_tflops), recompute)
        self.history = history
        self.seq_length: int | None = None  # the window length of the rows' steps (a sequence-length stage's)
        self.callbacks = callbacks  # each hears of every row (run/callbacks.py's on_row)
        self.progress: Progress | None = None
        self._deferred: list[dict] = []

    def record(self, row: dict) -> None:
        if "step" in row and self.seq_length is not None:
            row.setdefault("seq_length", self.seq_length)
        self.metrics.write(row)
        self.history.append(row)
        for callback in self.callbacks:
            callback.on_row(row)

    def defer(self, row: dict) -> None:
        """A row produced inside a step, written once the step is done."""
        self._deferred.append(row)

    def write_deferred(self) -> None:
        for row in self._deferred:
            self.record(row)
        self._deferred.clear()

    def start_progress(self, total: int, done: int) -> None:
        self.progress = Progress(total, done, enabled=self.is_main)

    def train_row(self, row: dict) -> None:
        self.record(row)
        if self.is_main:
            self.progress.log(format_train_line(row, self.progress.eta(row["step"])))

    def eval_row(self, row: dict) -> None:
        self.record(row)
        if self.is_main:
            logger.info(format_eval_line(row))

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def close(self) -> None:
        self.metrics.close()


@dataclass
class LoopParts:
    """What the loop hands its callbacks once a step is measured."""
    model: torch.nn.Module
    optimizer: object
    log: RunLog
    state: TrainState

    def count_tokens(self) -> int:
        """Move the meter's target count into the train state (a device read: only at log, save and end)."""
        self.state.tokens += self.log.meter.take_targets()
        return self.state.tokens


class IntervalRows(Callback):
    """The train row every `log_interval` steps and at the last: the meter's interval figures, the step's lr and
    gradient norm, the tokens so far, and each callback's own metrics of the interval; the progress bar."""

    def __init__(self, every: int, total_steps: int, stream, callbacks):
        self.every, self.total_steps, self.stream, self.callbacks = every, total_steps, stream, callbacks

    def after_step(self, result, state, loop: LoopParts) -> None:
        if state.step % self.every == 0 or state.step == self.total_steps:
            row = {"step": state.step, **loop.log.meter.row(), "lr": result.lr, "grad_norm": float(result.grad_norm),
                   "tokens": loop.count_tokens(), "epoch": self.stream.epoch}
            for callback in self.callbacks:
                row.update(callback.interval_row())
            loop.log.train_row(row)
        loop.log.progress.update(state.step)
