"""`pretrainer plan`: the plan of a config for a world and a device given on the command line."""

from __future__ import annotations

import logging

import torch

from ..config import ConfigError
from ..models import preflight
from ..parallel.engine import check_dtype
from ..parallel.factory import select_engine
from ..parallel.megatron_settings import read_settings
from .device import device_spec
from .planner import Plan, make_plan

GPU_DEVICES_PER_NODE = 8


def described_world(args) -> int:
    """The processes a config describes: dp x (tp x pp for megatron) x cp."""
    model_parallel = args.context_parallel_degree
    if args.engine == "megatron":
        settings = read_settings(args)
        model_parallel *= settings.tp * settings.pp
    return args.dp * model_parallel


def plan_for_command(args, world_size: int | None, devices_per_node: int | None, device_name: str | None,
                     device_memory: str | None, host_memory: str | None = None) -> Plan:
    logging.getLogger("pretrainer").setLevel(logging.WARNING)  # the plan is the output
    for flag, value in (("--world-size", world_size), ("--devices-per-node", devices_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    world = world_size or described_world(args)
    on_cpu = (device_name or ("cuda" if torch.cuda.is_available() else "cpu")).lower() == "cpu"
    per_node = devices_per_node or (world if on_cpu else min(world, GPU_DEVICES_PER_NODE))
    if args.dtype == "auto":  # as the engine resolves it: bf16 on GPUs, measured on CPUs
        if on_cpu:
            check_dtype(args, torch.device("cpu"))
        else:
            args.dtype = "bf16"
    engine = select_engine(args, world)
    settings = read_settings(args) if engine == "megatron" else None
    model_parallel = settings.model_parallel_size if settings else args.context_parallel_degree  # as the engines
    spec = preflight(args, model_parallel=model_parallel)
    device = device_spec(args.dtype, per_node, device_name, device_memory, engine, host_memory=host_memory)
    return make_plan(args, spec, world, per_node, device)
