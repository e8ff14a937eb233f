"""A Megatron layout in `plugin_args` (the seed's YAMLs carry one) on an engine that does not read it: refused
where `engine: auto` would otherwise drop it without a word, named where the config chose the engine itself."""

from __future__ import annotations

import logging

from ..config import ConfigError
from ..config.openmind import megatron_args
from ..parallel import EngineEntry
from ..parallel.registry import AUTO, engines_that

logger = logging.getLogger("pretrainer")

SPLITTING_KEYS = ("tp_degree", "pp_degree")
SETTING_KEYS = ("sequence_parallelism", "num_layers_per_virtual_pipeline_stage", "pipeline_layers",
                "use_distributed_optimizer", "data_parallel_sharding_strategy")
RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def check_plugin_layout(args, entry: EngineEntry, world_size: int) -> None:
    if entry.cls.reads_plugin_layout:
        return
    plugin = args.plugin_args or {}
    readers = engines_that(lambda c: c.reads_plugin_layout)
    splits = [f"plugin_args.{key}={plugin[key]}" for key in SPLITTING_KEYS if int(plugin.get(key) or 1) > 1]
    if splits and args.engine == AUTO:
        verb = "splits" if len(splits) == 1 else "split"
        raise ConfigError(f"{' and '.join(splits)} {verb} the model over ranks, which only engine {readers} does, but "
                          f"engine: auto picked {entry.name} for {world_size} process(es); set engine: {readers} "
                          "(accelerate's Megatron config does) and launch dp x tp x pp processes, or set "
                          f"{' and '.join(s.split('=')[0] + '=1' for s in splits)} to train without the split")
    unused = splits + [f"plugin_args.{key}" for key in SETTING_KEYS if _set(plugin.get(key))]
    unused += [f"plugin_args.other_megatron_args.{key}" for key in RECOMPUTE_KEYS if key in megatron_args(plugin)]
    if unused:
        logger.warning("%s: settings of engine %s, unused by engine %s (recomputation here is "
                       "activation_checkpointing=%s)", ", ".join(unused), readers, entry.name,
                       args.activation_checkpointing)


def _set(value) -> bool:
    """A setting that asks for something (not unset, off, 1, or `no_shard`)."""
    if value is None or value is False or value == "no_shard":
        return False
    return not (type(value) is int and value <= 1)
