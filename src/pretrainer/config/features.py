"""The rules between keys and the feature switch each belongs to, in one table checked once at load (rules that also
depend on the engine are run/rules.py's, checked at resolve). A feature's keys take effect only when its switch is on
(e.g. Muon's settings with `optimizer: muon`): a key set to anything but its default while its feature is off is refused
in one line naming the key, the switch and how to turn it on, never silently ignored."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import key_error


@dataclass(frozen=True)
class Feature:
    keys: tuple[str, ...]               # the keys that belong to the feature
    switch: str                         # the key that turns it on
    is_on: Callable[[object, str], bool]  # (args, key): whether `key` takes effect
    role: str                           # what its keys do
    how: str                            # how to turn it on


FEATURES: tuple[Feature, ...] = (
    Feature(("muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_adjust_lr", "muon_ns_dtype",
             "muon_params", "adamw_params"), "optimizer", lambda a, key: a.optimizer == "muon",
            "a setting of the Muon optimizer", "set optimizer: muon"),
    # a cooldown branch decays in wsd_decay_shape whatever its parent's schedule
    Feature(("wsd_decay_fraction", "wsd_decay_tokens", "wsd_decay_shape"), "lr_decay_style",
            lambda a, key: a.lr_decay_style == "wsd" or (key == "wsd_decay_shape" and a.cooldown_from is not None),
            "it shapes the wsd schedule's decay", "set lr_decay_style: wsd"),
    Feature(("spike_window",), "spike_zscore", lambda a, key: a.spike_zscore is not None,
            "the window of spike_zscore's running statistics", "set spike_zscore (e.g. 6)"),
    Feature(("staging_dir", "checkpoint_failure"), "save_dir", lambda a, key: a.remote_save_dir is not None,
            "it applies to a save_dir URL's uploads, not to local saves",
            "give save_dir a URL (s3://bucket/run)"),
    Feature(("mtp_loss_coeff",), "mtp_num_layers", lambda a, key: bool(a.mtp_num_layers),
            "the weight of the multi-token prediction depths' loss", "set mtp_num_layers (e.g. 1)"),
    Feature(("moe_token_drop_policy",), "moe_capacity_factor", lambda a, key: a.moe_capacity_factor is not None,
            "which tokens an expert past its capacity drops (without a capacity none is dropped)",
            "set moe_capacity_factor (e.g. 1.25)"),
    Feature(("mup_base_hidden_size", "mup_base_head_dim", "mup_base_num_layers"), "parametrization",
            lambda a, key: a.parametrization == "completep" or (a.parametrization == "mup" and
                                                                key != "mup_base_num_layers"),
            "a base size the parametrization scales from",
            "set parametrization: mup (completep for mup_base_num_layers)"),
)


def check_features(args) -> None:
    """Refuse the first key set while its feature is off."""
    for feature in FEATURES:
        for key in feature.keys:
            if getattr(args, key) != args.default_of(key) and not feature.is_on(args, key):
                raise key_error(key, f"{key} is set but {feature.switch} is {getattr(args, feature.switch)!r}, so it "
                                f"has no effect ({feature.role}); {feature.how}, or remove {key}")
