"""`train`'s memory check before it builds the model: the plan of its own layout on its own device.

A predicted peak above the device's memory stops the run (`preflight_memory_check: error`, exit code 2) with
the prediction, the memory and the three best layouts that fit; `warn` logs the same and goes on; `off`
skips it. The prediction is kept so that the run records it next to the measured peak.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass

from ..config import ConfigError
from ..parallel import World
from ..run import ResolvedRun
from .device_spec import device_spec, size
from .planner import make_plan

logger = logging.getLogger(__name__)


class MemoryPlanError(ConfigError):
    """The predicted peak does not fit (a usage error: exit code 2)."""


@dataclass(frozen=True)
class PredictedMemory:
    peak_bytes: int
    device_memory_bytes: int

    def row(self) -> dict:
        return {"predicted_peak_mem_mb": self.peak_bytes / 2**20, "device_memory_mb": self.device_memory_bytes / 2**20}


def check_memory_before_build(args, run: ResolvedRun, world: World
                              ) -> tuple[ResolvedRun, PredictedMemory | None]:
    """The run with `accumulate_gradients: auto` decided, and the predicted peak (None: no check).
    `args`: preflight_memory_check and device_memory."""
    mode = args.preflight_memory_check
    if mode == "off" or run.model is None:
        return run, None
    memory = None if args.device_memory is None else str(args.device_memory)
    device = device_spec(run.dtype, world.local_size, None if world.device.type != "cpu" else "cpu", memory,
                         run.engine.costs.baseline_engine, memory_key="key 'device_memory'")
    plan = make_plan(run, world.local_size, device)
    if plan.accumulation is not None:
        run = run.with_accumulation(*plan.accumulation)
    own = plan.estimate
    logger.info("memory plan: predicted peak %s per rank of %s (%s)", size(own.peak), size(device.memory_bytes),
                device.memory_source)
    # the sequence-length stages that do not fit are named: the run's own layout is the last stage's
    too_large = [stage for stage in plan.length_stages if not stage.estimate.fits]
    if not own.fits or too_large:  # only then are the alternatives searched
        message = _refusal(plan) if not own.fits else _stage_refusal(too_large[0])
        if too_large and not own.fits:
            others = f" (and stage(s) {', '.join(str(s.number) for s in too_large[1:])})" if too_large[1:] else ""
            message = f"seq_length_schedule {too_large[0].describe()}{others}: {message}"
        if mode == "error":
            raise MemoryPlanError(message + "; or set preflight_memory_check: warn to try anyway")
        logger.warning("%s", message)
    peak = max([plan.estimate.peak, *(stage.estimate.peak for stage in plan.length_stages)])
    return run, PredictedMemory(peak, device.memory_bytes)


def _stage_refusal(stage) -> str:
    estimate = stage.estimate
    return (f"seq_length_schedule {stage.describe()}: predicted peak memory {size(estimate.peak)} per rank exceeds "
            f"the {size(estimate.device.memory_bytes)} available ({estimate.device.memory_source}) with "
            f"{estimate.layout.micro_batch} windows of {stage.seq_length} tokens a micro-batch; give the stage "
            "another length or lower micro_batch_size")


def _refusal(plan) -> str:
    own = plan.estimate
    sizes = own.per_rank_bytes()
    parts = ", ".join(f"{name} {size(sizes[name])}" for name in
                      ("parameters", "gradients", "optimizer", "activations", "logits", "runtime"))
    heap = f"; tensors x{own.heap_overhead:.2f} for the CPU heap's overhead" if own.device.kind == "cpu" else ""
    head = (f"predicted peak memory {size(own.peak)} per rank ({parts}{heap}) exceeds the "
            f"{size(own.device.memory_bytes)} available ({own.device.memory_source}) for {own.layout.describe()}")
    fitting = plan.fitting(3)
    if fitting:
        options = "; ".join(f"{shlex.join(e.layout.overrides())} ({size(e.peak)})" for e in fitting)
        return f"{head}. Layouts of the same {own.layout.world_size} process(es) that fit: {options}"
    smallest = min(plan.alternatives, key=lambda e: e.peak, default=own)
    return (f"{head}. No layout of {own.layout.world_size} process(es) fits (the smallest, "
            f"{shlex.join(smallest.layout.overrides())}, needs {size(smallest.peak)}): launch more processes "
            "(each holding a shard), plan with `pretrainer plan CONFIG --world-size N --device NAME`, or train fewer "
            "parameters (trainable_parameters) or a shorter seq_length")
