"""Multi-token prediction settings (`mtp_num_layers`, `mtp_loss_coeff`; models/mtp.py builds the depths): the keys
checked alone at load, then against the run's window, model, dtype and context parallelism at resolve."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import key_error

DEFAULT_LOSS_COEFF = 0.1  # Megatron-Core's mtp_loss_scaling_factor; DeepSeek-V3 used 0.3, then 0.1


@dataclass(frozen=True)
class MtpSettings:
    depths: int          # D: each depth k predicts the token k + 1 ahead
    loss_coeff: float    # lambda: the MTP loss is lambda / D x the sum of the depths' mean cross-entropies

    def describe(self) -> str:
        return f"multi-token prediction: {self.depths} depth(s), loss weight {self.loss_coeff:g}"


def check_mtp_keys(depths, coeff) -> None:
    """The keys on their own (at load time)."""
    if not isinstance(depths, int) or isinstance(depths, bool) or depths < 0:
        raise key_error("mtp_num_layers", f"mtp_num_layers must be a whole number >= 0 (0: off; DeepSeek-V3 trains "
                        f"1), got {depths!r}")
    if depths and not coeff > 0:
        raise key_error("mtp_loss_coeff", f"mtp_loss_coeff must be > 0 with mtp_num_layers {depths} (0.1 is "
                        f"Megatron-Core's default, 0.3 DeepSeek-V3's early value), got {coeff!r}")


def mtp_settings(args, model_config, seq_length: int, context_parallel: int) -> MtpSettings | None:
    """The run's settings (None when off), checked against its window, model, dtype and context parallelism."""
    depths = args.mtp_num_layers
    if not depths:
        return None
    if depths >= seq_length:
        raise key_error("mtp_num_layers", f"depth {depths} leaves no target in a window of seq_length {seq_length} "
                        "tokens (depth k predicts the token k + 1 ahead); lower mtp_num_layers")
    transform = next((key for key in ("final_logit_softcapping", "logit_scale")
                      if getattr(model_config, key, None)), None)
    if transform:
        raise key_error("mtp_num_layers", f"the model transforms its logits after the head ({transform} in its "
                        "config), which the MTP depths' predictions would skip; multi-token prediction is not "
                        "available for it")
    if args.dtype == "fp16":
        raise key_error("mtp_num_layers", "multi-token prediction with dtype fp16 is not available (its loss joins "
                        "the backward outside the loss scaler's scaled loss); use bf16")
    if context_parallel > 1:
        raise key_error("mtp_num_layers", "multi-token prediction with context_parallel_degree > 1 is not available "
                        "(a depth reads tokens ahead that another rank holds); set context_parallel_degree: 1")
    return MtpSettings(depths, float(args.mtp_loss_coeff))
