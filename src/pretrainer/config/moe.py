"""Mixture-of-Experts settings, read once from the config and the model's HF config (no torch here).

The model's config says whether it routes tokens to experts (`num_local_experts`, `num_experts` or `n_routed_experts`,
with `num_experts_per_tok`); the run's `moe_*` keys say how the routing is balanced and are refused on a dense model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, key_error

MOE_KEYS = ("moe_aux_loss_coeff", "moe_aux_loss_type", "moe_z_loss_coeff", "moe_expert_bias_update_rate",
            "moe_experts_implementation", "moe_capacity_factor", "moe_token_drop_policy")
# an over-full expert drops its tokens of lowest routing weight (probs) or its last in the micro-batch (position)
DROP_POLICIES = ("probs", "position")
# how the local experts compute (transformers' experts interface; docs/configuration.md)
EXPERTS_IMPLEMENTATIONS = ("auto", "eager", "batched_mm", "grouped_mm")
# the balance loss per sequence or per micro-batch (docs/moe.md, 'The knobs')
AUX_LOSS_TYPES = ("seq", "micro_batch")
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class ExpertShape:
    """What the model's config says about its experts."""
    experts: int   # routed experts per MoE layer
    top_k: int     # experts each token goes to


@dataclass(frozen=True)
class MoeSettings:
    shape: ExpertShape
    aux_loss_coeff: float       # load-balancing loss weight (0: off); null key: the model config's router_aux_loss_coef
    aux_loss_type: str          # seq | micro_batch
    z_loss_coeff: float         # router z-loss weight (ST-MoE); 0: off
    expert_bias_update_rate: float  # aux-loss-free balancing: the per-expert bias step per optimizer step; 0: off
    experts_implementation: str = "auto"  # EXPERTS_IMPLEMENTATIONS
    capacity_factor: float | None = None  # tokens an expert takes per micro-batch, over an even share; None: dropless
    drop_policy: str = "probs"            # DROP_POLICIES

    @staticmethod
    def of(args, model_config, where: str) -> "MoeSettings | None":
        """The settings for a model with experts, None for a dense one (whose config must set no moe_* key)."""
        shape = expert_shape(model_config, where)
        if shape is None:
            given = [key for key in MOE_KEYS if getattr(args, key) is not None]
            if given:
                raise key_error(given[0], f"{given[0]} is set but {where} describes a dense model (no experts: none "
                                          f"of {', '.join(_EXPERT_COUNT_KEYS)}); remove the moe_* keys")
            return None
        coeff = args.moe_aux_loss_coeff
        if coeff is None:
            coeff = float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)
        return MoeSettings(shape, coeff, args.moe_aux_loss_type or "seq", args.moe_z_loss_coeff or 0.0,
                           args.moe_expert_bias_update_rate or 0.0, args.moe_experts_implementation or "auto",
                           args.moe_capacity_factor, args.moe_token_drop_policy or "probs")

    def describe(self) -> str:
        parts = [f"{self.shape.experts} experts, top-{self.shape.top_k}",
                 f"aux loss {self.aux_loss_coeff:g} ({self.aux_loss_type})" if self.aux_loss_coeff else "no aux loss"]
        if self.z_loss_coeff:
            parts.append(f"z-loss {self.z_loss_coeff:g}")
        if self.expert_bias_update_rate:
            parts.append(f"expert bias update rate {self.expert_bias_update_rate:g}")
        parts.append(f"capacity factor {self.capacity_factor:g} (drops by {self.drop_policy})"
                     if self.capacity_factor is not None else "dropless")
        return ", ".join(parts)


def expert_shape(model_config, where: str) -> ExpertShape | None:
    """The experts a model config declares, None for a dense model; a top-k above the experts is an error."""
    experts = next((getattr(model_config, key) for key in _EXPERT_COUNT_KEYS
                    if isinstance(getattr(model_config, key, None), int) and getattr(model_config, key) > 0), None)
    if experts is None:
        return None
    top_k = getattr(model_config, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(f"{where}: num_experts_per_tok {top_k!r} must be between 1 and the {experts} experts")
    return ExpertShape(experts, top_k)
