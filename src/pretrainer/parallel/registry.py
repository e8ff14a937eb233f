"""The engines, registered once: every place that lists engines, names one or chooses one reads this table.

An `EngineEntry` holds an engine's name (the `engine` key's value), its class (which reads its own settings and builds
its dimensions), its cost model (parallel/layout.py) and the keys and launcher variable that select it or lay a run out
over processes for it (reset to defaults when one process evaluates or exports a run). `select_engine` turns the config
and the launch into an entry, refusing an unknown name (with the nearest known one) before anything is built."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ..config import ConfigError, key_error
from ..config.loading import suggestion
from .deepspeed import DeepSpeedEngine
from .deepspeed_plan import DeepSpeedCosts
from .engine import Engine, EngineOptions
from .fsdp_plan import FSDPCosts
from .layout import CostModel
from .megatron_settings import splits_model
from .meshes import Meshes
from .torch_backend import DDPEngine, FSDPEngine, MegatronEngine, SingleEngine
from .torch_plan import DDPCosts, MegatronCosts, SingleCosts
from .world import World, launch_world_size

AUTO = "auto"


@dataclass(frozen=True)
class EngineEntry:
    name: str
    cls: type[Engine]
    costs: type[CostModel]                   # what a layout costs on it (the planner's answers)
    accelerate_flag: str | None = None       # the variable an `accelerate launch` config sets to "true" for it
    selecting_key: str | None = None         # a config key that, when set, selects it under `engine: auto`
    layout_keys: tuple[str, ...] = ()        # config keys that lay the run out over processes for it
    split_costs: type[CostModel] | None = None  # its cost model where the config splits the model (tp or pp > 1)

    def for_layout(self, args) -> "EngineEntry":
        """This entry as the config lays the model out: with its `split_costs` where tensor or pipeline parallelism
        splits the model, or expert parallelism its experts and its own cost model does not model that."""
        experts = args.expert_parallel_degree > 1 and not self.costs.models_expert_parallel
        if self.split_costs is None or not (splits_model(args) or experts):
            return self
        return dataclasses.replace(self, costs=self.split_costs, split_costs=None)

    def __repr__(self) -> str:  # the planner prints layouts; the name is what a user wrote
        return self.name


ENGINES = (
    EngineEntry("single", SingleEngine, SingleCosts),
    EngineEntry("ddp", DDPEngine, DDPCosts, layout_keys=("plugin_args", "context_parallel_degree"),
                split_costs=MegatronCosts),
    EngineEntry("fsdp", FSDPEngine, FSDPCosts, "ACCELERATE_USE_FSDP",
                layout_keys=("plugin_args", "fsdp_shard_size", "context_parallel_degree", "expert_parallel_degree"),
                split_costs=MegatronCosts),
    EngineEntry("deepspeed", DeepSpeedEngine, DeepSpeedCosts, "ACCELERATE_USE_DEEPSPEED", selecting_key="deepspeed",
                layout_keys=("deepspeed",)),
    EngineEntry("megatron", MegatronEngine, MegatronCosts, "ACCELERATE_USE_MEGATRON_LM",
                layout_keys=("plugin_args", "fsdp_shard_size", "context_parallel_degree", "expert_parallel_degree")),
)
ONE_PROCESS, MANY_PROCESSES = ENGINES[0], ENGINES[1]  # what `engine: auto` takes when nothing else asks
BY_NAME = {entry.name: entry for entry in ENGINES}
NAMES = tuple(BY_NAME)


def engine_entry(name: str, key: str = "engine") -> EngineEntry:
    """The entry called `name`; an unknown name is a config error naming `key`."""
    entry = BY_NAME.get(name)
    if entry is None:
        hint = suggestion(str(name), (AUTO, *NAMES))
        raise key_error(key, f"{key} {name!r} is not an engine; use one of {AUTO}, {', '.join(NAMES)}{hint}")
    return entry


def launcher_engine() -> EngineEntry | None:
    """The engine an `accelerate launch` config asked for, if any."""
    return next((entry for entry in ENGINES if entry.accelerate_flag
                 and os.environ.get(entry.accelerate_flag, "false").lower() == "true"), None)


def select_engine(args, world_size: int | None = None) -> EngineEntry:
    """The engine for `args` on `world_size` processes (default: the launch's; the planner passes its own)."""
    planned = world_size is not None
    world_size = world_size if planned else launch_world_size()
    requested = launcher_engine()
    if args.engine == AUTO:
        chosen = requested or next((e for e in ENGINES if e.selecting_key and getattr(args, e.selecting_key)
                                    is not None), None) or (MANY_PROCESSES if world_size > 1 else ONE_PROCESS)
    else:
        chosen = engine_entry(args.engine)
        if requested and requested != chosen:
            raise ConfigError(f"key 'engine': the config asks for {chosen.name!r} but the launcher asked for "
                              f"{requested.name!r} ({requested.accelerate_flag}=true); make them agree or set "
                              "engine: auto")
    for entry in ENGINES:
        if entry.selecting_key and entry is not chosen and getattr(args, entry.selecting_key) is not None:
            raise ConfigError(f"key {entry.selecting_key!r} is set but the engine is {chosen.name!r}; remove one of "
                              "them")
    if chosen.cls.one_process and world_size > 1:
        started = f"{world_size} processes are planned" if planned else \
            f"the launch started {world_size} processes (WORLD_SIZE={world_size})"
        many = [e.name for e in ENGINES if not e.cls.one_process and not e.selecting_key][:2]
        raise ConfigError(f"engine: {chosen.name} runs one process, but {started}; use engine: {' or '.join(many)}, "
                          f"or {'--world-size 1' if planned else 'launch one process'}")
    return chosen.for_layout(args)


def single_process_layout(defaults: dict) -> list[str]:
    """The overrides that put a run on one process (`defaults`: each config key's default value), as `key=value`
    strings: the one-process engine, dp=1, and every engine's layout and own keys at their defaults."""
    keys = dict.fromkeys(key for entry in ENGINES for key in (*entry.layout_keys, *entry.cls.own_keys,
                                                              "accumulate_gradients"))
    return [f"engine={ONE_PROCESS.name}", "dp=1",
            *(f"{key}={'null' if defaults[key] is None else defaults[key]}" for key in keys)]


def create_engine(entry: EngineEntry, options: EngineOptions, world: World) -> Engine:
    """The engine of `entry`, built from its part of the resolved run on `world`, with the meshes its dims need."""
    return entry.cls(options, world, Meshes(options.dims, world.device.type))


def engines_that(capable, conjunction: str = "or") -> str:
    """The names of the engines whose class has a capability, for messages: `fsdp or megatron`."""
    names = [entry.name for entry in ENGINES if capable(entry.cls)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"
