"""The rule table (run/rules.py): a key of an engine not in use is refused where the user chose the engine, and warned
of once where `engine: auto` chose it; a layout an engine cannot give is refused either way. Resolved as `pretrainer
plan` resolves a world (no processes are started)."""

import pytest
import torch
import yaml

from pretrainer.config import ConfigError, PreTrainingArguments
from pretrainer.parallel import ENGINES, planned_world
from pretrainer.run import resolve_run

# Each engine-specific key, a value that asks for something, an engine that does not read it, and the world.
OWN_KEYS = [
    ("fsdp_reshard_after_forward", False, "ddp", 2),
    ("fsdp_cpu_offload", True, "ddp", 2),
    ("fsdp_cpu_offload", True, "megatron", 2),
    ("fsdp_shard_size", 1, "ddp", 2),
    ("distributed_timeout_minutes", 5.0, "single", 1),
]
PLUGIN_SETTINGS = [
    ({"sequence_parallelism": True}, "plugin_args.sequence_parallelism"),
    ({"pipeline_layers": [1, 1]}, "plugin_args.pipeline_layers"),
    ({"num_layers_per_virtual_pipeline_stage": 1}, "plugin_args.num_layers_per_virtual_pipeline_stage"),
    ({"other_megatron_args": {"recompute_granularity": "full"}},
     "plugin_args.other_megatron_args.recompute_granularity"),
    ({"other_megatron_args": {"recompute_method": "block"}}, "plugin_args.other_megatron_args.recompute_method"),
    ({"other_megatron_args": {"recompute_num_layers": 1}}, "plugin_args.other_megatron_args.recompute_num_layers"),
    ({"other_megatron_args": {"sequence_parallel": True}}, "plugin_args.other_megatron_args.sequence_parallel"),
]


def resolve(config: dict, world: int, **keys):
    args = PreTrainingArguments(**{**config, "dp": world, **keys})
    return resolve_run(args, planned_world(world, world, torch.device("cpu")))


def test_every_engine_specific_key_is_tested():
    owned = {key for entry in ENGINES for key in entry.cls.own_keys} - {"deepspeed"}  # selects its engine
    assert owned == {key for key, *_ in OWN_KEYS}


@pytest.mark.parametrize("key, value, engine, world", OWN_KEYS)
def test_a_key_of_another_engine_is_refused_where_the_engine_was_chosen(base_config, key, value, engine, world):
    with pytest.raises(ConfigError, match=rf"key '{key}': {key} is a setting of engine .*, not of engine {engine}, "
                                          rf"which the run uses; set engine: .* to use it, or remove it"):
        resolve(base_config, world, engine=engine, **{key: value})


@pytest.mark.parametrize("key, value, engine, world", [case for case in OWN_KEYS if case[2] != "megatron"])
def test_a_key_of_another_engine_is_warned_of_once_where_auto_chose(base_config, key, value, engine, world, caplog):
    with caplog.at_level("WARNING", logger="pretrainer"):
        run = resolve(base_config, world, **{key: value})
    assert run.engine.name == engine
    lines = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"{key} has no effect: engine: auto chose {engine} for {world} "
                                                   "process(es)"), lines


def test_a_key_at_its_default_or_read_by_the_engine_passes(base_config, caplog):
    with caplog.at_level("WARNING", logger="pretrainer"):
        resolve(base_config, 2, engine="ddp", fsdp_cpu_offload=False, distributed_timeout_minutes=5.0)
        resolve(base_config, 2, engine="fsdp", fsdp_cpu_offload=True, fsdp_shard_size=2)
    assert "has no effect" not in caplog.text


@pytest.mark.parametrize("plugin, key", PLUGIN_SETTINGS)
def test_a_megatron_setting_in_plugin_args_is_refused_where_nothing_splits_the_model(base_config, plugin, key, caplog):
    with pytest.raises(ConfigError, match=rf"^{key} lays out a model split over ranks, which this engine fsdp run "
                                          rf"does not split \(plugin_args.tp_degree and pp_degree are 1\)"):
        resolve(base_config, 2, engine="fsdp", plugin_args=plugin)
    with pytest.raises(ConfigError, match=rf"^{key} lays out a model split over ranks, which engine single does not "
                                          "do"):
        resolve(base_config, 1, engine="single", plugin_args=plugin)
    with caplog.at_level("WARNING", logger="pretrainer"):
        resolve(base_config, 2, plugin_args=plugin)
    assert f"{key} has no effect: engine: auto chose ddp for 2 process(es)" in caplog.text


@pytest.mark.parametrize("engine, world, plugin, refused", [
    ("fsdp", 2, {"data_parallel_sharding_strategy": "optim_grads_params"}, False),  # what fsdp does anyway
    ("fsdp", 2, {"use_distributed_optimizer": True}, False),
    ("fsdp", 2, {"data_parallel_sharding_strategy": "optim_grads"}, True),  # fsdp_reshard_after_forward says
    ("fsdp", 2, {"data_parallel_sharding_strategy": "no_shard"}, True),
    ("fsdp", 2, {"other_megatron_args": {"use_distributed_optimizer": False}}, True),
    ("single", 1, {"use_distributed_optimizer": False}, False),  # the seed's megatron YAML, run on one process
    ("single", 1, {"use_distributed_optimizer": True}, True),
    ("ddp", 2, {"data_parallel_sharding_strategy": "no_shard"}, False),
    ("ddp", 2, {"data_parallel_sharding_strategy": "optim_grads"}, True),
])
def test_a_sharding_switch_on_a_whole_model_holds_only_where_the_engine_does_what_it_asks(base_config, engine, world,
                                                                                          plugin, refused, caplog):
    """A whole model's data ranks do what the engine's name says: a sharding switch that agrees passes, one that
    asks otherwise (no_shard under fsdp too) is refused where the user chose the engine, warned of under auto."""
    key = next(f"plugin_args.{k}" if k != "other_megatron_args" else f"plugin_args.{k}.{next(iter(v))}"
               for k, v in plugin.items())
    if not refused:
        with caplog.at_level("WARNING", logger="pretrainer"):
            resolve(base_config, world, engine=engine, plugin_args=plugin)
        assert "has no effect" not in caplog.text
        return
    with pytest.raises(ConfigError, match=rf"^{key}=.* is not what engine {engine}'s data ranks do with a whole "
                                          rf"model \((no_shard|optim_grads_params), as the engine's name says"):
        resolve(base_config, world, engine=engine, plugin_args=plugin)
    if engine == "ddp":
        with caplog.at_level("WARNING", logger="pretrainer"):
            resolve(base_config, world, plugin_args=plugin)
        assert f"{key} has no effect: engine: auto chose ddp" in caplog.text


@pytest.mark.parametrize("keys", [{"plugin_args": {"tp_degree": 2}}, {"engine": "ddp", "plugin_args": {"pp_degree": 2}},
                                  {"plugin_args": {"other_megatron_args": {"tensor_model_parallel_size": 2}}},
                                  {"engine": "fsdp", "plugin_args": {"tp_degree": 2}}])
def test_every_engine_name_splits_the_model_as_the_config_asks(base_config, keys):
    """The names are defaults of one backend: ddp (the data ranks replicate the stages) and fsdp (they shard them,
    resharding after forward) lay a split model out as megatron does; nothing is refused or dropped."""
    run = resolve(base_config, 2, dp=1, **keys)
    assert run.dims.tp * run.dims.pp == 2 and run.engine.cls.reads_plugin_layout
    assert run.engine.name == keys.get("engine", "ddp")
    assert run.options.settings.sharding_strategy == ("optim_grads_params" if run.engine.name == "fsdp" else "no_shard")
    off = resolve(base_config, 2, dp=1, engine="fsdp", fsdp_reshard_after_forward=False, plugin_args={"tp_degree": 2})
    assert off.options.settings.sharding_strategy == "optim_grads"
    with pytest.raises(ConfigError, match="fsdp_cpu_offload is not available with engine fsdp splitting the model"):
        resolve(base_config, 2, dp=1, engine="fsdp", fsdp_cpu_offload=True, plugin_args={"tp_degree": 2})


@pytest.mark.parametrize("keys, world, message", [
    ({"plugin_args": {"tp_degree": 2}}, 1, "plugin_args.tp_degree lays out a model split over ranks"),
    ({"plugin_args": {"pp_degree": 2}, "engine": "single"}, 1, "plugin_args.pp_degree lays out a model split"),
    ({"context_parallel_degree": 2}, 1, "key 'context_parallel_degree': 2 splits each sequence over ranks, which "
                                        "needs several processes and engine ddp, fsdp or megatron"),
    ({"context_parallel_degree": 2, "engine": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 1}}}, 2,
     "needs several processes and engine ddp, fsdp or megatron"),
    ({"optimizer": "muon", "deepspeed": {"zero_optimization": {"stage": 1}}}, 2,
     "key 'optimizer': optimizer: muon is not available with engine deepspeed"),
    ({"spike_zscore": 6.0, "deepspeed": {"zero_optimization": {"stage": 1}}}, 2,
     "key 'spike_zscore': spike_zscore is not available with engine deepspeed"),
    ({"batch_size_schedule": [[0, 4], [64, 8]], "gradient_accumulation_steps": 4, "engine": "megatron",
      "plugin_args": {"pp_degree": 2}}, 2, "a pipeline schedule \\(pp > 1\\) is built for the number of "
                                           "micro-batches"),
])
def test_a_layout_the_engine_cannot_give_is_refused_whoever_chose_it(base_config, keys, world, message):
    pytest.importorskip("deepspeed") if "deepspeed" in keys else None
    with pytest.raises(ConfigError, match=message):
        resolve(base_config, world, **keys)


@pytest.mark.parametrize("keys, message", [
    ({"plugin_args": {"tp_degree": 0}}, "plugin_args.tp_degree must be a whole number >= 1, got 0"),
    ({"plugin_args": {"other_megatron_args": {"pipeline_model_parallel_size": 2.5}}},
     "plugin_args.other_megatron_args.pipeline_model_parallel_size must be a whole number >= 1, got 2.5"),
])
def test_a_degree_that_is_no_whole_number_is_refused_on_every_engine(base_config, keys, message):
    with pytest.raises(ConfigError, match=message):
        PreTrainingArguments(**{**base_config, **keys})


def test_keys_set_inside_plugin_args_or_without_a_pipeline_are_held_to_the_same_rules(base_config):
    with pytest.raises(ConfigError, match="key 'distributed_timeout_minutes': distributed_timeout_minutes is a "
                                          "setting of engine ddp, fsdp, deepspeed or megatron, not of engine single"):
        resolve(base_config, 1, engine="single",
                plugin_args={"other_megatron_args": {"distributed_timeout_minutes": 5}})
    with pytest.raises(ConfigError, match="plugin_args.pipeline_layers cuts the model into pipeline stages and needs "
                                          "pp_degree > 1"):
        resolve(base_config, 1, engine="megatron", plugin_args={"pipeline_layers": [1, 1]})
    with pytest.raises(ConfigError, match="^plugin_args.pipeline_schedule lays out a model split over ranks, which "
                                          "engine single does not do"):
        resolve(base_config, 1, engine="single", plugin_args={"pipeline_schedule": "gpipe"})


def test_accumulate_gradients_where_gradients_are_whole(base_config, caplog):
    with pytest.raises(ConfigError, match="key 'accumulate_gradients': accumulate_gradients: sharded is set but "
                                          "engine ddp keeps whole gradients"):
        resolve(base_config, 2, engine="ddp", accumulate_gradients="sharded")
    with caplog.at_level("WARNING", logger="pretrainer"):
        assert resolve(base_config, 1, accumulate_gradients="sharded").options.accumulate == "unsharded"
    assert "accumulate_gradients has no effect: engine: auto chose single for 1 process(es)" in caplog.text


def test_the_refusal_names_the_file_and_line_or_the_override(base_config, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**base_config, "dp": 2, "engine": "ddp"}, sort_keys=False)
                    + "fsdp_cpu_offload: true\n")
    line = len(path.read_text().splitlines())
    world = planned_world(2, 2, torch.device("cpu"))
    with pytest.raises(ConfigError, match=rf"^{path}, line {line}: key 'fsdp_cpu_offload': "):
        resolve_run(PreTrainingArguments.from_yaml(path), world)
    with pytest.raises(ConfigError, match=rf"^{path}, override fsdp_reshard_after_forward=\.\.\.: "):
        resolve_run(PreTrainingArguments.from_yaml(path, ["fsdp_cpu_offload=false",
                                                          "fsdp_reshard_after_forward=false"]), world)
