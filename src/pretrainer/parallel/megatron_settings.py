"""The megatron engine's settings, read from the seed's `plugin_args` (and `other_megatron_args`).

Keys that configure this engine are honoured; keys that describe the network are checked against the
model's own config (the HF config defines the model here); keys for Megatron-LM internals that have no
counterpart are reported once as ignored, with the reason. Nothing is silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import HOOK_KEYS, MEGATRON_KEY_TO_FIELD, ConfigError
from ..config.architecture import Architecture
from ..config.openmind import PLUGIN_ENGINE_KEYS
from .activation_checkpoint import RecomputeSettings

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# Megatron-Core's data_parallel_sharding_strategy, each run on FSDP2 over the dp x cp ranks (docs/megatron.md).
SHARDING_STRATEGIES = ("no_shard", "optim_grads", "optim_grads_params")

# plugin_args keys that the run's own keys already cover.
COVERED_KEYS = {"train_iters": "num_training_steps", "seq_length": "seq_length", "eval_iters": "eval_iters",
                "eval_interval": "eval_interval", "megatron_dataset_flag": "megatron_dataset_flag",
                "tensorboard_dir": "report_to: tensorboard (written under save_dir)"}

# other_megatron_args keys read by this engine or the data pipeline.
ENGINE_MEGATRON_KEYS = {"recompute_granularity", "recompute_method", "recompute_num_layers", "sequence_parallel",
                        "tensor_model_parallel_size", "pipeline_model_parallel_size", "use_distributed_optimizer",
                        "num_layers_per_virtual_pipeline_stage", "split", "data_parallel_sharding_strategy"}
# other_megatron_args keys that describe the network: compared with the HF config.
ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "normalization", "swiglu", "position_embedding_type", "untie_embeddings_and_output_weights",
                     "group_query_attention", "max_position_embeddings", "add_bias_linear", "kv_channels")
# Megatron-LM internals with no counterpart here, and why.
IGNORED_REASONS = {
    "use_flash_attn": "attention runs through the model's attn_implementation (SDPA; flash kernels where the "
                      "device has them)",
    **dict.fromkeys(("masked_softmax_fusion", "bias_gelu_fusion", "bias_dropout_fusion",
                     "gradient_accumulation_fusion", "apply_rope_fusion"),
                    "kernel fusion is torch.compile's job here (compile: true)"),
    "attention_softmax_in_fp32": "attention softmax is computed by SDPA, which accumulates in fp32",
    "async_tensor_model_parallel_allreduce": "DTensor issues the tensor-parallel collectives",
    "overlap_grad_reduce": "FSDP2 overlaps gradient reduction itself",
    "overlap_param_gather": "FSDP2 prefetches parameters itself",
    "initial_loss_scale": "fp16 uses torch's GradScaler (initial scale 65536); bf16/fp32 need no loss scale",
    "optimizer": "the optimizer is AdamW (adam_beta1/2, adam_eps, weight_decay are honoured)",
    "finetune": "resume is controlled by the `resume` key",
    "no_load_optim": "resume restores the optimizer with the model (`resume: none` starts fresh)",
    "no_load_rng": "resume restores RNG state exactly (`resume: none` starts fresh)",
    "load": "checkpoints are found in save_dir/checkpoints (the `resume` key)",
    "save": "checkpoints are written to save_dir/checkpoints",
    "attention_dropout": "dropout comes from the model's config.json (attention_dropout)",
    "hidden_dropout": "dropout comes from the model's config.json",
    "tokenizer_model": "the tokenizer is `tokenizer_path` (default: the model folder)",
    "tokenizer_type": "the tokenizer is `tokenizer_path` (default: the model folder), loaded with AutoTokenizer",
}


@dataclass(frozen=True)
class MegatronSettings:
    tp: int = 1
    pp: int = 1
    num_micro_batches: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # optimizer state and gradients sharded over dp x cp (FSDP2)
    reshard_parameters: bool = False     # parameters resharded after forward too (optim_grads_params)
    shard_size: int | None = None        # ranks per shard group of the sharded data parallelism (HSDP); None: all
    cpu_offload: bool = False            # shards and their optimizer step on the host (fsdp_cpu_offload)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    layers_per_virtual_stage: int | None = None
    pipeline_layers: list | None = None  # explicit decoder layers per stage, in stage order
    schedule: str = "1f1b"
    recompute_granularity: str | None = None  # None | "full" | "selective"
    recompute_method: str = "uniform"  # "uniform" | "block"
    recompute_num_layers: int | None = None
    notices: tuple = field(default=(), compare=False)  # seed keys ignored or disagreeing with the model (logged)

    @property
    def recompute(self) -> RecomputeSettings:
        return RecomputeSettings(self.recompute_granularity or "none", self.recompute_method,
                                 self.recompute_num_layers)

    @property
    def sharding_strategy(self) -> str:
        return SHARDING_STRATEGIES[self.distributed_optimizer + self.reshard_parameters]

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"sequence_parallel={self.sequence_parallel}",
                 f"num_micro_batches={self.num_micro_batches}",
                 f"data_parallel_sharding_strategy={self.sharding_strategy}"]
        full = f"/{self.recompute_method}/{self.recompute_num_layers}" if self.recompute_granularity == "full" else ""
        optional = ((self.shard_size, f"fsdp_shard_size={self.shard_size}"), (self.cpu_offload, "cpu_offload=True"),
                    (self.pp > 1, f"schedule={self.schedule} stages={self.num_stages}"),
                    (self.recompute_granularity, f"recompute={self.recompute_granularity}{full}"))
        return " ".join(parts + [text for shown, text in optional if shown])


def _picker(args):
    """A reader of one setting by its plugin_args name or its other_megatron_args name (both set: they agree)."""
    plugin, megatron = dict(args.plugin_args or {}), args.megatron_args

    def pick(plugin_key: str, megatron_key: str, default):
        values = {k: v for k, v in ((f"plugin_args.{plugin_key}", plugin.get(plugin_key)),
                                    (f"plugin_args.other_megatron_args.{megatron_key}", megatron.get(megatron_key)))
                  if v is not None}
        if len(set(map(str, values.values()))) > 1:
            raise ConfigError(" and ".join(f"{k}={v!r}" for k, v in values.items()) + " disagree; set one of them")
        return next(iter(values.values()), default)

    return pick


def splits_model(args) -> bool:
    """Whether the config splits the model over ranks (tensor or pipeline parallelism above 1)."""
    pick = _picker(args)
    return any(_positive(key, pick(key, name, 1)) > 1 for key, name in (("tp_degree", "tensor_model_parallel_size"),
                                                                        ("pp_degree", "pipeline_model_parallel_size")))


def read_settings(args, num_layers: int | None = None, default_strategy: str = "no_shard",
                  reads_shard_size: bool = True, stages: bool = True) -> MegatronSettings:
    """The engine settings from `args.plugin_args` (seed names) and the native keys, checked; `default_strategy`:
    the engine name's data-parallel sharding (no_shard for megatron and ddp, optim_grads_params for fsdp)."""
    plugin, megatron = dict(args.plugin_args or {}), args.megatron_args
    pick = _picker(args)
    tp = _positive("tp_degree", pick("tp_degree", "tensor_model_parallel_size", 1))
    micro = plugin.get("num_micro_batches")
    if micro is not None and micro != args.gradient_accumulation_steps:
        raise ConfigError(f"plugin_args.num_micro_batches={micro} differs from gradient_accumulation_steps="
                          f"{args.gradient_accumulation_steps}; they are the same thing here (micro-batches per "
                          "optimizer step): set both to the same value")
    settings = MegatronSettings(
        tp=tp,
        pp=_positive("pp_degree", pick("pp_degree", "pipeline_model_parallel_size", 1)),
        num_micro_batches=args.gradient_accumulation_steps,
        # nothing to split with tp 1
        sequence_parallel=bool(pick("sequence_parallelism", "sequence_parallel", False)) and tp > 1,
        # a whole model's data ranks do what the engine's name says (the switches are the rule table's)
        **_read_sharding(pick("use_distributed_optimizer", "use_distributed_optimizer", None) if stages else None,
                         pick("data_parallel_sharding_strategy", "data_parallel_sharding_strategy", None)
                         if stages else None, default_strategy),
        layers_per_virtual_stage=pick("num_layers_per_virtual_pipeline_stage",
                                      "num_layers_per_virtual_pipeline_stage", None),
        pipeline_layers=plugin.get("pipeline_layers"),
    )
    if args.fsdp_shard_size is not None and reads_shard_size:  # (an engine that does not: the rule table's)
        if not settings.distributed_optimizer:
            raise ConfigError("key 'fsdp_shard_size': the data-parallel ranks shard their state only with a "
                              "sharding strategy; set plugin_args.data_parallel_sharding_strategy: optim_grads or "
                              "optim_grads_params (hybrid sharding: replicate across groups of this many ranks), or "
                              "remove fsdp_shard_size")
        settings = replace(settings, shard_size=args.fsdp_shard_size)
    if not stages:  # a whole model: the stages' recompute and pipeline settings have no effect (run/rules.py)
        return settings
    settings = replace(settings, **_read_recompute(plugin, megatron, args.activation_checkpointing))
    return replace(settings, **_read_pipeline(settings, plugin, num_layers))


def _read_sharding(distributed_optimizer, strategy, default_strategy: str = "no_shard") -> dict:
    """`data_parallel_sharding_strategy` (Megatron-Core's names), or `use_distributed_optimizer` (optim_grads)."""
    if strategy is None and distributed_optimizer is None:
        strategy = default_strategy
    if strategy is None:
        return {"distributed_optimizer": bool(distributed_optimizer)}
    if strategy == "optim":
        raise ConfigError("plugin_args.data_parallel_sharding_strategy: optim (ZeRO-1) is not offered: FSDP2 "
                          "reduce-scatters gradients, so optim_grads (ZeRO-2) holds less for the same traffic; use "
                          "optim_grads, or optim_grads_params to shard parameters too")
    if strategy not in SHARDING_STRATEGIES:
        raise ConfigError(f"plugin_args.data_parallel_sharding_strategy: {strategy!r} is not one of "
                          f"{', '.join(SHARDING_STRATEGIES)}")
    index = SHARDING_STRATEGIES.index(strategy)
    if distributed_optimizer is not None and bool(distributed_optimizer) != (index > 0):
        raise ConfigError(f"plugin_args.use_distributed_optimizer={distributed_optimizer} and "
                          f"data_parallel_sharding_strategy={strategy} disagree; set one of them")
    return {"distributed_optimizer": index > 0, "reshard_parameters": index == 2}


def _positive(key: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"plugin_args.{key} must be a positive integer, got {value!r}")
    return value


def _read_recompute(plugin: dict, megatron: dict, native: str) -> dict:
    granularity = megatron.get("recompute_granularity")
    if granularity is None and plugin.get("recompute_activations"):
        granularity = "selective"  # what MegatronLMPlugin turns recompute_activations into
    if granularity is not None and native not in ("none", granularity):
        raise ConfigError(f"activation_checkpointing={native!r} and plugin_args recompute_granularity="
                          f"{granularity!r} disagree; set one of them")
    granularity = granularity or (None if native == "none" else native)
    if granularity not in (None, "full", "selective"):
        raise ConfigError(f"other_megatron_args.recompute_granularity {granularity!r} is not full or selective")
    method = megatron.get("recompute_method") or "uniform"
    if method not in ("uniform", "block"):
        raise ConfigError(f"other_megatron_args.recompute_method {method!r} is not uniform or block")
    count = megatron.get("recompute_num_layers")
    if count is not None and (not isinstance(count, int) or count < 1):
        raise ConfigError(f"other_megatron_args.recompute_num_layers must be a positive integer, got {count!r}")
    return {"recompute_granularity": granularity, "recompute_method": method, "recompute_num_layers": count}


def _read_pipeline(settings: MegatronSettings, plugin: dict, num_layers: int | None) -> dict:
    """The pipeline's virtual stages and schedule (fields of MegatronSettings), checked."""
    schedule = plugin.get("pipeline_schedule")
    virtual_stages = settings.virtual_stages
    if settings.layers_per_virtual_stage is not None:
        if settings.pp == 1:
            raise ConfigError("num_layers_per_virtual_pipeline_stage needs pp_degree > 1")
        if num_layers is not None:
            per_rank, rest = divmod(num_layers, settings.pp)
            if rest or per_rank % settings.layers_per_virtual_stage:
                raise ConfigError(f"num_layers_per_virtual_pipeline_stage={settings.layers_per_virtual_stage}: the "
                                  f"model's {num_layers} layers over pp_degree={settings.pp} must give each rank a "
                                  "multiple of it")
            virtual_stages = per_rank // settings.layers_per_virtual_stage
    if settings.pipeline_layers is not None:
        layers = settings.pipeline_layers
        if settings.pp == 1:
            raise ConfigError("plugin_args.pipeline_layers cuts the model into pipeline stages and needs pp_degree > 1 "
                              "(one rank runs one stage of the whole model); remove it or set plugin_args.pp_degree")
        if not isinstance(layers, list) or not all(isinstance(n, int) and n >= 1 for n in layers):
            raise ConfigError(f"plugin_args.pipeline_layers must be a list of positive layer counts, got {layers!r}")
        if len(layers) % settings.pp:
            raise ConfigError(f"plugin_args.pipeline_layers has {len(layers)} stages; it needs a multiple of "
                              f"pp_degree={settings.pp} (pp_degree x virtual stages)")
        if num_layers is not None and sum(layers) != num_layers:
            raise ConfigError(f"plugin_args.pipeline_layers {layers} sums to {sum(layers)}, the model has "
                              f"{num_layers} decoder layers")
        if settings.layers_per_virtual_stage is not None and len(layers) != settings.pp * virtual_stages:
            raise ConfigError("plugin_args.pipeline_layers and num_layers_per_virtual_pipeline_stage give different "
                              "stage counts; keep one of them")
        virtual_stages = len(layers) // settings.pp
    if schedule is None:
        schedule = "interleaved_1f1b" if virtual_stages > 1 else "1f1b"
    if schedule not in SCHEDULES:
        raise ConfigError(f"plugin_args.pipeline_schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if virtual_stages > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(f"{virtual_stages} virtual stages per rank need pipeline_schedule: "
                          f"interleaved_1f1b (got {schedule})")
    if schedule == "interleaved_1f1b" and settings.pp > 1 and virtual_stages == 1:
        virtual_stages = 2  # interleaving needs at least two model chunks per rank
    if settings.pp > 1 and schedule != "gpipe" and settings.num_micro_batches < settings.pp:
        raise ConfigError(f"pipeline_schedule {schedule} with pp_degree={settings.pp} needs at least {settings.pp} "
                          f"micro-batches per step (gradient_accumulation_steps={settings.num_micro_batches}); "
                          "raise gradient_accumulation_steps or use pipeline_schedule: gpipe")
    return {"virtual_stages": virtual_stages, "schedule": schedule}


def unused_keys(args, model_config, settings: MegatronSettings) -> list[str]:
    """Which seed keys are ignored or disagree with the model (`model_config`, None when not known)."""
    plugin, megatron = dict(args.plugin_args or {}), args.megatron_args
    messages = [f"plugin_args.{key}: covered by {COVERED_KEYS[key]}" if key in COVERED_KEYS else
                f"plugin_args.{key}: ignored (a MegatronLMPlugin setting with no counterpart here)"
                for key in plugin if key not in PLUGIN_ENGINE_KEYS and key not in HOOK_KEYS]
    hf = _hf_architecture(model_config) if model_config is not None else {}
    for key, value in megatron.items():
        if key in ENGINE_MEGATRON_KEYS or key in MEGATRON_KEY_TO_FIELD:
            continue
        if key in ARCHITECTURE_KEYS:
            if key in hf and _normalise(hf[key]) != _normalise(value):
                messages.append(f"other_megatron_args.{key}={value!r}: ignored, the model's config.json defines the "
                                f"network ({key}={hf[key]!r})")
            continue
        reason = IGNORED_REASONS.get(key, "a Megatron-LM setting with no meaning in this engine")
        messages.append(f"other_megatron_args.{key}: ignored, {reason}")
    if (plugin.get("sequence_parallelism") or megatron.get("sequence_parallel")) and settings.tp == 1:
        messages.append("sequence_parallelism: no effect with tp_degree 1")
    return messages


def _hf_architecture(config) -> dict:
    arch = Architecture.of(config)
    return {"num_layers": arch.layers, "hidden_size": arch.hidden, "num_attention_heads": arch.heads,
            "num_query_groups": arch.kv_heads, "ffn_hidden_size": arch.intermediate, "normalization": "RMSNorm",
            "swiglu": True, "position_embedding_type": "rope", "untie_embeddings_and_output_weights": not arch.tied,
            "group_query_attention": arch.kv_heads != arch.heads, "max_position_embeddings": arch.max_positions,
            "add_bias_linear": bool(getattr(config, "mlp_bias", False))}


def _normalise(value):
    return value.lower() if isinstance(value, str) else value
