"""Model-config parsers: how a model type's HF config maps to Megatron's network arguments and a model split.

The decorator and call convention are the seed's (openmind-accelerate's `add_model_config_to_megatron_parser`), and
so is the lookup: the first registered key that is a substring of `model.config.model_type.lower()`. What the engine
reads back from the filled arguments: docs/megatron.md. FLOPs per token are counted from the model itself
(`pretrainer.perf.flops`), not from these arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..config import ConfigError, expert_shape
from ..config.architecture import Architecture

MODEL_CONFIGS_TO_MEGATRON_PARSERS: dict[str, Callable] = {}


def add_model_config_to_megatron_parser(model_type: str):
    """Decorator: register `fn(megatron_lm_plugin, model, batch_data)` for configs whose model_type contains
    `model_type`. A later registration for the same key replaces the earlier one."""

    def register(fn: Callable) -> Callable:
        MODEL_CONFIGS_TO_MEGATRON_PARSERS[model_type.lower()] = fn
        return fn

    return register


@dataclass
class ParserPlugin:
    """What a parser fills: the seed's `MegatronLMPlugin` fields that parsers touch."""

    seq_length: int | None = None
    megatron_lm_default_args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkShape:
    """The parsed numbers the engine uses."""

    model_type: str
    parallel_split: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    untied_embeddings: bool
    seq_length: int | None  # the run's (the engine passes its seq_length); a parser may set its own
    megatron_args: dict

    def check_tensor_parallel(self, tp: int) -> None:
        problem = tensor_parallel_misfit(tp, self.num_attention_heads, self.num_query_groups, self.ffn_hidden_size)
        if problem:
            raise ConfigError(f"plugin_args.tp_degree={tp} does not divide the model's {problem}; choose a tp_degree "
                              "that divides it")

    def check_pipeline(self, stages: int) -> None:
        problem = pipeline_misfit(stages, self.num_layers, tied=not self.untied_embeddings)
        if problem:
            raise ConfigError(f"{problem}: lower pp_degree or num_layers_per_virtual_pipeline_stage"
                              + (", or untie the embeddings in config.json (Llama-2 is untied)" if "tied" in problem
                                 else ""))


def tensor_parallel_misfit(tp: int, heads: int, kv_heads: int, ffn: int) -> str | None:
    """What tensor parallelism of degree `tp` cannot split evenly (attention heads, key/value heads, the MLP), or
    None: the one rule for the engine's check and the planner's layouts."""
    for what, count in (("num_attention_heads", heads), ("num_key_value_heads (num_query_groups)", kv_heads),
                        ("intermediate_size (ffn_hidden_size)", ffn)):
        if count % tp:
            return f"{what}={count}"
    return None


def pipeline_misfit(stages: int, layers: int, tied: bool) -> str | None:
    """Why a model cannot be cut into `stages` pipeline stages, or None (one rule for the engine, the stage split
    and the planner's layouts)."""
    if layers < stages:
        return f"{stages} pipeline stages need at least {stages} decoder layers; the model has {layers}"
    if tied and stages > 1:
        return ("a model with tied input/output embeddings (tie_word_embeddings: true) cannot be split into "
                "pipeline stages here: the two ends live on different ranks")
    return None


def parse_model_config(model, seq_length: int | None = None, batch_data: dict | None = None) -> NetworkShape:
    """Run the registered parser for `model` and read back the shape the engine needs."""
    model_type = str(getattr(model.config, "model_type", "")).lower()
    parser = next((fn for key, fn in MODEL_CONFIGS_TO_MEGATRON_PARSERS.items() if key in model_type), None)
    if parser is None:
        known = ", ".join(MODEL_CONFIGS_TO_MEGATRON_PARSERS)
        raise ConfigError(
            f"model_type {model_type!r} has no model-config parser for the megatron engine (registered: {known}). "
            "If its decoder is laid out like Llama's (q/k/v/o_proj, gate/up/down_proj, RMSNorm), register it in "
            "your script before PreTrainer(...):\n"
            "    from pretrainer import add_model_config_to_megatron_parser, parse_llama_config\n"
            f"    add_model_config_to_megatron_parser({model_type!r})(parse_llama_config)\n"
            "otherwise add a split to pretrainer.parallel.splits and a parser that names it (docs/megatron.md: "
            "'Adding a model type')")
    plugin = ParserPlugin(seq_length=seq_length)
    parser(plugin, model, batch_data or {})
    args = plugin.megatron_lm_default_args
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in args]
    if missing:
        raise ConfigError(f"the model-config parser for {model_type!r} ({parser.__qualname__}) did not set "
                          f"{', '.join(missing)} in megatron_lm_plugin.megatron_lm_default_args")
    heads = int(args["num_attention_heads"])
    return NetworkShape(
        model_type=model_type,
        parallel_split=str(args.get("parallel_split") or args.get("parallel_plan") or "llama"),
        num_layers=int(args["num_layers"]),
        hidden_size=int(args["hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=int(args.get("num_query_groups") or heads),
        kv_channels=int(args.get("kv_channels") or args["hidden_size"] // heads),
        ffn_hidden_size=int(args.get("ffn_hidden_size") or 4 * args["hidden_size"]),
        vocab_size=int(args.get("padded_vocab_size") or args.get("orig_vocab_size") or 0),
        untied_embeddings=bool(args.get("untie_embeddings_and_output_weights", True)),
        seq_length=plugin.seq_length,
        megatron_args=dict(args),
    )


def parse_llama_config(megatron_lm_plugin, model, batch_data) -> None:
    """Llama-family decoders (Llama, Mistral, Mixtral, Qwen2/3 and their MoE variants, and any model laid out alike)."""
    config = model.config
    arch = Architecture.of(config)
    rope = getattr(config, "rope_parameters", None) or {}
    args = megatron_lm_plugin.megatron_lm_default_args
    args.update(
        model_type_name="gpt",
        num_layers=arch.layers,
        hidden_size=arch.hidden,
        num_attention_heads=arch.heads,
        group_query_attention=arch.kv_heads != arch.heads,
        num_query_groups=arch.kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate,
        orig_vocab_size=arch.vocab,
        padded_vocab_size=arch.vocab,
        max_position_embeddings=arch.max_positions,
        normalization="RMSNorm",
        norm_epsilon=config.rms_norm_eps,
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        rope_scaling=rope.get("rope_type", "default") != "default",
        untie_embeddings_and_output_weights=not arch.tied,
        add_bias_linear=bool(getattr(config, "mlp_bias", False)),
        add_qkv_bias=bool(getattr(config, "attention_bias", False)) or config.model_type.startswith("qwen2"),
        pretraining_flag=True,
        tokenizer_type="HuggingFaceTokenizer",
    )
    experts = expert_shape(config, "the model's config")
    if experts is not None:  # Megatron-Core's MoE arguments
        args.update(num_experts=experts.experts, moe_router_topk=experts.top_k,
                    moe_ffn_hidden_size=getattr(config, "moe_intermediate_size", None) or arch.intermediate)
    if megatron_lm_plugin.seq_length is None:
        input_ids = (batch_data or {}).get("input_ids")
        megatron_lm_plugin.seq_length = (input_ids.shape[1] if input_ids is not None
                                         else config.max_position_embeddings)


def parse_whole_attention_config(megatron_lm_plugin, model, batch_data) -> None:
    """Decoders laid out like Llama's whose attention is not split over tensor-parallel ranks: OLMoE (q/k norms
    over all heads) and DeepSeek-V3 (multi-head latent attention). They run pipeline stages, dp and ep."""
    parse_llama_config(megatron_lm_plugin, model, batch_data)
    megatron_lm_plugin.megatron_lm_default_args["parallel_split"] = "llama-whole-attention"


# a key matches every model_type containing it: "qwen2" and "qwen3" take their MoE variants too
for _model_type in ("llama", "mistral", "mixtral", "qwen2", "qwen3"):
    add_model_config_to_megatron_parser(_model_type)(parse_llama_config)
for _model_type in ("olmoe", "deepseek_v3"):
    add_model_config_to_megatron_parser(_model_type)(parse_whole_attention_config)
