"""Each trained parameter's role for `parametrization` (config/parametrization.py): the input embedding, the output
head, the query projection, a residual branch's last projection, another hidden matrix, or a vector (norms, biases).

Roles are read off the model as built: its embedding modules and its output embeddings, and the projection names the
decoder families share (`q_proj`; `o_proj` / `out_proj` after attention, `down_proj` / `fc2` / `w2` / `c_proj` in the
MLP and in experts). An MoE router (`gate`, `router`) maps the width to a fixed number of experts, as the head maps it
to the vocabulary, and is scaled as the head is.
"""

from __future__ import annotations

import torch

from ..config import ConfigError, Parametrization
from ..config.names import parameter_name

QUERY = ("q_proj",)
ATTENTION = ("self_attn", "attention", "attn")  # a `dense` under these is the attention's output projection
HEAD_NORMS = ("model.norm.weight",)  # the final norm before the head (and each MTP depth's, matched below)
ROUTER = ("gate", "router")  # an MoE router: a fixed number of outputs (the experts) from the width, as the head
BRANCH_OUT = ("o_proj", "out_proj", "down_proj", "fc2", "w2", "c_proj", "dense_4h_to_h")


def parameter_roles(model: torch.nn.Module, tied: bool = False) -> dict[str, str]:
    """Every trained parameter's name (as `parameter_name` writes it) and role. `tied`: the head is the input
    embedding's table (on every pipeline stage that holds a copy), and the norm before it is the output's gain."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output = id(head.weight) if head is not None else None
    roles = {}
    for name, param in model.named_parameters():
        shape = getattr(param, "ds_shape", param.shape)  # a ZeRO-3 parameter's own shape, not its empty stub
        parts = name.split(".")  # the module's name, or a fused expert tensor's own (experts.down_proj)
        owner = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
        if id(param) == output and tied:
            role = "embedding"
        elif id(param) == output or (len(shape) == 2 and owner in ROUTER):
            role = "output"
        elif id(param) in tables:
            role = "embedding"
        elif tied and (parameter_name(name) in HEAD_NORMS or name.endswith("shared_head.norm.weight")):
            role = "output_gain"
        elif len(shape) < 2:
            role = "query_bias" if owner in QUERY else "vector"
        elif owner in QUERY:
            role = "query"
        elif owner in BRANCH_OUT or (owner == "dense" and len(parts) > 2 and parts[-3] in ATTENTION):
            role = "branch_out"
        else:
            role = "hidden"
        roles[parameter_name(name)] = role
    return roles


def check_folds(model: torch.nn.Module, roles: dict[str, str], parametrization: Parametrization) -> None:
    """Refuse a model where a multiplier cannot be folded into a weight as this module folds it."""
    names = set(roles)
    if parametrization.tied:
        norms = [m for n, m in model.named_modules() if roles.get(parameter_name(f"{n}.weight")) == "output_gain"]
        if not norms:
            raise ConfigError("key 'parametrization': this model ties its head to the input embedding and has no "
                              "final norm weight (model.norm) to carry muP's output multiplier; untie them in its "
                              "config.json")
        if any("Gemma" in type(m).__name__ for m in norms):  # x * (1 + w), w from 0: no factor scales it
            raise ConfigError("key 'parametrization': this model's final norm scales by (1 + weight), which cannot "
                              "carry muP's multiplier of its tied head; untie the embeddings in its config.json")
    if parametrization.head_dim_ratio != 1.0:
        if "query" not in roles.values():
            raise ConfigError("key 'mup_base_head_dim': the attention scale folds into a separate query projection "
                              "(q_proj), which this model does not have; leave mup_base_head_dim out")
        if any(name.endswith("q_norm.weight") for name in names):
            raise ConfigError("key 'mup_base_head_dim': this model normalises its queries (q_norm), which undoes a "
                              "scale folded into q_proj; leave mup_base_head_dim out")


def init_scales(model: torch.nn.Module, parametrization: Parametrization) -> dict[str, float]:
    """The init std factor of every parameter whose init the parametrization changes, by name."""
    if parametrization.kind == "sp":
        return {}
    roles = parameter_roles(model, parametrization.tied)
    check_folds(model, roles, parametrization)
    scales = {name: parametrization.scale(role).init for name, role in roles.items()}
    return {name: factor for name, factor in scales.items() if factor != 1.0}


def trained_roles(model: torch.nn.Module, parametrization: Parametrization) -> dict[int, str]:
    """The role of every trained parameter, by id, for the optimizer's groups (none under `sp`)."""
    if parametrization.kind == "sp":
        return {}
    roles = parameter_roles(model, parametrization.tied)
    check_folds(model, roles, parametrization)
    return {id(param): roles[parameter_name(name)] for name, param in model.named_parameters() if param.requires_grad}
