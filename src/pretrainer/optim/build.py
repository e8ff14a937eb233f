"""The optimizer a run builds: AdamW with the usual pretraining parameter groups, or Muon for the hidden
matrices with AdamW for the rest (`optimizer: muon`)."""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch.distributed.tensor import DTensor

from ..config import ConfigError, OptimizerSettings, Parametrization, Scale
from ..config.names import parameter_name
from .muon import MuonAdamW

logger = logging.getLogger("pretrainer")
SP = Parametrization()


def parameter_groups(model: torch.nn.Module, weight_decay: float, exclude: frozenset = frozenset()) -> list[dict]:
    """Decay matrices, never biases, norm weights or embeddings; `exclude`: ids another group takes. DTensor and
    plain parameters (tensor parallelism leaves some whole) get separate groups: one fused kernel takes one kind."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay, seen = [], [], set(exclude)
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if _dims(param) < 2 or id(param) in embedding_params else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kinds = {isinstance(p, DTensor) for group in groups for p in group["params"]}
    if len(kinds) == 1:
        return groups
    return [{**group, "params": [p for p in group["params"] if isinstance(p, DTensor) == kind]}
            for kind in (True, False) for group in groups]


def split_by_scale(groups: list[dict], lr: float, settings: OptimizerSettings, scales: dict | None) -> list[dict]:
    """Each group split by its parameters' parametrization factors (`scales`, by id); unchanged without any."""
    if not scales:
        return groups
    split = []
    for group in groups:
        by_scale: dict[Scale, list] = {}
        for param in group["params"]:
            by_scale.setdefault(scales.get(id(param), Scale()), []).append(param)
        split += [scaled_group({**group, "params": params}, lr, settings, scale) for scale, params in by_scale.items()]
    return split


def scaled_group(group: dict, lr: float, settings: OptimizerSettings, scale: Scale) -> dict:
    """`group` with its parametrization's factors; `lr_factor` tells the logged lr (the schedule's) from the group's."""
    if scale == Scale():
        return group
    return {**group, "lr": lr * scale.lr, "eps": settings.eps * scale.eps, "lr_factor": scale.lr,
            "weight_decay": group["weight_decay"] * scale.weight_decay}


def _dims(param: torch.Tensor) -> int:
    return len(getattr(param, "ds_shape", param.shape))  # a ZeRO-3 parameter's own shape, not its empty stub


def muon_parameters(model: torch.nn.Module, settings) -> dict[int, str]:
    """The trained parameters Muon updates, by id, with their names (docs/optimization.md, 'Muon'). `model`: the
    model as built (unwrapped), whose modules say which are embeddings and the head."""
    named = {id(param): (parameter_name(name), param) for name, param in model.named_parameters()
             if param.requires_grad}
    table = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        table.add(id(head.weight))
    chosen = {key for key, (_, param) in named.items() if _dims(param) >= 2 and key not in table}
    for key_name, patterns, add in (("muon_params", settings.muon_params, True),
                                    ("adamw_params", settings.adamw_params, False)):
        for pattern in patterns:
            matched = {key for key, (name, _) in named.items() if fnmatch.fnmatchcase(name, pattern)}
            if not matched:
                examples = ", ".join(name for name, _ in list(named.values())[:4])
                raise ConfigError(f"{key_name}: pattern {pattern!r} matches no trained parameter; names look like "
                                  f"{examples}")
            flat = [named[key][0] for key in matched if _dims(named[key][1]) < 2]
            if add and flat:
                raise ConfigError(f"muon_params: {pattern!r} matches {flat[0]}, which is not a matrix; Muon "
                                  "updates matrices only (biases and norms stay on AdamW)")
            moved = sorted(named[key][0] for key in matched & table) if add else []
            if moved:  # allowed (some recipes do it), but not what "Muon for hidden matrices" means
                logger.warning("muon_params %r moves %s onto Muon: the embedding and output head are not hidden "
                               "matrices and stay on AdamW unless named here", pattern, ", ".join(moved))
            chosen = chosen | matched if add else chosen - matched
    return {key: named[key][0] for key in chosen}


def build_optimizer(model: torch.nn.Module, settings: OptimizerSettings, device: torch.device,
                    parametrization: Parametrization = SP, roles: dict | None = None
                    ) -> torch.optim.Optimizer:
    """`model`: the model as built (an engine's wrapper taken off); its parameters are the trained ones. `roles`: each
    trained parameter's role by id (models/parametrization.py), which `parametrization` turns into lr factors."""
    # The fused kernel is the fastest on GPUs and on CPUs (5x the foreach one for a 5M-parameter model).
    fused = device.type in ("cuda", "cpu")
    kernel = {"fused": fused or None, "foreach": None if fused else True}
    adamw = {"lr": settings.lr, "betas": settings.betas, "eps": settings.eps, **kernel}
    if settings.muon is None:
        scales = {key: parametrization.scale(role) for key, role in (roles or {}).items()}
        groups = split_by_scale(parameter_groups(model, settings.weight_decay), settings.lr, settings, scales)
        return torch.optim.AdamW(groups, **adamw)
    muon = settings.muon
    chosen = muon_parameters(model, muon)
    matrices = [p for p in dict.fromkeys(model.parameters()) if id(p) in chosen]
    scales = {key: parametrization.scale(role, muon=key in chosen) for key, role in (roles or {}).items()}
    groups = split_by_scale([{"params": matrices, "muon": True, "lr": muon.lr, "weight_decay": settings.weight_decay}],
                            muon.lr, settings, scales)
    groups += split_by_scale(parameter_groups(model, settings.weight_decay, frozenset(chosen)), settings.lr, settings,
                             scales)
    return MuonAdamW(groups, momentum=muon.momentum, nesterov=muon.nesterov, ns_steps=muon.ns_steps,
                     adjust_lr=muon.adjust_lr, ns_dtype=muon.ns_dtype, **adamw)
