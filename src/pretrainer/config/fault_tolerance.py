"""Replica fault tolerance (`fault_tolerance`), read once from the config: how many replica groups train the model,
where their lighthouse is, how few may go on, and how they stay in step (docs/checkpoints-and-faults.md, 'Replica
fault tolerance'). Which group a process belongs to comes from the launch (`--replica-group I`), not the config, so
every group runs the same file."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from .errors import ConfigError, key_error

KEY = "fault_tolerance"
MODES = ("sync", "diloco")
FIELDS = ("replica_groups", "lighthouse", "min_replicas", "mode", "sync_every", "outer_lr", "outer_momentum",
          "timeout_seconds", "params_digest_interval")
GROUP_ENV = "PRETRAINER_REPLICA_GROUP"  # the launcher's --replica-group, for its workers
EXAMPLE = "e.g. fault_tolerance: {replica_groups: 2, lighthouse: node0:29510, min_replicas: 1}"


@dataclass(frozen=True)
class FaultTolerance:
    replica_groups: int            # R: groups of the data-parallel replicate dimension
    lighthouse: str                # HOST:PORT of `pretrainer lighthouse`
    min_replicas: int = 1          # the fewest groups a step may commit with
    mode: str = "sync"             # sync: gradients averaged every step | diloco: outer step every sync_every
    sync_every: int = 8            # diloco's H
    outer_lr: float = 0.7          # diloco's outer Nesterov SGD
    outer_momentum: float = 0.9
    timeout_seconds: float = 60.0  # a collective, a quorum or a heal that takes longer counts as a failure
    params_digest_interval: int = 0  # every N logged steps a row carries params_sha256 (0: the last row only)

    def describe(self) -> str:
        mode = f"diloco (outer step every {self.sync_every} steps)" if self.mode == "diloco" else "sync"
        return (f"{self.replica_groups} replica groups, lighthouse {self.lighthouse}, at least {self.min_replicas} "
                f"per step, {mode}")


def read_fault_tolerance(raw) -> FaultTolerance | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise key_error(KEY, f"{KEY} is a mapping, {EXAMPLE}; got {raw!r}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise key_error(KEY, f"unknown key(s) {', '.join(map(str, unknown))} in {KEY}; it takes {', '.join(FIELDS)}")
    groups, lighthouse = raw.get("replica_groups"), raw.get("lighthouse")
    if not _whole(groups, 1):
        raise key_error(KEY, f"{KEY}.replica_groups must be a whole number >= 1, got {groups!r}; {EXAMPLE}")
    if not isinstance(lighthouse, str) or not re.fullmatch(r"[^\s:/]+:\d{1,5}", lighthouse) or \
            not 1 <= int(lighthouse.rsplit(":", 1)[1]) <= 65535:
        raise key_error(KEY, f"{KEY}.lighthouse must be HOST:PORT (HOST a name or an IPv4 address, PORT 1-65535), "
                        f"where `pretrainer lighthouse --bind HOST:PORT` listens, got {lighthouse!r}")
    settings = FaultTolerance(int(groups), lighthouse, **{key: raw[key] for key in FIELDS[2:] if key in raw})
    _check_numbers(settings)
    return settings


def _check_numbers(settings: FaultTolerance) -> None:
    if not _whole(settings.min_replicas, 1) or settings.min_replicas > settings.replica_groups:
        raise key_error(KEY, f"{KEY}.min_replicas must be a whole number from 1 to replica_groups "
                        f"({settings.replica_groups}), got {settings.min_replicas!r}")
    if settings.mode not in MODES:
        raise key_error(KEY, f"{KEY}.mode is one of {', '.join(MODES)}, got {settings.mode!r}")
    if not _whole(settings.sync_every, 1):
        raise key_error(KEY, f"{KEY}.sync_every must be a whole number >= 1, got {settings.sync_every!r}")
    for name in ("outer_lr", "timeout_seconds"):
        value = getattr(settings, name)
        if not _number(value) or not value > 0 or not math.isfinite(value):
            raise key_error(KEY, f"{KEY}.{name} must be a number > 0, got {value!r}")
    if not _number(settings.outer_momentum) or not 0 <= settings.outer_momentum < 1:
        raise key_error(KEY, f"{KEY}.outer_momentum must be in [0, 1), got {settings.outer_momentum!r}")
    if not _whole(settings.params_digest_interval, 0):
        raise key_error(KEY, f"{KEY}.params_digest_interval must be a whole number >= 0, got "
                        f"{settings.params_digest_interval!r}")


def replica_group(settings: FaultTolerance | None) -> int | None:
    """This process's replica group (from `--replica-group I`); None without fault tolerance."""
    raw = os.environ.get(GROUP_ENV)
    if settings is None:
        if raw is not None:
            raise ConfigError(f"--replica-group {raw}: the config has no fault_tolerance block; add one ({EXAMPLE}) "
                              "or drop --replica-group")
        return None
    if raw is None:
        raise ConfigError(f"{KEY} is set: start each replica group with `pretrainer train CONFIG --nproc-per-node N "
                          f"--replica-group I` (I from 0 to {settings.replica_groups - 1})")
    if not raw.isdigit() or int(raw) >= settings.replica_groups:
        raise ConfigError(f"--replica-group {raw}: groups are numbered 0..{settings.replica_groups - 1} "
                          f"(fault_tolerance.replica_groups: {settings.replica_groups})")
    return int(raw)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value, least: int) -> bool:
    return _number(value) and math.isfinite(value) and value == int(value) and value >= least
