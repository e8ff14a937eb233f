"""How a checkpoint's model and optimizer state is written and read (checkpoint.py decides when and where).

Torch-native engines: torch.distributed.checkpoint over model and optimizer state dicts as laid out (DTensor shards,
pipeline stages), optimizer state keyed by parameter name, so ranks save the parameters they hold and a checkpoint loads
on any layout or engine. An engine with its own `checkpoint_format` (DeepSpeed's ZeRO shards) handles it itself.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

DCP = "dcp"  # torch.distributed.checkpoint: what every torch-native engine writes, reshardable onto any layout
KEYED_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
KEYED_BY_POSITION = StateDictOptions()  # how checkpoints were written before pipeline ranks needed names


def save_state(engine, folder, model: torch.nn.Module, optimizer) -> None:
    """Write model and optimizer state into `folder` (every rank takes part)."""
    if engine.checkpoint_format != DCP:
        engine.save_own_state(folder)
        return
    dcp.save(_state(model, optimizer, KEYED_BY_NAME), checkpoint_id=str(folder))


def save_state_async(engine, folder, model: torch.nn.Module, optimizer):
    """Stage the state in host memory and write it in the background; returns a future. Across processes the
    writer coordinates over its own gloo group, so its collectives never interleave with the loop's."""
    return dcp.async_save(_state(model, optimizer, KEYED_BY_NAME), checkpoint_id=str(folder),
                          process_group=engine.meshes.checkpoint())


def load_state(engine, folder, model: torch.nn.Module, optimizer) -> None:
    """Read model and optimizer state from `folder` into the laid-out model and optimizer, in place."""
    if engine.checkpoint_format != DCP:
        engine.load_own_state(folder)
        return
    state = _state(model, optimizer, KEYED_BY_NAME)
    options = KEYED_BY_NAME if _holds_keys(folder, state) else KEYED_BY_POSITION
    if options is KEYED_BY_POSITION:
        state = _state(model, optimizer, options)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)


def load_model_weights(folder, model: torch.nn.Module) -> None:
    """Only the model's weights (export and evaluation of a torch-native engine's checkpoint)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])


def _state(model: torch.nn.Module, optimizer, options: StateDictOptions) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state}


def _holds_keys(folder, state: dict) -> bool:
    """Whether the checkpoint keys optimizer state by parameter name as `state` does (read from its metadata)."""
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    groups = [key for key in state["optimizer"] if key.startswith("param_groups.")]
    return not groups or f"optimizer.{groups[0]}" in saved


def live_state(model: torch.nn.Module, optimizer) -> dict:
    """Model and optimizer state keyed by name, each tensor this rank's own part (a DTensor's local shard): what a
    replica group sends one that heals, whose ranks hold the same parts (train/replicas.py)."""
    state = _state(model, optimizer, KEYED_BY_NAME)
    return tree_map_only(DTensor, lambda tensor: tensor.to_local(), state)


def load_live_state(model: torch.nn.Module, optimizer, received: dict) -> None:
    """Put `live_state`'s parts, from a rank that holds the same parts, into the model and optimizer in place."""
    ours = _state(model, optimizer, KEYED_BY_NAME)

    def like(mine, theirs):
        if isinstance(mine, DTensor):
            return DTensor.from_local(theirs.to(mine.device), mine.device_mesh, mine.placements, shape=mine.shape,
                                      stride=mine.stride())
        return theirs.to(mine.device) if isinstance(mine, torch.Tensor) else theirs

    state = {part: {key: like(ours[part][key], value) if key in ours[part] else value
                    for key, value in received[part].items()} for part in ("model", "optimizer")}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=KEYED_BY_NAME)
