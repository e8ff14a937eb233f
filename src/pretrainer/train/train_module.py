"""The train module: one optimizer step, from a step's host micro-batches to its typed `StepResult`. It owns what a
step changes (the model, the optimizer and its schedule) and what decides the update: the loss with the callbacks'
terms, gradient clipping, and the rules that skip an update (a non-finite gradient norm, a loss spike)."""

from __future__ import annotations

import torch

from ..batch import count_inputs, count_targets, to_device
from ..perf import StepPhases
from ..run.callbacks import StepResult, TrainState, combined_loss, combined_losses
from .skips import SkippedUpdates
from .spikes import SpikeGuard


class TrainModule:
    def __init__(self, engine, model: torch.nn.Module, optimizer, scheduler, loss_fn, callbacks, clip_grad: float,
                 skips: SkippedUpdates, spike_guard: SpikeGuard | None, replicas=None):
        self.engine, self.model, self.optimizer, self.scheduler = engine, model, optimizer, scheduler
        self.loss_fn = combined_loss(loss_fn, callbacks)  # a micro-batch's summed loss, with the callbacks' terms
        self.extra_losses = combined_losses(callbacks)  # what the callbacks add to each backward
        self.callbacks, self.clip_grad, self.skips, self.spike_guard = callbacks, clip_grad, skips, spike_guard
        self.replicas = replicas  # fault tolerance's replica groups (train/replicas.py), or None

    def step(self, host_batches: list[dict], state: TrainState, phases: StepPhases, defer) -> StepResult:
        """One update from this rank's micro-batches, averaged over all their tokens on every rank; `defer` takes the
        row of an update skipped. Nothing here waits for the device (the result's tensors are device tensors)."""
        engine = self.engine
        with phases.host("data"):
            local_counts = torch.tensor([sum(int(count_targets(b)) for b in host_batches),
                                         sum(count_inputs(b) for b in host_batches),
                                         sum(len(b["input_ids"]) for b in host_batches)], dtype=torch.int64)
            micro_batches = [to_device(b, engine.device) for b in host_batches]
        # Token-weighted mean over the whole window: the loss of one big batch, whatever the split. The counts
        # are taken on the host batches and summed over ranks on the device, so no step waits for the device.
        with phases.host("comm"):
            counts = engine.reduce_counts(local_counts)
        scale = engine.mean_weight(counts[0].clamp(min=1))  # the gradient of the mean over every rank's tokens
        for callback in self.callbacks:
            callback.begin_step(counts, host_batches)
        with phases.device("compute"):
            local_loss = engine.forward_backward(self.model, micro_batches, self.loss_fn, scale, self.extra_losses)
        if self.replicas is not None:
            with phases.host("comm"):  # the replica groups' average; the update only where every group finished
                self.replicas.average_gradients(self.model, counts[0])
                if not self.replicas.should_commit():  # as a skipped update: the callbacks close the step's sums
                    self.optimizer.zero_grad(set_to_none=True)
                    result = StepResult(state.step + 1, local_loss, counts[:2], torch.zeros(()), 0.0, False, False)
                    for callback in self.callbacks:
                        callback.end_step(result, state)
                    return result
        guard = self.spike_guard  # its rule reads the loss with the gradient norm, in the step's one device read
        rule = guard.rule(engine.reduce_sum(local_loss), counts[0]) if guard is not None else None
        first = self.optimizer.param_groups[0]
        lr = first["lr"] / first.get("lr_factor", 1.0)  # the schedule's lr, whatever a parametrization scales it by
        with phases.device("optimizer"):
            grad_norm, applied = engine.step(self.model, self.optimizer, self.clip_grad,
                                             skip_nonfinite=bool(self.skips.limit), skip_rule=rule)
            if applied:
                engine.finish_step(self.optimizer, self.scheduler)
            else:
                self.optimizer.zero_grad(set_to_none=True)  # the schedule stays where it was, as in Megatron
            state.step += 1
            result = StepResult(state.step, local_loss, counts[:2], grad_norm, lr, applied)
            for callback in self.callbacks:
                callback.end_step(result, state)
        if guard is not None:
            guard.after_update(applied, grad_norm)
        skipped = self.skips.record(state.step, applied, grad_norm, guard and guard.reason)
        if skipped is not None:
            defer(skipped)
        return result
