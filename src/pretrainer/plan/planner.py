"""A plan for one resolved run: its layout's estimate and the alternatives, from what `train` resolves first
(`run.resolve_run`: engine settings and dimensions, model config, sizes, loss chunk), without building the model."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ..run import ResolvedRun
from .device_spec import DeviceSpec, size
from .estimate import Estimate, estimate
from .model_shape import ModelShape, model_shape
from .search import alternatives


class Plan:
    """The estimate of a run's own layout; the alternatives are searched when first asked for. `accumulation`:
    how `accumulate_gradients: auto` was decided, (mode, why), or None when the run did not leave it to the plan."""

    def __init__(self, shape: ModelShape, own: Estimate, search, accumulation: tuple[str, str] | None = None,
                 ramp_stages: list[tuple[int, int, Estimate]] = ()):
        self.shape, self.estimate, self._search, self.accumulation = shape, own, search, accumulation
        self.ramp_stages = list(ramp_stages)  # (first token, sequences, estimate) per batch_size_schedule stage
        self.length_stages: list[LengthStagePlan] = []  # per seq_length_schedule stage
        self.data_plan: str | None = None     # a data mixture's plan of draws (data.mixture_plan)

    @functools.cached_property
    def alternatives(self) -> list[Estimate]:
        return self._search()

    def fitting(self, count: int) -> list[Estimate]:
        return [e for e in self.alternatives if e.fits][:count]


def make_plan(run: ResolvedRun, devices_per_node: int, device: DeviceSpec) -> Plan:
    config = run.model_config
    shape = model_shape(config, run.vocab_size, run.mtp_depths)
    layout = run.layout(devices_per_node)

    def estimate_of(layout):
        return estimate(layout, shape, config, device, run.trainable, run.weights)

    own, decided = estimate_of(layout), None
    if layout.accumulate == "auto":
        own, decided = _decide_accumulation(own, estimate_of)
        layout = own.layout
    stages = _ramp_stages(layout, run, estimate_of)
    plan = Plan(shape, own, lambda: alternatives(layout, shape, config, device, run.loss_chunk_for, run.trainable,
                                                 run.weights), decided, stages)
    plan.length_stages = _length_stages(layout, run, estimate_of)
    return plan


@dataclass(frozen=True)
class LengthStagePlan:
    """One sequence-length stage's estimate: the run's layout at the stage's window length, with as many more
    windows per micro-batch as the tokens per micro-batch stay the same."""
    number: int                # 1-based
    count: int                 # stages in the schedule
    seq_length: int
    from_tokens: int
    until_tokens: int | None
    estimate: Estimate

    def describe(self) -> str:
        span = f"tokens {self.from_tokens:,} to {self.until_tokens:,}" if self.until_tokens is not None else \
            f"from token {self.from_tokens:,} to the end"
        return f"stage {self.number} of {self.count} (seq_length {self.seq_length}, {span})"


def _length_stages(layout, run: ResolvedRun, estimate_of) -> list[LengthStagePlan]:
    schedule, sizes = run.sizes.stages, run.sizes
    if schedule is None:
        return []
    plans = []
    for index, stage in enumerate(schedule.stages):
        start = schedule.start_tokens(index)
        accumulation = sizes.accumulation(math.ceil(sizes.steps_for(start) - 1e-9)) if sizes.ramp else \
            layout.accumulation
        staged = layout.replace(seq_length=stage.seq_length, accumulation=accumulation,
                                micro_batch=layout.micro_batch * schedule.windows_per_sequence(index))
        plans.append(LengthStagePlan(index + 1, len(schedule.stages), stage.seq_length, start, stage.until_tokens,
                                     estimate_of(staged)))
    return plans


def _ramp_stages(layout, run: ResolvedRun, estimate_of) -> list[tuple[int, int, Estimate]]:
    """Each batch-ramp stage's estimate: the same layout with that stage's micro-batches per replica."""
    ramp = run.sizes.ramp
    if ramp is None:
        return []
    per_round = run.sizes.micro_batch_size * run.sizes.data_parallel_size
    return [(start, seqs, estimate_of(layout.replace(accumulation=seqs // per_round))) for start, seqs in ramp.stages]


def _decide_accumulation(whole: Estimate, estimate_of) -> tuple[Estimate, tuple[str, str]]:
    """`accumulate_gradients: auto`: whole gradients (less traffic) where they fit, else sharded ones."""
    memory = size(whole.device.memory_bytes)
    if whole.fits:
        why = f"auto: whole gradients fit, predicted {size(whole.peak)} of {memory}"
        return dataclasses.replace(whole, layout=whole.layout.replace(accumulate="unsharded")), ("unsharded", why)
    sharded = estimate_of(whole.layout.replace(accumulate="sharded"))
    return sharded, ("sharded", f"auto: whole gradients would need {size(whole.peak)} of {memory}; sharded "
                                f"{size(sharded.peak)}")
