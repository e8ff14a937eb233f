"""How initialisation and learning rates scale with the model's size (`parametrization`, docs/optimization.md,
'Hyperparameter transfer'): `sp` (as the model's own init, one lr), `mup` (width) or `completep` (width and depth).

muP and CompleteP are written here without forward multipliers: a multiplier `a` on a weight trained by Adam is the same
function at every step as the weight scaled by `a` at init with its lr scaled by `a` (and eps by 1/a), so each rule
becomes an init factor and an lr factor per parameter role. The model keeps its architecture's forward pass, every
engine trains it as it trains any model, and the export is a plain checkpoint of the same class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError, key_error

PARAMETRIZATIONS = ("sp", "mup", "completep")
# embedding: input tables (and a head tied to them); output: an untied head; hidden: other matrices; query: the
# attention's query projection (where the 1/d_head attention scale folds in); branch_out: a residual branch's last
# projection (attention out, MLP down: CompleteP's 1/depth multiplier folds in); output_gain: with a tied head, the
# final norm's weight (muP's 1/width logits multiplier folds in); vector: other norms and biases
ROLES = ("embedding", "output", "hidden", "query", "query_bias", "branch_out", "output_gain", "vector")


@dataclass(frozen=True)
class Scale:
    """A parameter's factors against the base model's: of its init std, its lr, its Adam eps and its weight decay
    (decoupled decay keeps lr x weight_decay as at the base: the decay per step does not shrink with the lr)."""
    init: float = 1.0
    lr: float = 1.0
    eps: float = 1.0

    @property
    def weight_decay(self) -> float:
        return 1.0 / self.lr


@dataclass(frozen=True)
class Parametrization:
    kind: str = "sp"
    width_ratio: float = 1.0       # hidden_size / mup_base_hidden_size
    head_dim_ratio: float = 1.0    # head_dim / mup_base_head_dim
    depth_ratio: float = 1.0       # num_layers / mup_base_num_layers (completep)
    tied: bool = False             # the head shares the input embedding's table

    @staticmethod
    def of(args, architecture) -> "Parametrization":
        """From the config's keys and the model's shape (config/architecture.py's Architecture)."""
        if args.parametrization == "sp":
            return Parametrization()
        if architecture is None:
            raise key_error("parametrization", f"{args.parametrization} scales from the model's config (its width), "
                            "which a model handed to PreTrainer does not give; use parametrization: sp")
        base_head_dim = args.mup_base_head_dim or architecture.head_dim
        depth = architecture.layers / args.mup_base_num_layers if args.parametrization == "completep" else 1.0
        return Parametrization(args.parametrization, architecture.hidden / args.mup_base_hidden_size,
                               architecture.head_dim / base_head_dim, depth, architecture.tied)

    def scale(self, role: str, muon: bool = False) -> Scale:
        """The factors of a parameter of `role`; `muon`: a matrix Muon updates, whose update is scaled by its shape
        (sqrt(fan_out / fan_in)), so its lr needs no width factor."""
        if self.kind == "sp" or role in ("embedding", "vector"):
            return Scale()
        m = self.width_ratio
        if role in ("output", "output_gain"):  # muP's 1/m logits multiplier, folded (a gain on the logits too)
            return Scale(1.0 / m, 1.0 if muon else 1.0 / m, m)  # Muon's shape scale already shrinks with the width
        if role == "query_bias":  # the query's folded attention multiplier; a bias starts at zero
            multiplier = 1.0 / math.sqrt(self.head_dim_ratio)
            return Scale(1.0, multiplier, 1.0 / multiplier)
        width = Scale(1.0 / math.sqrt(m), 1.0 if muon else 1.0 / m, 1.0 if muon else 1.0 / m)
        multiplier = 1.0
        if role == "query":   # muP's attention scale 1/d_head (against the base's 1/sqrt(d_head))
            multiplier = 1.0 / math.sqrt(self.head_dim_ratio)
        elif role == "branch_out":  # CompleteP's residual branch multiplier base_layers / layers
            multiplier = 1.0 / self.depth_ratio
        return Scale(width.init * multiplier, width.lr * multiplier, width.eps / multiplier)

    def describe(self) -> str:
        if self.kind == "sp":
            return "sp"
        head = "final norm (tied head)" if self.tied else "output"
        parts = [f"width x{self.width_ratio:g} of the base: hidden init x{1 / math.sqrt(self.width_ratio):.3g}, "
                 f"hidden and {head} lr x{1 / self.width_ratio:.3g}, {head} init x{1 / self.width_ratio:.3g}"]
        if self.head_dim_ratio != 1.0:
            parts.append(f"attention 1/d_head (head_dim x{self.head_dim_ratio:g})")
        if self.kind == "completep":
            parts.append(f"depth x{self.depth_ratio:g}: residual branches x{1 / self.depth_ratio:.3g}")
        return f"{self.kind} ({'; '.join(parts)})"


def check_parametrization(args) -> None:
    """The base sizes a parametrization scales from are given (their keys without one are config/features.py's)."""
    needed = {"mup": ("mup_base_hidden_size",), "completep": ("mup_base_hidden_size", "mup_base_num_layers")}
    for key in needed.get(args.parametrization, ()):
        if getattr(args, key) is None:
            what = "width" if key == "mup_base_hidden_size" else "depth"
            raise key_error(key, f"parametrization: {args.parametrization} scales from the {what} the "
                            f"hyperparameters were tuned at; set {key} (the model's own, to tune at this size)")
    if args.parametrization != "sp" and args.optimizer == "muon" and args.muon_adjust_lr != "spectral" \
            and "muon_adjust_lr" in args.given_keys:
        raise ConfigError(f"key 'muon_adjust_lr': {args.muon_adjust_lr} scales Muon's update with the matrix size, "
                          f"which breaks {args.parametrization}'s width transfer; use spectral (the default under "
                          f"parametrization: {args.parametrization}) or parametrization: sp")
