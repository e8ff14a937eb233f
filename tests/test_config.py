"""PreTrainingArguments: the seed's YAML files and API, native keys, overrides and clear errors."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
import yaml

from helpers import EXAMPLES
from launch import REPO
from pretrainer import ConfigError, PreTrainingArguments

SEEDS = EXAMPLES / "seed_configs"


def write(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_seed_deepspeed_yaml_loads_with_seed_values():
    args = PreTrainingArguments.from_yaml(SEEDS / "llama2-deepspeed.yaml")
    assert (args.num_training_steps, args.micro_batch_size, args.dp,
            args.gradient_accumulation_steps) == (1000, 1, 8, 8)
    assert args.seq_length == 4096 and args.megatron_dataset_flag is False
    assert args.batch_size == 1 * 8 * 8
    assert args.dtype == "bf16" and args.get_mixed_precision() == "bf16" and args.get_torch_dtype() is torch.bfloat16
    assert args.get_dataloader_config() == {"return_tensors": "pt", "padding": "max_length",
                                            "pad_to_multiple_of": 4096, "max_length": 4096}
    assert args.resolved_train_data == ["examples/data/python_topics_alpaca.json"]
    assert args.save_interval == 10000 and args.eval_interval == 10000


def test_seed_megatron_json_yaml_anchors_and_scientific_strings():
    args = PreTrainingArguments.from_yaml(SEEDS / "llama2-megatron-json-dataset.yaml")
    assert args.micro_batch_size == 4 and args.batch_size == 4 * 8 * 1
    plugin = args.get_distributed_train_args()
    assert plugin["num_micro_batches"] == 8  # the anchor *gradient_accumulation_steps
    other = plugin["other_megatron_args"]
    assert other["lr"] == 1e-5 and isinstance(other["lr"], float)  # "1e-5" read as a string by YAML, coerced
    assert other["min_lr"] == 1e-6
    assert args.get_dataloader_config()["pad_to_multiple_of"] == 4096
    # other_megatron_args values are honoured by this run, not ignored.
    assert args.lr == 1e-5 and args.min_lr == 1e-6 and args.lr_decay_style == "cosine"
    assert args.warmup_fraction == 0.01 and args.weight_decay == 0.1 and args.adam_beta2 == 0.95
    assert args.init_method_std == 0.01 and args.clip_grad == 1.0 and args.eval_iters == 10


def test_seed_megatron_yaml_loads():
    args = PreTrainingArguments.from_yaml(SEEDS / "llama2-megatron.yaml")
    assert args.megatron_dataset_flag is True
    assert args.get_dataloader_config()["data_path"] == ["runs/data/python_docs_text_document"]
    assert args.resolved_train_data == []  # Megatron prefixes are not JSON files


def test_update_distributed_train_args_adds_hooks():
    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1)
    hook = lambda *a: None  # noqa: E731
    args.update_distributed_train_args(extra_args={"custom_loss_function": hook})
    assert args.get_distributed_train_args()["custom_loss_function"] is hook
    assert "custom_loss_function" not in args.to_yaml()


def test_scientific_coercion_is_recursive_and_needs_an_exponent(tmp_path):
    path = write(tmp_path, """
        num_training_steps: 1
        micro_batch_size: 1
        dp: 1
        lr: 3e-4
        plugin_args: {other_megatron_args: {a: {b: 2E-3}, c: ["1e2", "0.5"]}}
    """)
    args = PreTrainingArguments.from_yaml(path)
    assert args.lr == 3e-4
    assert args.megatron_args["a"]["b"] == 2e-3
    assert args.megatron_args["c"] == [100.0, "0.5"]


@pytest.mark.parametrize("missing", ["num_training_steps", "micro_batch_size", "dp"])
def test_required_fields(tmp_path, missing):
    values = {"num_training_steps": 1, "micro_batch_size": 1, "dp": 1}
    del values[missing]
    path = write(tmp_path, "\n".join(f"{k}: {v}" for k, v in values.items()))
    with pytest.raises(ConfigError, match=missing):
        PreTrainingArguments.from_yaml(path)


def test_unknown_key_names_line_and_closest_key(tmp_path):
    path = write(tmp_path, "num_training_steps: 1\nmicro_batch_size: 1\ndp: 1\nmicro_bach_size: 2\n")
    with pytest.raises(ValueError) as info:
        PreTrainingArguments.from_yaml(path)
    message = str(info.value)
    assert "line 4" in message and "'micro_bach_size'" in message and "did you mean 'micro_batch_size'" in message


def test_data_path_needs_megatron_dataset_flag(tmp_path):
    path = write(tmp_path, "num_training_steps: 1\nmicro_batch_size: 1\ndp: 1\ndata_path: x.json\n")
    with pytest.raises(ConfigError, match="megatron_dataset_flag"):
        PreTrainingArguments.from_yaml(path)


def test_wrong_type_names_key_and_line(tmp_path):
    path = write(tmp_path, "num_training_steps: 1\nmicro_batch_size: four\ndp: 1\n")
    with pytest.raises(ConfigError, match=r"line 2: key 'micro_batch_size': expected an integer, got 'four'"):
        PreTrainingArguments.from_yaml(path)


def test_export_max_shard_size_takes_save_pretrained_sizes(tmp_path):
    for good in ("5GB", "500 MB", "0.5gb", 1_000_000):
        PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, export_max_shard_size=good)
    path = write(tmp_path, "num_training_steps: 1\nmicro_batch_size: 1\ndp: 1\nexport_max_shard_size: 5GiB\n")
    with pytest.raises(ConfigError, match=r"line 4: key 'export_max_shard_size'.*KB, MB, GB or TB"):
        PreTrainingArguments.from_yaml(path)
    with pytest.raises(ConfigError, match="export_max_shard_size"):
        PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, export_max_shard_size=0)


def test_bad_dtype_and_decay_style():
    with pytest.raises(ConfigError, match="Unknown dtype"):
        PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, dtype="fp8")
    with pytest.raises(ConfigError, match="lr_decay_style"):
        PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, lr_decay_style="inverse-square-root")
    assert PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, dtype="BF16").dtype == "bf16"


def test_native_value_conflicting_with_other_megatron_args():
    with pytest.raises(ConfigError, match="conflicts with plugin_args.other_megatron_args.lr"):
        PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, lr=1e-3,
                             plugin_args={"other_megatron_args": {"lr": 1e-5}})
    # a key given at its default value is a conflict too, named with where it was given
    config = {"num_training_steps": 1, "micro_batch_size": 1, "dp": 1,
              "plugin_args": {"other_megatron_args": {"expert_model_parallel_size": 2}}}
    with pytest.raises(ConfigError, match="line 1: key 'expert_parallel_degree': expert_parallel_degree=1 conflicts "
                                          "with plugin_args.other_megatron_args.expert_model_parallel_size=2"):
        PreTrainingArguments.from_dict({"expert_parallel_degree": 1, **config}, source="c.yaml",
                                       key_lines={"expert_parallel_degree": 1})
    assert PreTrainingArguments.from_dict(config).expert_parallel_degree == 2  # not given: the Megatron value


def test_overrides_apply_after_yaml_with_dotted_keys():
    args = PreTrainingArguments.from_yaml(
        SEEDS / "llama2-megatron-json-dataset.yaml",
        ["dp=2", "plugin_args.other_megatron_args.min_lr=2e-6", "dataloader_config.max_length=128"])
    assert args.dp == 2 and args.batch_size == 4 * 8 * 2
    assert args.min_lr == 2e-6
    assert args.get_dataloader_config()["max_length"] == 128


def test_override_errors():
    with pytest.raises(ConfigError, match="did you mean 'save_interval'"):
        PreTrainingArguments.from_yaml(SEEDS / "llama2-deepspeed.yaml", ["save_intervall=3"])
    with pytest.raises(ConfigError, match="key=value"):
        PreTrainingArguments.from_yaml(SEEDS / "llama2-deepspeed.yaml", ["dp"])


def test_dp_checked_against_world_size_not_at_parse_time():
    from pretrainer.config import ParallelDims

    args = PreTrainingArguments.from_yaml(SEEDS / "llama2-deepspeed.yaml")  # dp: 8 loads anywhere
    with pytest.raises(ConfigError, match=r"dp=8 does not match the launch: 1 process\(es\) gives dp=1"):
        ParallelDims(1).check_claimed_dp(args.dp)
    ParallelDims(8).check_claimed_dp(args.dp)
    with pytest.raises(ConfigError, match=r"dp=8 does not match the launch: 8 process\(es\) / tp x pp x cp = 4 "
                                          r"gives dp=2"):
        ParallelDims(8, tp=2, pp=2).check_claimed_dp(args.dp)


def test_parallel_dims_split_the_world_one_way():
    from pretrainer.config import ParallelDims

    dims = ParallelDims(16, tp=2, pp=2, cp=2, shard=2)
    assert (dims.replica_ranks, dims.dp, dims.gradient_ranks, dims.shard, dims.replicate) == (8, 2, 4, 2, 2)
    assert dims.vocab_multiple == 2 and "tp=2 pp=2 cp=2" in dims.describe()
    with pytest.raises(ConfigError, match=r"6 process\(es\) cannot be split into groups of tp=4 x pp=1"):
        ParallelDims(6, tp=4)
    with pytest.raises(ConfigError, match="cannot be sharded in groups of 3"):
        ParallelDims(4, shard=3)


def test_missing_config_file_and_none():
    with pytest.raises(ConfigError, match="does not exist"):
        PreTrainingArguments.from_yaml("nope.yaml")
    with pytest.raises(ConfigError, match="no config file"):
        PreTrainingArguments.from_yaml(None)


def test_warmup_and_lr_validation():
    with pytest.raises(ConfigError, match="set one of warmup_steps, warmup_fraction and warmup_tokens, not "
                                          "warmup_steps and warmup_fraction"):
        PreTrainingArguments(num_training_steps=10, micro_batch_size=1, dp=1, warmup_steps=1, warmup_fraction=0.1)
    with pytest.raises(ConfigError, match="longer than num_training_steps \\(10\\); give fewer warmup_steps, or "
                                          "warmup_fraction"):
        PreTrainingArguments(num_training_steps=10, micro_batch_size=1, dp=1, warmup_steps=11)
    # a short run of a shipped example says how to shorten its warmup too
    with pytest.raises(ConfigError, match=r"quickstart.yaml, line \d+: key 'warmup_steps': warmup \(30 steps\) is "
                                          "longer than num_training_steps \\(2\\); give fewer warmup_steps"):
        PreTrainingArguments.from_yaml(EXAMPLES / "quickstart.yaml", ["num_training_steps=2"])
    assert PreTrainingArguments.from_yaml(EXAMPLES / "quickstart.yaml", ["num_training_steps=2", "warmup_steps=1"])
    args = PreTrainingArguments(num_training_steps=200, micro_batch_size=1, dp=1, warmup_fraction=0.05)
    assert args.warmup_steps_resolved() == 10


def test_batch_sizes_derive_each_value_once():
    from transformers import LlamaConfig

    from pretrainer.config import BatchSizes, resolve_seq_length

    model_config = LlamaConfig(max_position_embeddings=256)
    args = PreTrainingArguments(num_training_steps=10, micro_batch_size=3, dp=2, gradient_accumulation_steps=4,
                                eval_iters=5, dtype="fp32")
    sizes = BatchSizes.of(args, resolve_seq_length(args.seq_length, model_config, "config.json"), 2)
    assert sizes.seq_length == 256  # unset: the model's max_position_embeddings
    assert sizes.data_parallel_size == 2 and sizes.global_batch_size == 3 * 4 * 2 == args.batch_size
    assert sizes.train_samples == 10 * 24 and sizes.eval_samples == 5 * 3 * 2
    assert resolve_seq_length(64, model_config, "c") == 64
    with pytest.raises(ConfigError, match=r"key 'seq_length': 512 exceeds the model's max_position_embeddings "
                                          r"\(256, config.json\)"):
        resolve_seq_length(512, model_config, "config.json")
    with pytest.raises(ConfigError, match="seq_length is not set and the model config has no"):
        resolve_seq_length(None, None, "no model")


def test_dtype_table_round_trips():
    from pretrainer.config import DTYPES, dtype_name, torch_dtype

    assert [dtype_name(torch_dtype(name)) for name in DTYPES] == list(DTYPES)
    assert torch_dtype("bf16") is torch.bfloat16 and dtype_name(torch.int8) == "torch.int8"


@pytest.mark.parametrize("key,value,message", [
    ("num_workers", -1, "num_workers must be >= 0"), ("weight_decay", -0.1, "weight_decay must be >= 0"),
    ("adam_eps", -1e-8, "adam_eps must be >= 0"), ("clip_grad", -1.0, "clip_grad must be >= 0"),
    ("fsdp_shard_size", 0, "fsdp_shard_size must be >= 1"), ("init_method_std", 0.0, "init_method_std must be > 0"),
    ("peak_tflops", -5.0, "peak_tflops must be > 0")])
def test_values_torch_would_refuse_deep_inside_are_config_errors(tmp_path, key, value, message):
    path = write(tmp_path, f"num_training_steps: 1\nmicro_batch_size: 1\ndp: 1\n{key}: {value}\n")
    with pytest.raises(ConfigError, match=f"c.yaml, line 4: key '{key}': {message}"):
        PreTrainingArguments.from_yaml(path)


def test_a_device_this_machine_lacks_is_a_config_error():
    from pretrainer.run import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ConfigError, match="key 'device': 'cuda', but this machine has no accelerator"):
        resolve_device("cuda")
    assert resolve_device("cpu").type == "cpu"


def test_seed_style_keys_for_long_contexts_and_vocabularies_reach_the_native_ones():
    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, plugin_args={
        "cp_degree": 2, "other_megatron_args": {"make_vocab_size_divisible_by": 128}})
    assert args.context_parallel_degree == 2 and args.pad_vocab_to_multiple_of == 128
    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1,
                                plugin_args={"other_megatron_args": {"context_parallel_size": 4}})
    assert args.context_parallel_degree == 4
    with pytest.raises(ConfigError, match="context_parallel_degree=2 conflicts with plugin_args.other_megatron_args"):
        PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, context_parallel_degree=2,
                             plugin_args={"other_megatron_args": {"context_parallel_size": 4}})


def test_every_key_is_documented_in_the_configuration_page():
    import dataclasses

    page = (EXAMPLES.parent / "docs" / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(PreTrainingArguments) if f"`{f.name}`" not in page]
    assert not missing, f"keys without a row in docs/configuration.md: {missing}"


def test_a_key_given_twice_is_refused_naming_both_places(tmp_path):
    path = write(tmp_path, "num_training_steps: 1\nmicro_batch_size: 1\ndp: 1\nlr: 1.0e-3\nlr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=r"line 5: key 'lr' is given twice \(first on line 4\); keep one"):
        PreTrainingArguments.from_yaml(path)
    nested = write(tmp_path, "num_training_steps: 1\nmicro_batch_size: 1\ndp: 1\nplugin_args:\n  tp_degree: 2\n"
                             "  tp_degree: 4\n")
    with pytest.raises(ConfigError, match="line 6: key 'tp_degree' is given twice"):
        PreTrainingArguments.from_yaml(nested)
    fine = write(tmp_path, "num_training_steps: 1\nmicro_batch_size: 1\ndp: 1\n")
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice on the command line \('lr=1e-3' and 'lr=2e-3'\)"):
        PreTrainingArguments.from_yaml(fine, ["lr=1e-3", "lr=2e-3"])
    assert PreTrainingArguments.from_yaml(fine, ["lr=2e-3"]).lr == 2e-3


@pytest.mark.parametrize("key, value", [("muon_lr", 0.02), ("muon_ns_steps", 3), ("muon_params", ["lm_head.*"]),
                                        ("adamw_params", ["*.mlp.*"])])
def test_muon_keys_are_refused_when_the_optimizer_is_not_muon(key, value):
    base = {"num_training_steps": 1, "micro_batch_size": 1, "dp": 1, key: value}
    with pytest.raises(ConfigError, match=rf"key '{key}': {key} is set but optimizer is 'adamw', so it has no "
                                          rf"effect \(a setting of the Muon optimizer\); set optimizer: muon, or "
                                          rf"remove {key}"):
        PreTrainingArguments(**base)
    assert getattr(PreTrainingArguments(**base, optimizer="muon"), key) == value


# (key, a value that asks for something, the switch that turns its feature on): every row of config/features.py
FEATURE_KEYS = [
    ("muon_lr", 0.02, {"optimizer": "muon"}), ("muon_momentum", 0.9, {"optimizer": "muon"}),
    ("muon_nesterov", False, {"optimizer": "muon"}), ("muon_ns_steps", 3, {"optimizer": "muon"}),
    ("muon_adjust_lr", "spectral", {"optimizer": "muon"}), ("muon_ns_dtype", "fp32", {"optimizer": "muon"}),
    ("muon_params", ["lm_head.*"], {"optimizer": "muon"}), ("adamw_params", ["*.mlp.*"], {"optimizer": "muon"}),
    ("wsd_decay_fraction", 0.1, {"lr_decay_style": "wsd"}), ("wsd_decay_tokens", 100, {"lr_decay_style": "wsd"}),
    ("wsd_decay_shape", "cosine", {"lr_decay_style": "wsd"}), ("spike_window", 64, {"spike_zscore": 6.0}),
    ("staging_dir", "/tmp/staging", {"save_dir": "s3://bucket/run"}),
    ("checkpoint_failure", "warn", {"save_dir": "s3://bucket/run"}),
    ("mtp_loss_coeff", 0.3, {"mtp_num_layers": 1}),
    ("moe_token_drop_policy", "position", {"moe_capacity_factor": 1.25}),
    ("mup_base_hidden_size", 128, {"parametrization": "mup"}),
    ("mup_base_head_dim", 32, {"parametrization": "mup", "mup_base_hidden_size": 128}),
    ("mup_base_num_layers", 2, {"parametrization": "completep", "mup_base_hidden_size": 128}),
]


def test_every_feature_key_is_tested():
    from pretrainer.config.features import FEATURES

    assert {key for feature in FEATURES for key in feature.keys} == {key for key, *_ in FEATURE_KEYS}


@pytest.mark.parametrize("key, value, switch", FEATURE_KEYS)
def test_a_key_of_a_feature_that_is_off_is_refused_naming_its_switch(tmp_path, key, value, switch):
    base = {"num_training_steps": 10, "micro_batch_size": 1, "dp": 1}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**base, key: value}))
    name = next(iter(switch))
    with pytest.raises(ConfigError, match=rf"c.yaml, line \d+: key '{key}': {key} is set but {name} is .*, so it "
                                          rf"has no effect \(.*\); (set|give) .*, or remove {key}"):
        PreTrainingArguments.from_yaml(config)
    assert getattr(PreTrainingArguments(**base, **switch, **{key: value}), key) == value
    assert getattr(PreTrainingArguments(**base), key) == PreTrainingArguments(**base).default_of(key)


@pytest.mark.parametrize("key, value, index", [("train_data", [["a.jsonl", "b.jsonl"]], 0),
                                               ("eval_data", ["a.jsonl", {"path": "b"}], 1),
                                               ("data_path", ["0.3", "prefix", True], 2)])
def test_every_item_of_a_file_list_is_checked(key, value, index):
    flag = {"megatron_dataset_flag": True} if key == "data_path" else {}
    with pytest.raises(ConfigError, match=rf"key '{key}': {key}\[{index}\] is .* each item is a path"):
        PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, **{key: value}, **flag)


def test_a_plugin_args_typo_is_refused_with_the_nearest_name():
    with pytest.raises(ConfigError, match="plugin_args.tp_degre is neither a setting of the megatron engine nor a "
                                          "field of accelerate's MegatronLMPlugin; did you mean 'tp_degree'"):
        PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, plugin_args={"tp_degre": 2})
    # MegatronLMPlugin's own fields pass (reported as ignored by the engine, with the reason)
    assert PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1,
                                plugin_args={"use_rotary_position_embeddings": True}).plugin_args


def test_an_unknown_engine_is_refused_by_the_registry_with_the_nearest_name():
    from pretrainer.parallel import ENGINES, select_engine

    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, engine="fdsp")
    with pytest.raises(ConfigError, match="key 'engine': engine 'fdsp' is not an engine; use one of auto, single, "
                                          "ddp, fsdp, deepspeed, megatron; did you mean 'fsdp'"):
        select_engine(args, 1)
    shouted = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, engine="FSDP")
    with pytest.raises(ConfigError, match="engine 'FSDP' is not an engine; .*; did you mean 'fsdp'"):
        select_engine(shouted, 1)
    assert [entry.name for entry in ENGINES] == ["single", "ddp", "fsdp", "deepspeed", "megatron"]


@pytest.mark.parametrize("keys, named", [
    ({"staging_dir": "s3://bucket/staging"}, "staging_dir"),
    ({"tokenizer_path": "gs://bucket/tokenizer"}, "tokenizer_path"),
    ({"data_cache_path": "az://container/cache"}, "data_cache_path"),
    ({"model_path": "s3://bucket/llama"}, "model_path"),
])
def test_an_object_storage_url_is_refused_naming_the_key(keys, named):
    """Read as a path, `s3://bucket/run` would be a local folder `s3:/bucket/run`: the run's checkpoints would
    stay on the node's disk. The key is named, with the way out (a mount); a run's folders, data and task
    files take URLs."""
    with pytest.raises(ConfigError, match=rf"key '{named}': .* is a URL \((s3|gs|az)://\); object storage is read "
                                          r"for a run's data, tasks and folders \(save_dir, resume, cooldown_from\), "
                                          r"not here: give a local path, or mount"):
        PreTrainingArguments(**{"num_training_steps": 1, "micro_batch_size": 1, "dp": 1, **keys})


def test_the_shipped_json_schema_is_current_and_takes_every_shipped_config_and_refuses_bad_ones():
    """docs/config.schema.json is what scripts/build_config_schema.py makes of today's keys; the seeds' and the
    examples' configs validate against it, and an unknown key, a wrong type, an unknown choice and a number out of
    its range (the loader's own table) do not."""
    import jsonschema

    sys.path.insert(0, str(REPO / "scripts"))
    import build_config_schema

    shipped = json.loads(build_config_schema.OUT.read_text())
    assert shipped == json.loads(json.dumps(build_config_schema.config_schema())), \
        "run .venv/bin/python scripts/build_config_schema.py"
    assert all("description" in key for key in shipped["properties"].values())
    validator = jsonschema.Draft202012Validator(shipped)
    configs = [*SEEDS.glob("*.yaml"), *EXAMPLES.glob("*.yaml")]
    assert len(configs) >= 5
    for path in configs:
        assert not list(validator.iter_errors(yaml.safe_load(path.read_text()))), path
    good = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    for bad in ({"learning_rate": 1e-4}, {"micro_batch_size": "two"}, {"optimizer": "adam"}, {"lr": "fast"},
                {"micro_batch_size": 0}, {"adam_beta2": 1.0}, {"wsd_decay_fraction": 0}):  # the loader's BOUNDS
        assert list(validator.iter_errors({**good, **bad})), bad
        with pytest.raises(ConfigError):
            PreTrainingArguments.from_dict({**good, **bad})
    assert not list(validator.iter_errors({**good, "adam_beta2": 0.0, "warmup_fraction": 1, "seq_length": None}))
