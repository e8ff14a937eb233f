"""RoPE scaling and base (`rope_scaling`, `rope_theta`) applied to an HF model config before the model is built, in the
form its transformers version reads: `rope_parameters` (transformers 5: one dict holding `rope_type`, `rope_theta` and
the type's fields) or `rope_scaling` + `rope_theta` (4.x).

Types other than `dynamic` (linear, yarn, llama3, longrope) extend the model's positions: `max_position_embeddings`
becomes `original_max_position_embeddings x factor` (the original defaults to the current `max_position_embeddings`), as
the configs of models published with these scalings read. `dynamic` (NTK) rescales at run time past the original length,
so `max_position_embeddings` keeps meaning the original length; `config.sizes.model_positions` counts `factor` times it.
"""

from __future__ import annotations

import logging

from ..config import ConfigError

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
        message = str(exc).strip("'\"")
        raise ConfigError(f"key 'rope_scaling': {message} (the model config is {where})") from None
    logger.info("RoPE: %s%s; positions %d -> %d", f"{kind} x{scaling['factor']:g}" if kind else "base unchanged",
                f", theta {rope_theta:g}" if rope_theta is not None else "", original, config.max_position_embeddings)
