"""The optimizer (AdamW, or Muon with AdamW) and the lr schedule, built from their settings (`config.optimization`)."""

from .build import build_optimizer, muon_parameters, parameter_groups
from .muon import MuonAdamW, orthogonalize
from .schedules import build_scheduler, lr_multiplier, realign_to_schedule

__all__ = ["MuonAdamW", "build_optimizer", "build_scheduler", "lr_multiplier", "muon_parameters", "orthogonalize",
           "parameter_groups", "realign_to_schedule"]
