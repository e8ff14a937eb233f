"""`pretrainer plan`: the plan of a config for a world and a device given on the command line."""

from __future__ import annotations

import logging

import torch

from ..config import ConfigError
from ..data import mixture_plan
from ..parallel import planned_world
from ..run import described_world_size, resolve_run
from .device_spec import device_spec
from .planner import Plan, make_plan

GPU_DEVICES_PER_NODE = 8


def plan_for_command(args, world_size: int | None, devices_per_node: int | None, device_name: str | None,
                     device_memory: str | None, host_memory: str | None = None,
                     links: tuple[str | None, str | None] = (None, None)) -> Plan:
    """The plan the command prints; the run's own log lines are quieted meanwhile (the plan is the output)."""
    for flag, value in (("--world-size", world_size), ("--devices-per-node", devices_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    quiet = logging.getLogger("pretrainer")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        world = world_size or described_world_size(args)
        on_cpu = (device_name or ("cuda" if torch.cuda.is_available() else "cpu")).lower() == "cpu"
        per_node = devices_per_node or (world if on_cpu else min(world, GPU_DEVICES_PER_NODE))
        # The run as `train` resolves it on that world; a named GPU has bf16 (`dtype: auto`).
        planned = planned_world(world, per_node, torch.device("cpu" if on_cpu else "cuda"))
        run = resolve_run(args, planned, accelerator_bf16=None if on_cpu else True, check_dp=world_size is None)
        device = device_spec(run.dtype, per_node, device_name, device_memory, run.engine.costs.baseline_engine,
                             host_memory=host_memory, links=links)
        plan = make_plan(run, per_node, device)
        if run.tokenizer is not None:  # a mixture's plan of draws, where its sources are tokenized already
            plan.data_plan = mixture_plan(args, run.tokenizer, run.sizes)
        return plan
    finally:  # a caller in the same process (a script, a test) keeps its logging
        quiet.setLevel(level)
