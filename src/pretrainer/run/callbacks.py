"""Callbacks: the one way to add to a training run without changing the loop (the events, their order and what each
is given: docs/python-api.md, 'Callbacks'). The loop's own parts are callbacks (train/), and so are the model's
features, made by the run for itself: a Mixture-of-Experts model's routing, the output z-loss, multi-token prediction,
a mixture's accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import IGNORE, SOURCE, HeadOutput, batch_targets, depth_targets
from ..models import MoeRouting
from ..models.mtp import MtpForward
from ..parallel.engine import to_device_async


@dataclass
class TrainState:
    """The loop's own progress: optimizer steps completed and target tokens trained (counted on the host at each
    log, save and the end: reading the device's count is a sync)."""
    step: int = 0
    tokens: int = 0

    def load_tokens(self, tokens) -> None:  # a checkpoint's `tokens` component
        self.tokens = int(tokens)


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step gave."""
    step: int                  # the step's number (1 for the first)
    loss_sum: torch.Tensor     # this rank's summed token loss over the step's micro-batches (device)
    counts: torch.Tensor       # the global [targets, useful tokens] of the step (device)
    grad_norm: torch.Tensor    # before clipping
    lr: float                  # the learning rate the update used
    applied: bool              # the update was applied (not skipped: a non-finite norm, a spike rule)
    committed: bool = True     # every replica group finished the step (False: nobody applied it; see replicas.py)


class Callback:
    """A part in each step; every method is optional (the defaults do nothing)."""

    def attach(self, engine, model: torch.nn.Module) -> None:
        """After the engine has wrapped the model (`model`: what the loop calls forward on)."""

    def register_state(self, state) -> None:
        """This feature's saved state, registered with the run's components (train/run_state.py's `register`)."""

    def begin_step(self, counts: torch.Tensor, batches: list[dict]) -> None:
        """Before the step's micro-batches; `counts`: the global [targets, useful tokens, rows] (device);
        `batches`: this rank's host micro-batches of the step (a batch ramp changes how many)."""

    def extra_losses(self) -> torch.Tensor | None:
        """Called after each micro-batch's forward: what it adds to that backward (None: nothing)."""

    def add_to_loss(self, summed: torch.Tensor, output: HeadOutput, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's summed loss with this feature's term (from the forward's `output`: logits or the
        head's own sums); its value stays the cross-entropy's, for the log."""
        return summed

    def end_step(self, result: StepResult, state: TrainState) -> None:
        """After the optimizer step (`state.step` already counts it); after a step no replica group applied too
        (`result.committed` False, `state.step` unchanged: the step is trained again on the next data)."""

    def after_step(self, result: StepResult, state: TrainState, loop) -> None:
        """Once the step is measured and before the next is timed (docs/python-api.md, 'Callbacks')."""

    def on_stop(self, state: TrainState, loop) -> None:
        """The loop leaves before its last step (a stop request, exit_interval), after `after_step`."""

    def at_end(self, state: TrainState, loop) -> None:
        """After the last step, before the HF export and the report."""

    def interval_row(self) -> dict:
        """Metrics over the steps since the last logged row."""
        return {}

    def on_row(self, row: dict) -> None:
        """Every row the run writes to metrics.jsonl, after it is written, on every rank."""

    def on_save(self, step: int, path) -> None:
        """Once the checkpoint of `step` is complete in its folder `path`, on every rank."""

    def start_row(self) -> dict:
        return {}

    def describe(self) -> str:
        """Its part of the banner's model line ("" for none)."""
        return ""


class MoeStep(Callback):
    """A Mixture-of-Experts model's routing in the loop (models/moe_routing.py's MoeRouting on the engine's ranks)."""

    def __init__(self, model: torch.nn.Module, run):
        self.run = run
        self.routing = MoeRouting(model, run.moe)  # hooks the routers, before an engine wraps them
        self.engine = None

    def attach(self, engine, model: torch.nn.Module) -> None:
        """Each micro-batch starts where the engine runs it; tokens are split as it splits them."""
        self.engine = engine
        self.routing.keep_counts_on(engine.device)
        self.routing.watch_forwards(engine.forward_modules(model))
        self.routing.split_sequences(engine.routing_group)
        if engine.balancing_losses_on_activations:
            self.routing.attach_losses()

    def begin_step(self, counts: torch.Tensor, batches: list[dict]) -> None:
        """The factor of one unit's balancing losses: their gradient is that of the mean over the global batch's
        units (sequences, or micro-batches)."""
        seq = self.run.moe.aux_loss_type == "seq"
        units = counts[2].clamp(min=1).double() if seq else len(batches) * self.engine.data_world_size
        self.routing.begin_step(self.engine.mean_weight(units))

    def extra_losses(self) -> torch.Tensor | None:
        return self.routing.take_losses()

    def end_step(self, result: StepResult, state: TrainState) -> None:
        self.routing.end_step(self._routing_sum, result.applied)

    def _routing_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Routing counts and sums over every rank: each rank counts the tokens it routed itself."""
        value = value.clone()
        self.engine.sum_over_ranks(value)
        return value

    def interval_row(self) -> dict:
        return self.routing.interval_row(self._routing_sum)

    def start_row(self) -> dict:
        return {"moe": self.run.moe.describe(), "experts_implementation": self.routing.experts_implementation}

    def describe(self) -> str:
        return f"Mixture-of-Experts: {self.run.moe.describe()}; experts computed by " \
               f"{self.routing.experts_implementation}"


class OutputZLoss(Callback):
    """PaLM's output z-loss (docs/optimization.md, 'Output z-loss'). Its term on the summed loss is c x (z - sg(z)):
    the value stays the cross-entropy, the gradient gains the z-loss's. A chunked head computes it inside its
    chunks, its gradient already included (models/chunked_loss.py)."""

    def __init__(self, coeff: float):
        self.coeff = coeff
        self.engine = None
        self._sums = None  # [z sum, targets] of the interval, on the device
        self._window: list[torch.Tensor] = []  # this step's z sums, one per loss call

    def attach(self, engine, model: torch.nn.Module) -> None:
        self.engine = engine
        self._sums = torch.zeros(2, dtype=torch.float64, device=engine.device)

    def begin_step(self, counts: torch.Tensor, batches: list[dict]) -> None:
        self._sums[1] += counts[0]  # the global targets: the z sums are added over ranks when logged
        self._window = []

    def end_step(self, result: StepResult, state: TrainState) -> None:
        for z in self._window:
            self._sums[0] += z
        self._window = []

    def add_to_loss(self, summed: torch.Tensor, output: HeadOutput, targets: torch.Tensor) -> torch.Tensor:
        z = output.z_loss_sum(targets)
        self._window.append(z.detach().double())
        if output.z_sum is not None:  # the chunked head computed it: its gradient already holds the z-loss's
            return summed
        return summed + self.coeff * (z - z.detach())

    def interval_row(self) -> dict:
        z_sum = self.engine.reduce_sum(self._sums[:1].clone())
        row = {"z_loss": z_sum.item() / max(self._sums[1].item(), 1.0)}
        self._sums.zero_()
        return row

    def start_row(self) -> dict:
        return {"z_loss_coeff": self.coeff}

    def describe(self) -> str:
        return f"output z-loss {self.coeff:g}"


class SourceAccounting(Callback):
    """A mixture's `source_tokens/<name>` and `source_loss/<name>` (docs/data.md, 'Mixtures', Accounting)."""

    def __init__(self, mixture, stream):
        self.mixture, self.stream = mixture, stream
        self.engine, self._sources, self._window, self._sums = None, [], [], None
        self._without_rows = False  # a pipeline schedule hands the head no sources: no source_loss
        self._targets = torch.zeros(len(mixture.names), dtype=torch.float64)  # of the interval, this rank's
        self._resumed_at: tuple[int, dict[str, int]] | None = None  # (position, counts) a checkpoint holds
        self._blend_at_resume: dict[str, int] | None = None  # the blend's own counts at that position

    def attach(self, engine, model: torch.nn.Module) -> None:
        self.engine = engine
        self._sums = torch.zeros(len(self.mixture.names), dtype=torch.float64, device=engine.device)

    def begin_step(self, counts: torch.Tensor, batches: list[dict]) -> None:
        """Each micro-batch's row sources, sent ahead to the device; the targets per source counted on the host
        (nothing here waits for the device)."""
        self._sources, self._window = [], []
        for batch in batches:
            sources = batch.get(SOURCE)
            self._sources.append(to_device_async(sources, self.engine.device) if sources is not None else None)
            if sources is not None:
                self._targets.index_add_(0, sources, (batch_targets(batch) != IGNORE).sum(-1).double())

    def add_to_loss(self, summed: torch.Tensor, output: HeadOutput, targets: torch.Tensor) -> torch.Tensor:
        self._window.append(output.row_loss_sums(targets))
        return summed

    def end_step(self, result: StepResult, state: TrainState) -> None:
        # one loss call per micro-batch; none on a pipeline rank without the last stage, which computes no loss
        for rows, sources in zip(self._window, self._sources, strict=bool(self._window)):
            if sources is not None and rows is None:  # the head ran without the rows' sources (pipelined)
                self._without_rows = True
            elif sources is not None:
                self._sums.index_add_(0, sources, rows.double())
        self._window = []

    def register_state(self, state) -> None:
        state.register("source_tokens", lambda: {"position": self.stream.position, "tokens": self.trained_tokens()},
                       self._resume_counts, default=None)

    def _resume_counts(self, saved: dict | None) -> None:
        self._resumed_at = None if saved is None else (int(saved["position"]), saved["tokens"])
        self._blend_at_resume = None

    def trained_tokens(self) -> dict[str, int]:
        """Each source's trained target tokens so far. After a resume, the checkpoint's counts plus what the blend
        gave since: a resume onto another blend (override_mixture) never recounts the steps already trained."""
        if self._resumed_at is None:
            return self.mixture.trained_tokens(self.stream.position)
        position, counts = self._resumed_at
        if self._blend_at_resume is None:  # once, before the counts move on (the blend counts incrementally)
            self._blend_at_resume = self.mixture.trained_tokens(position)
        now = self.mixture.trained_tokens(self.stream.position)
        return {name: counts.get(name, 0) + now[name] - self._blend_at_resume[name] for name in self.mixture.names}

    def interval_row(self) -> dict:
        tokens = {f"source_tokens/{name}": n for name, n in self.trained_tokens().items()}
        both = self.engine.reduce_sum(torch.cat([self._sums, self._targets.to(self._sums.device)]))
        sums, counted = both.split(len(self.mixture.names))
        self._sums.zero_()
        self._targets.zero_()
        if self._without_rows:
            return tokens
        losses = {f"source_loss/{name}": loss / count for name, loss, count in
                  zip(self.mixture.names, sums.tolist(), counted.tolist()) if count > 0}
        return {**tokens, **losses}

    def start_row(self) -> dict:
        return {"sources": list(self.mixture.names)}


class MultiTokenPrediction(Callback):
    """Multi-token prediction's loss weights and metrics (docs/multi-token-prediction.md; models/mtp.py runs the
    depths). Each depth's global target count is counted on the host from the same rule (batch.depth_targets) and
    summed over ranks with the step's counts."""

    def __init__(self, model: torch.nn.Module, settings):
        self.settings = settings
        self.forward = MtpForward(model)  # hooks the head, before an engine wraps the model
        self.engine, self._sums, self._window = None, None, []
        self._targets = torch.zeros(settings.depths, dtype=torch.float64)  # of the interval, summed over ranks

    def attach(self, engine, model: torch.nn.Module) -> None:
        self.engine = engine
        self._sums = torch.zeros(2, self.settings.depths, dtype=torch.float64, device=engine.device)
        self._targets = self._targets.to(engine.device)

    def begin_step(self, counts: torch.Tensor, batches: list[dict]) -> None:
        """Each depth's loss weight for the step: lambda / D x the weight of the mean over the depth's global
        targets."""
        local = torch.tensor([sum(int((depth_targets(b, k) != IGNORE).sum()) for b in batches)
                              for k in range(1, self.settings.depths + 1)], dtype=torch.int64)
        depth_counts = self.engine.reduce_counts(local)
        self._targets += depth_counts
        per_depth = self.settings.loss_coeff / self.settings.depths
        self.forward.loss_weights = per_depth * self.engine.mean_weight(depth_counts.clamp(min=1).double())
        self._window = []

    def extra_losses(self) -> None:
        """After each forward: its depths' sums, for the metrics (their loss is already in the backward)."""
        for results in self.forward.take_results():
            self._window.append(torch.stack([torch.stack([r.loss_sum.detach() for r in results]),
                                             torch.stack([r.correct for r in results])]).double())

    def end_step(self, result: StepResult, state: TrainState) -> None:
        self.extra_losses()  # a pipeline schedule's forwards, which no extra_losses call follows
        for sums in self._window:
            self._sums += sums
        self._window = []

    def interval_row(self) -> dict:
        sums = self.engine.reduce_sum(self._sums.clone())
        counted = self._targets.clamp(min=1)
        losses, accuracy = (sums[0] / counted).tolist(), (sums[1] / counted).tolist()
        self._sums.zero_()
        self._targets.zero_()
        row = {"mtp_loss": sum(losses) / len(losses)}
        for k, (loss, acc) in enumerate(zip(losses, accuracy), start=1):
            row[f"mtp_loss/{k}"], row[f"mtp_acc/{k}"] = loss, acc
        return row

    def start_row(self) -> dict:
        return {"mtp_num_layers": self.settings.depths, "mtp_loss_coeff": self.settings.loss_coeff}

    def describe(self) -> str:
        return self.settings.describe()


def model_callbacks(model: torch.nn.Module, run) -> list[Callback]:
    """The callbacks the resolved run's model needs, made on the unwrapped model."""
    callbacks: list[Callback] = [MoeStep(model, run)] if run.moe is not None else []
    if run.z_loss_coeff:
        callbacks.append(OutputZLoss(run.z_loss_coeff))
    if run.mtp is not None:
        callbacks.append(MultiTokenPrediction(model, run.mtp))
    return callbacks


def combined_loss(loss_fn, callbacks: list[Callback]):
    """`loss_fn(output, targets)` (a micro-batch's summed loss) with each callback's term added."""
    if not callbacks:
        return loss_fn

    def loss(output: HeadOutput, targets: torch.Tensor) -> torch.Tensor:
        summed = loss_fn(output, targets)
        for callback in callbacks:
            summed = callback.add_to_loss(summed, output, targets)
        return summed

    return loss


def combined_losses(callbacks: list[Callback]):
    """One `extra_losses` callable for the engine's forward_backward (None when no callback adds losses)."""
    if not callbacks:
        return None

    def extra() -> torch.Tensor | None:
        losses = [loss for loss in (c.extra_losses() for c in callbacks) if loss is not None]
        return sum(losses[1:], losses[0]) if losses else None

    return extra
