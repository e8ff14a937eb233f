"""The openMind compatibility layer: the seed's rules and its Megatron keys, read in one place.

The seed's YAML puts run values (lr, clip, seed, ...) inside `plugin_args.other_megatron_args` for its Megatron engine;
here they are honoured on every engine, and `megatron_args` is that mapping's one reader.
"""

from __future__ import annotations

from .dtypes import DTYPES
from .errors import key_error
from .loading import suggestion

# other_megatron_args / plugin_args keys that name a value this run also uses: the field of the same name, or these.
_RENAMED_FIELDS = {"lr_warmup_fraction": "warmup_fraction", "lr_warmup_iters": "warmup_steps",
                   "make_vocab_size_divisible_by": "pad_vocab_to_multiple_of",
                   "context_parallel_size": "context_parallel_degree",
                   "expert_model_parallel_size": "expert_parallel_degree"}
MEGATRON_KEY_TO_FIELD = {key: _RENAMED_FIELDS.get(key, key) for key in (
    "lr", "min_lr", "lr_decay_style", "lr_warmup_fraction", "lr_warmup_iters", "weight_decay", "adam_beta1",
    "adam_beta2", "adam_eps", "init_method_std", "clip_grad", "seed", "eval_iters", "data_cache_path",
    "distributed_timeout_minutes", "reset_position_ids", "reset_attention_mask", "make_vocab_size_divisible_by",
    "context_parallel_size", "expert_model_parallel_size")}

# The seed's four custom Megatron hooks (functions set in plugin_args by a script).
HOOK_KEYS = ("custom_megatron_datasets_provider_function", "custom_get_batch_function",
             "custom_model_provider_function", "custom_loss_function")
# plugin_args keys the megatron engine reads (besides the hooks and other_megatron_args).
PLUGIN_ENGINE_KEYS = ("tp_degree", "pp_degree", "num_micro_batches", "gradient_clipping", "sequence_parallelism",
                      "recompute_activations", "use_distributed_optimizer", "num_layers_per_virtual_pipeline_stage",
                      "pipeline_schedule", "pipeline_layers", "other_megatron_args", "cp_degree",
                      "data_parallel_sharding_strategy")
# The fields of accelerate's MegatronLMPlugin, which the seed's plugin_args fill: a name that is none of these nor
# the engine's own is a typo, refused with the nearest name (not passed over as a setting with no counterpart).
MEGATRON_LM_PLUGIN_FIELDS = (
    "attention_backend", "attention_dropout", "attention_softmax_in_fp32", "calculate_per_token_loss",
    "consumed_samples", "context_parallel_size", "custom_prepare_model_function", "custom_train_step_class",
    "custom_train_step_kwargs", "decoder_last_pipeline_num_layers", "decoder_seq_length", "encoder_seq_length",
    "end_weight_decay", "eod_mask_loss", "eval_interval", "eval_iters", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "gradient_clipping", "hidden_dropout", "is_train_batch_min", "lr_decay_iters",
    "lr_decay_samples", "lr_decay_style", "lr_mult", "lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_samples",
    "megatron_dataset_flag", "min_lr", "no_load_optim", "no_save_optim", "no_wd_decay_cond", "num_micro_batches",
    "optimizer_cpu_offload", "other_megatron_args", "overlap_cpu_optimizer_d2h_h2d",
    "pipeline_model_parallel_split_rank", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "return_logits", "scale_lr_cond", "seq_length", "set_all_logging_options", "start_weight_decay",
    "tensorboard_dir", "train_iters", "train_samples", "use_custom_fsdp", "use_precision_aware_optimizer",
    "use_rotary_position_embeddings", "weight_decay_incr_style")


def megatron_args(plugin_args: dict | None) -> dict:
    """`plugin_args.other_megatron_args` as a plain dict (empty when unset)."""
    return dict((plugin_args or {}).get("other_megatron_args") or {})


def check_plugin_keys(plugin_args: dict | None) -> None:
    """Every plugin_args key is the engine's, a hook, or a MegatronLMPlugin field; anything else is a typo."""
    known = (*PLUGIN_ENGINE_KEYS, *HOOK_KEYS, *MEGATRON_LM_PLUGIN_FIELDS)
    for key in plugin_args or {}:
        if key not in known:
            raise key_error("plugin_args", f"plugin_args.{key} is neither a setting of the megatron engine nor a "
                            f"field of accelerate's MegatronLMPlugin{suggestion(str(key), known)}")


# plugin_args / other_megatron_args degrees: positive whole numbers whatever the engine
DEGREE_KEYS = (("tp_degree", "tensor_model_parallel_size"), ("pp_degree", "pipeline_model_parallel_size"),
               ("cp_degree", "context_parallel_size"))


def check_degrees(plugin_args: dict | None) -> None:
    plugin, megatron = plugin_args or {}, megatron_args(plugin_args)
    for where, value in [(f"plugin_args.{k}", plugin.get(k)) for k, _ in DEGREE_KEYS] + \
            [(f"plugin_args.other_megatron_args.{m}", megatron.get(m)) for _, m in DEGREE_KEYS]:
        if value is not None and (type(value) is not int or value < 1):
            raise key_error("plugin_args", f"{where} must be a whole number >= 1, got {value!r}")


def apply_openmind_rules(args) -> None:
    """The seed's checks on its own keys: data_path needs megatron_dataset_flag, dtype names, the model alias,
    plugin_args names and degrees."""
    check_plugin_keys(args.plugin_args)
    check_degrees(args.plugin_args)
    if args.data_path is not None and args.megatron_dataset_flag is None:
        raise key_error("data_path", "data_path is set but megatron_dataset_flag is not: add "
                        "`megatron_dataset_flag: false` for JSON/CSV/text files, `true` for Megatron .bin/.idx "
                        "prefixes (or use the `train_data` key, which needs no flag)")
    args.dtype = args.dtype.lower()
    if args.dtype not in (*DTYPES, "auto"):
        raise key_error("dtype", f"Unknown dtype: {args.dtype!r}; use one of {', '.join(DTYPES)}, or auto (bf16 "
                        "where the device runs it faster than fp32)")
    if args.model_path and args.openmind_model_path and args.model_path != args.openmind_model_path:
        raise key_error("model_path", f"model_path ({args.model_path}) and its alias openmind_model_path "
                        f"({args.openmind_model_path}) disagree; keep one of them")


def merge_megatron_values(args) -> set[str]:
    """Honour on every engine the values the seed's YAML puts in plugin_args for Megatron; returns the keys it set."""
    plugin = args.plugin_args or {}
    megatron = megatron_args(plugin)
    for plugin_key, key in (("gradient_clipping", "clip_grad"), ("cp_degree", "context_parallel_size")):
        if plugin_key in plugin and key not in megatron:
            megatron[key] = plugin[plugin_key]
    merged = set()
    for key, name in MEGATRON_KEY_TO_FIELD.items():
        if key not in megatron:
            continue
        merged.add(name)
        value = megatron[key]
        if name == "lr_decay_style" and isinstance(value, str):
            value = value.lower()
        current = getattr(args, name)
        if current != args.default_of(name) and current != value:
            raise key_error(name, f"{name}={current!r} conflicts with plugin_args.other_megatron_args.{key}="
                            f"{value!r}; set the value in one place only")
        setattr(args, name, value)
    return merged


def check_given_against_megatron(given: dict, args) -> None:
    """A key the config sets to its default value, overridden by other_megatron_args (which only fills keys
    left at their default): a conflict the merge itself cannot see, named here with both places."""
    megatron = megatron_args(given.get("plugin_args"))
    for key, name in MEGATRON_KEY_TO_FIELD.items():
        if key in megatron and name in given and given[name] == args.default_of(name) != getattr(args, name):
            raise key_error(name, f"{name}={given[name]!r} conflicts with plugin_args.other_megatron_args.{key}="
                            f"{megatron[key]!r}; set the value in one place only")
