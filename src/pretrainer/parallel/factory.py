"""Choose the engine: from the config's `engine`, or (`auto`) from how the job was launched."""

from __future__ import annotations

import os

from ..config import ConfigError
from ..config.arguments import ENGINES as ENGINE_CHOICES
from .engine import Engine, EngineOptions, SingleEngine
from .world import World, launch_world_size

ENGINES = tuple(name for name in ENGINE_CHOICES if name != "auto")  # the engines the `engine` key names
ACCELERATE_FLAGS = {"ACCELERATE_USE_FSDP": "fsdp", "ACCELERATE_USE_DEEPSPEED": "deepspeed",
                    "ACCELERATE_USE_MEGATRON_LM": "megatron"}


def launcher_engine() -> str | None:
    """The engine an `accelerate launch` config asked for, if any."""
    for variable, engine in ACCELERATE_FLAGS.items():
        if os.environ.get(variable, "false").lower() == "true":
            return engine
    return None


def select_engine(args, world_size: int | None = None) -> str:
    """The engine for `args` on `world_size` processes (default: the launch's; the planner passes its own)."""
    planned = world_size is not None
    world_size = world_size if planned else launch_world_size()
    requested = launcher_engine()
    name = args.engine
    if name == "auto":
        name = requested or ("deepspeed" if args.deepspeed is not None else "ddp" if world_size > 1 else "single")
    elif requested and requested != name:
        raise ConfigError(f"key 'engine': the config asks for {name!r} but the launcher asked for {requested!r} "
                          f"({[v for v, e in ACCELERATE_FLAGS.items() if e == requested][0]}=true); make them agree "
                          "or set engine: auto")
    if args.deepspeed is not None and name != "deepspeed":
        raise ConfigError(f"key 'deepspeed' is set but the engine is {name!r}; remove one of them")
    if name == "single" and world_size > 1:
        started = f"{world_size} processes are planned" if planned else \
            f"the launch started {world_size} processes (WORLD_SIZE={world_size})"
        raise ConfigError(f"engine: single runs one process, but {started}; use engine: ddp or fsdp, or "
                          f"{'--world-size 1' if planned else 'launch one process'}")
    return name


def engine_class(name: str) -> type[Engine]:
    """The class of engine `name` (imported only when asked for: the planner reads its capabilities)."""
    if name == "single":
        return SingleEngine
    if name == "ddp":
        from .ddp import DDPEngine

        return DDPEngine
    if name == "megatron":
        from .megatron import MegatronEngine

        return MegatronEngine
    if name == "deepspeed":
        from .deepspeed import DeepSpeedEngine

        return DeepSpeedEngine
    from .fsdp import FSDPEngine

    return FSDPEngine


def create_engine(name: str, options: EngineOptions, world: World) -> Engine:
    """Engine `name`, built from its part of the resolved run on `world`."""
    return engine_class(name)(options, world)
