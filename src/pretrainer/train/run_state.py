"""What a checkpoint keeps of a run beside the engine's model and optimizer state: registered components.

Each piece of saved state (the schedule, loss scaler, RNG, data position, counters, loss-spike history, whatever a later
feature adds) registers once: a key, how to read it, how to put it back. A component is either the run's (one value for
all ranks, JSON in `trainer_state.json`) or each rank's own (pickled into `extra_state_rank<R>.pt`). Adding saved state
is one `register` call: neither the loop nor the checkpointer changes. A checkpoint written before a component existed
loads the component's default; one with no default is required (its absence is an error naming the checkpoint).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import ConfigError

REQUIRED = object()  # a component without a default: every checkpoint holds it


@dataclass(frozen=True)
class Component:
    key: str
    state: Callable[[], Any]               # the value to save
    load: Callable[[Any], None]            # put a saved value back
    per_rank: bool = False                 # each rank's own (pickled) rather than the run's (JSON)
    default: Any = REQUIRED                # what a checkpoint written without it loads


class RunState:
    """The registered components of one run."""

    def __init__(self) -> None:
        self.components: dict[str, Component] = {}

    def register(self, key: str, state: Callable[[], Any], load: Callable[[Any], None], *, per_rank: bool = False,
                 default: Any = REQUIRED) -> None:
        if key in self.components:
            raise ValueError(f"saved state {key!r} is registered twice")
        self.components[key] = Component(key, state, load, per_rank, default)

    def saved(self, per_rank: bool) -> dict:
        """The values of the run's components (`per_rank` False) or of this rank's."""
        return {c.key: c.state() for c in self.components.values() if c.per_rank == per_rank}

    def restore(self, run_values: dict, rank_values: dict, where: str) -> None:
        """Put each component back from a checkpoint's values (`where`: the checkpoint, for messages)."""
        for component in self.components.values():
            values = rank_values if component.per_rank else run_values
            if component.key in values:
                component.load(values[component.key])
            elif component.default is not REQUIRED:
                component.load(component.default)
            else:
                raise ConfigError(f"{where} holds no {component.key!r} state; it was not written by this version's "
                                  "training loop. Start a new save_dir or set resume: none")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
