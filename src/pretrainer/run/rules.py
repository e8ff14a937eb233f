"""Every rule between a key and the engine it depends on, in one table evaluated once while the run is resolved.

A row names the keys it governs, when they take effect on the chosen engine, what a value asks for (a key left at
its default or set to a neutral value asks for nothing and never trips a row), and why not. CANNOT rows are refused
whoever chose the engine; NO_EFFECT rows (the key belongs to another engine) are refused where the user chose it and a
warning under `engine: auto` (docs/engines.md, 'Keys of an engine not in use').

Rows read what engine classes declare (capabilities, `own_keys`), never names: the table holds any registered engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..config import ConfigError, key_error
from ..config.openmind import megatron_args
from ..parallel import EngineEntry
from ..parallel.registry import AUTO, ENGINES, engines_that, launcher_engine

logger = logging.getLogger("pretrainer")

CANNOT, NO_EFFECT = "cannot", "no effect"
# Megatron's layout keys, as plugin_args (P.) or other_megatron_args (M.) names them: those that split the model
# over ranks, switches, and settings that ask for something whenever they are there
MEGATRON = "plugin_args.other_megatron_args."
SPLITTING_KEYS = ("plugin_args.tp_degree", "plugin_args.pp_degree", f"{MEGATRON}tensor_model_parallel_size",
                  f"{MEGATRON}pipeline_model_parallel_size")
SWITCH_KEYS = ("plugin_args.sequence_parallelism", f"{MEGATRON}sequence_parallel")
# whole-model data ranks do as the engine's name says: asking otherwise (`no_shard`/false under fsdp too) has no effect
SHARDING_KEYS = ("plugin_args.use_distributed_optimizer", "plugin_args.data_parallel_sharding_strategy",
                 f"{MEGATRON}use_distributed_optimizer", f"{MEGATRON}data_parallel_sharding_strategy")
SETTING_KEYS = ("plugin_args.num_layers_per_virtual_pipeline_stage", "plugin_args.pipeline_layers",
                "plugin_args.pipeline_schedule",
                f"{MEGATRON}num_layers_per_virtual_pipeline_stage", f"{MEGATRON}recompute_granularity",
                f"{MEGATRON}recompute_method", f"{MEGATRON}recompute_num_layers")


@dataclass(frozen=True)
class Choice:
    """What a row is evaluated against: the chosen engine, its settings and the world it runs on."""
    args: object
    engine: EngineEntry
    settings: object
    world_size: int

    @property
    def cls(self):
        return self.engine.cls

    @property
    def pipeline_stages(self) -> int:
        return getattr(self.settings, "pp", 1)


@dataclass(frozen=True)
class Rule:
    key: str                                  # a top-level key, or plugin_args.NAME / ...other_megatron_args.NAME
    kind: str                                 # CANNOT | NO_EFFECT
    holds: Callable[[Choice], bool]           # whether the key takes effect on this choice
    why: Callable[[Choice], str]              # why not, naming what would make it take effect
    asks: Callable[[object], bool] = lambda value: True  # whether a value asks for anything at all


def _asks_for_more_than_one(value) -> bool:
    return not (value is None or value is False or (type(value) is int and value <= 1))


def _own_key_rule(key: str) -> Rule:
    def why(c: Choice) -> str:
        readers = engines_that(lambda cls: key in cls.own_keys)
        return (f"{key} is a setting of engine {readers}, not of engine {c.engine.name}, which the run uses; set "
                f"engine: {readers} to use it, or remove it")

    return Rule(key, NO_EFFECT, lambda c: key in c.cls.own_keys, why)


def _plugin_rule(name: str, kind: str, asks=_asks_for_more_than_one) -> Rule:
    def why(c: Choice) -> str:
        recompute = f" (recomputation here is activation_checkpointing={c.args.activation_checkpointing})" \
            if "recompute" in name else ""
        if c.cls.reads_plugin_layout:  # ddp or fsdp over a whole model: a split would read it
            return (f"{name} lays out a model split over ranks, which this engine {c.engine.name} run does not split "
                    f"(plugin_args.tp_degree and pp_degree are 1){recompute}; split it, or remove {name}")
        return (f"{name} lays out a model split over ranks, which engine {c.engine.name} does not do{recompute}; use "
                "engine megatron, ddp or fsdp and launch dp x tp x pp processes, or remove it")

    return Rule(name, kind, lambda c: c.cls.runs_stages(c.settings), why, asks)


def _sharding_rule(name: str) -> Rule:
    """Where stages run, the sharding switches are read; elsewhere a value holds where the engine's data ranks do
    what it asks anyway (fsdp: the strategy fsdp_reshard_after_forward gives; single and ddp: no_shard)."""
    def strategy(c: Choice) -> str:
        return getattr(c.settings, "sharding_strategy", None) or (
            "optim_grads" if c.cls.shards_gradients(c.settings) else "no_shard")

    def holds(c: Choice) -> bool:
        value = value_of(c.args, name)
        if name.endswith("strategy"):
            return c.cls.runs_stages(c.settings) or value == strategy(c)
        return c.cls.runs_stages(c.settings) or bool(value) == (strategy(c) != "no_shard")

    def why(c: Choice) -> str:
        return (f"{name}={value_of(c.args, name)!r} is not what engine {c.engine.name}'s data ranks do with a whole "
                f"model ({strategy(c)}, as the engine's name says; under fsdp fsdp_reshard_after_forward chooses "
                "between optim_grads_params and optim_grads); choose the engine that does it, split the model (tp or "
                "pp) for the switch to be read, or remove it")

    return Rule(name, NO_EFFECT, holds, why, lambda value: value is not None)


def _deepspeed_blocks(choice: Choice) -> list[str]:
    """The blocks of a DeepSpeed JSON that replace the run's optimizer groups or their lrs."""
    config = getattr(choice.settings, "config", None) or {}
    return [block for block in ("optimizer", "scheduler") if block in config]


RULES: tuple[Rule, ...] = (
    Rule("context_parallel_degree", CANNOT, lambda c: c.cls.supports_context_parallel and c.world_size > 1,
         lambda c: f"{c.args.context_parallel_degree} splits each sequence over ranks, which needs several processes "
                   f"and engine {engines_that(lambda k: k.supports_context_parallel)}", _asks_for_more_than_one),
    Rule("expert_parallel_degree", CANNOT, lambda c: c.cls.supports_expert_parallel,
         lambda c: f"engine {c.engine.name} holds every expert on every rank; use engine "
                   f"{engines_that(lambda k: k.supports_expert_parallel)} to split the experts over ranks, or "
                   "expert_parallel_degree: 1", _asks_for_more_than_one),
    Rule("optimizer", CANNOT, lambda c: c.cls.trains_muon,
         lambda c: f"optimizer: muon is not available with engine {c.engine.name}: {c.cls.muon_refusal} Use engine "
                   f"{engines_that(lambda k: k.trains_muon)}, which train Muon, or optimizer: adamw",
         lambda value: value == "muon"),
    *(Rule(key, CANNOT, lambda c: not c.cls.applies_every_update,
           lambda c, key=key: f"{key} is not available with engine {c.engine.name} ({c.engine.name} applies every "
                              f"update it is given); remove it or use engine "
                              f"{engines_that(lambda k: not k.applies_every_update)}")
      for key in ("loss_spike_factor", "spike_zscore")),
    Rule("batch_size_schedule", CANNOT, lambda c: not c.cls.applies_every_update and c.pipeline_stages == 1,
         lambda c: "batch_size_schedule is not available here: " + (
             f"engine {c.engine.name} fixes" if c.pipeline_stages == 1 else "a pipeline schedule (pp > 1) is built "
             "for") + " the number of micro-batches per step; use engine ddp, fsdp or megatron without pipeline "
             "parallelism, or remove it"),
    Rule("seq_length_schedule", CANNOT, lambda c: c.pipeline_stages == 1,
         lambda c: "seq_length_schedule is not available with pipeline parallelism (pp > 1): its schedule is built "
                   "for one window length; use engine megatron or fsdp without pp, or remove it"),
    Rule("seq_length_schedule", CANNOT, lambda c: not c.cls.applies_every_update,
         lambda c: f"seq_length_schedule: a stage names sequences, which changes the micro-batches per step, and "
                   f"engine {c.engine.name} fixes them; remove the stages' sequences (the tokens per update then stay "
                   "as configured) or use engine ddp, fsdp or megatron",
         lambda value: any(isinstance(stage, dict) and "sequences" in stage for stage in value or ())),
    Rule("fault_tolerance", CANNOT, lambda c: c.cls.checkpoint_format == "dcp",
         lambda c: f"fault_tolerance is not available with engine {c.engine.name} (its own state format, which a "
                   "healing replica group cannot receive); use engine ddp, fsdp or megatron, or remove it"),
    *(_plugin_rule(key, CANNOT) for key in SPLITTING_KEYS),
    *(_plugin_rule(key, NO_EFFECT) for key in SWITCH_KEYS),
    *(_sharding_rule(key) for key in SHARDING_KEYS),
    *(_plugin_rule(key, NO_EFFECT, lambda value: value is not None) for key in SETTING_KEYS),
    Rule("parametrization", CANNOT, lambda c: not _deepspeed_blocks(c),
         lambda c: f"parametrization: {c.args.parametrization} sets each parameter group's lr, but the DeepSpeed "
                   f"config's own {' and '.join(_deepspeed_blocks(c))} block ({c.settings.source}) "
                   + ("builds one group of every parameter" if "optimizer" in _deepspeed_blocks(c) else
                      "sets one lr for every group") + "; remove it (the run's AdamW and schedule take lr, betas, "
                   "eps, weight_decay and lr_decay_style from the config) or use parametrization: sp",
         lambda value: value != "sp"),
    Rule("accumulate_gradients", NO_EFFECT, lambda c: c.cls.shards_gradients(c.settings),
         lambda c: f"accumulate_gradients: {c.args.accumulate_gradients} is set but engine {c.engine.name} keeps "
                   f"whole gradients on every rank (nothing to shard); remove it, or use engine "
                   f"{engines_that(lambda k: k.can_shard_gradients)} (megatron with use_distributed_optimizer)",
         lambda value: value != "auto"),
    Rule("async_checkpoint", NO_EFFECT, lambda c: c.cls.supports_async_save,
         lambda c: f"async_checkpoint: engine {c.engine.name} writes its checkpoints synchronously (its own format); "
                   "remove it", lambda value: value is True),
    *(_own_key_rule(key) for key in dict.fromkeys(key for entry in ENGINES for key in entry.cls.own_keys)),
)


def value_of(args, key: str):
    """A row's key in the arguments: a top-level key, or a name inside plugin_args / its other_megatron_args."""
    if key.startswith(MEGATRON):
        return megatron_args(args.plugin_args).get(key.rsplit(".", 1)[1])
    if key.startswith("plugin_args."):
        return (args.plugin_args or {}).get(key.split(".", 1)[1])
    return getattr(args, key)


def set_by_user(args, key: str) -> bool:
    """Whether the user set `key` to something other than its default (a nested key: whether it is there)."""
    return key.split(".", 1)[0] in args.given_keys and ("." in key or getattr(args, key) != args.default_of(key))


def check_rules(args, entry: EngineEntry, settings, world_size: int, warn: bool = True) -> None:
    """Refuse (under `engine: auto`, warn of, where `warn`) every key the chosen engine cannot use or does not read."""
    choice = Choice(args, entry, settings, world_size)
    for rule in RULES:
        if not set_by_user(args, rule.key) or not rule.asks(value_of(args, rule.key)) or rule.holds(choice):
            continue
        chosen = args.engine != AUTO or launcher_engine() is not None  # the `engine` key or an accelerate config
        if rule.kind == CANNOT or chosen:
            top, why = rule.key.split(".", 1)[0], rule.why(choice)
            why += "" if chosen else f" (engine: auto chose {entry.name} for {world_size} process(es))"
            error = key_error(top, why) if "." not in rule.key else ConfigError(why)
            origin = args.origin_of(top)
            raise ConfigError(f"{origin}: {error}") if origin else error
        if warn:
            logger.warning("%s has no effect: engine: auto chose %s for %d process(es). %s", rule.key, entry.name,
                           world_size, rule.why(choice))
