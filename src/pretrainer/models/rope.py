"""RoPE scaling and base (`rope_scaling`, `rope_theta`) applied to an HF model config before the model is built, in the
form its transformers version reads: `rope_parameters` (transformers 5: one dict holding `rope_type`, `rope_theta` and
the type's fields) or `rope_scaling` + `rope_theta` (4.x).

Types other than `dynamic` (linear, yarn, llama3, longrope) extend the model's positions: `max_position_embeddings`
becomes `original_max_position_embeddings x factor` (the original defaults to the current `max_position_embeddings`), as
the configs of models published with these scalings read. `dynamic` (NTK) rescales at run time past the original length,
so `max_position_embeddings` keeps meaning the original length; `config.sizes.model_positions` counts `factor` times it.
"""

from __future__ import annotations

import copy as copy_module
import logging

import torch

from ..config import ConfigError
from ..config.sizes import model_positions

logger = logging.getLogger(__name__)


def apply_rope_settings(config, rope_scaling: dict | None, rope_theta: float | None, where: str) -> None:
    if not rope_scaling and rope_theta is None:
        return
    if getattr(config, "max_position_embeddings", None) is None:
        raise ConfigError(f"rope_scaling/rope_theta: the model config ({where}) has no max_position_embeddings, so "
                          "it has no rotary positions to scale")
    scaling = dict(rope_scaling or {})
    if "type" in scaling and "rope_type" not in scaling:  # the older spelling
        scaling["rope_type"] = scaling.pop("type")
    original = config.max_position_embeddings
    kind = scaling.get("rope_type")
    if kind and kind not in ("default", "dynamic"):
        if kind != "linear":  # the types that read it (linear divides positions by the factor, nothing more)
            scaling.setdefault("original_max_position_embeddings", original)
        base = scaling.get("original_max_position_embeddings", original)
        config.max_position_embeddings = int(base * scaling["factor"])
    if hasattr(config, "rope_parameters"):  # transformers 5
        parameters = dict(config.rope_parameters or {})
        if rope_scaling:
            parameters = {"rope_theta": parameters.get("rope_theta", 10000.0), **scaling}
        if rope_theta is not None:
            parameters["rope_theta"] = float(rope_theta)
        config.rope_parameters = parameters
        validate = config.validate_rope
    else:  # transformers 4.x
        if rope_scaling:
            config.rope_scaling = scaling
        if rope_theta is not None:
            config.rope_theta = float(rope_theta)
        from transformers.modeling_rope_utils import rope_config_validation

        def validate():
            rope_config_validation(config)
    try:
        validate()
    except (KeyError, ValueError, TypeError) as exc:
        message = str(exc)
        if len(message) > 1 and message[0] == message[-1] and message[0] in "'\"":  # a KeyError's quotes
            message = message[1:-1]
        raise ConfigError(f"key 'rope_scaling': {message} (the model config is {where})") from None
    logger.info("RoPE: %s%s; positions %d -> %d", f"{kind} x{scaling['factor']:g}" if kind else "base unchanged",
                f", theta {rope_theta:g}" if rope_theta is not None else "", original, config.max_position_embeddings)


# What `apply_rope_settings` writes on a config: the fields a stage's RoPE replaces on the model's config.
ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings")
# Models whose attention reads the RoPE scaling when it is built (DeepSeek's YaRN softmax scale), not only the rotary
# embedding: a stage cannot change it in place.
ATTENTION_READS_ROPE = ("deepseek_v2", "deepseek_v3")


def stage_rope_config(config, stage, where: str):
    """A copy of the model's `config` with the RoPE settings of a sequence-length `stage` (config/seq_stages.py);
    the config itself where the stage sets none."""
    if not stage.sets_rope:
        return config
    if getattr(config, "model_type", None) in ATTENTION_READS_ROPE:
        raise ConfigError(f"key 'seq_length_schedule': a stage sets RoPE, but {config.model_type}'s attention reads "
                          f"its RoPE scaling when it is built ({where}); set rope_scaling for the whole run instead")
    copy = copy_module.deepcopy(config)
    try:
        apply_rope_settings(copy, stage.rope_scaling, stage.rope_theta, where)
    except ConfigError as exc:  # name the stage's key, not the top-level one
        raise ConfigError(str(exc).replace("key 'rope_scaling'", "key 'seq_length_schedule': a stage's rope_scaling",
                                           1)) from None
    return copy


def rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's rotary embeddings: the modules holding RoPE's inverse frequencies."""
    return [module for module in model.modules() if isinstance(getattr(module, "inv_freq", None), torch.Tensor)]


def use_rope_config(model: torch.nn.Module, config, rope_config) -> None:
    """Make `model` (whose HF config is `config`) rotate with `rope_config`'s RoPE: its rotary embeddings are rebuilt
    in place (the same modules and buffers, so the engine's wrappers keep them) and the config's RoPE fields are set,
    so that a checkpoint or an export of the model carries them."""
    for field in ROPE_FIELDS:
        if field in vars(rope_config):
            setattr(config, field, getattr(rope_config, field))
    for module in rotary_modules(model):
        try:
            fresh = type(module)(config=config)
        except (TypeError, ValueError, KeyError) as exc:
            raise ConfigError(f"key 'seq_length_schedule': a stage's RoPE cannot rebuild the model's "
                              f"{type(module).__name__} from its config ({exc}); set RoPE for the whole run "
                              "instead") from None
        for name, buffer in fresh.named_buffers(recurse=False):
            getattr(module, name).copy_(buffer)
        for name, value in vars(fresh).items():
            if not name.startswith("_") and name != "training":
                setattr(module, name, value)


def check_stage_positions(schedule, config, where: str) -> None:
    """Each sequence-length stage's windows within the positions its RoPE gives the model (`schedule`: resolved)."""
    if schedule is None or config is None:
        return
    for index, stage in enumerate(schedule.stages):
        positions = model_positions(stage_rope_config(config, stage, f"{where}; seq_length_schedule[{index}]"))
        if positions is not None and stage.seq_length > positions:
            factor = -(-stage.seq_length // positions)
            raise ConfigError(f"key 'seq_length_schedule': seq_length_schedule[{index}] trains windows of "
                              f"{stage.seq_length} tokens, more than the {positions} positions the model ({where}) "
                              f"has with this stage's RoPE; give the stage rope_scaling, e.g. {{rope_type: yarn, "
                              f"factor: {factor}}}, or a shorter seq_length")
