"""The parallel dimensions of a run: how its processes split into data-parallel replicas and the groups that hold one
replica together. Built once (by the run's engine, from its settings and the launch) and read everywhere: the engines'
meshes, the data placement, the global batch, the planner.

    world_size = dp x pp x cp x tp        dp x cp = replicate x shard

- `tp`, `pp`: tensor and pipeline parallelism (the megatron engine);
- `cp`: context parallelism, every sequence split over `cp` ranks (ddp, fsdp, megatron);
- `dp`: replicas that read different batches;
- `shard`: of the dp x cp ranks holding the same parameters, how many split one copy of the sharded state (FSDP's
  parameters, ZeRO's optimizer state, Megatron's distributed optimizer; 1: unsharded), the rest replicas (`replicate`);
- `ep`: expert parallelism: the routed experts of every MoE layer are split over `ep` consecutive ranks taken from the
  data-parallel ones (as torchtitan and Megatron do), each rank holding experts / ep of them (`expert_replicas`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    shard: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "shard", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel dimension {name} must be a positive integer, got {value!r}")
        if self.world_size % self.replica_ranks:
            raise ConfigError(f"{self.world_size} process(es) cannot be split into groups of tp={self.tp} x pp="
                              f"{self.pp} x context_parallel_degree={self.cp} ranks; launch a multiple of "
                              f"{self.replica_ranks}")
        if self.dp % self.ep:
            raise ConfigError(f"key 'expert_parallel_degree': {self.ep} does not divide the {self.dp} data-parallel "
                              f"rank(s) (the experts are split over ranks taken from them); use a divisor of "
                              f"{self.dp} or launch a multiple of {self.ep * self.replica_ranks} processes")
        if self.gradient_ranks % self.shard:
            raise ConfigError(f"the {self.gradient_ranks} rank(s) holding the same parameters cannot be sharded in "
                              f"groups of {self.shard}")

    @property
    def replica_ranks(self) -> int:
        """Ranks that hold one model replica together and read the same batches: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: they read different batches."""
        return self.world_size // self.replica_ranks

    @property
    def replicate(self) -> int:
        """Copies of the sharded state among the ranks holding the same parameters."""
        return self.gradient_ranks // self.shard

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts (whose expert gradients are reduced together): dp x cp / ep."""
        return self.gradient_ranks // self.ep

    @property
    def gradient_ranks(self) -> int:
        """Ranks holding the same parameters, whose gradients are reduced together: dp x cp."""
        return self.dp * self.cp

    @property
    def vocab_multiple(self) -> int:
        """What the vocabulary must divide into: tp (the embedding and head are split by vocabulary rows)."""
        return self.tp

    def check_claimed_dp(self, claimed: int) -> None:
        """The config's `dp` is a claim about the launch (the seed never checks it); a mismatch would silently
        change the global batch, so it is refused."""
        if claimed == self.dp:
            return
        split = f" / tp x pp x cp = {self.replica_ranks}" if self.replica_ranks > 1 else ""
        hint = (" (e.g. torchrun --nproc_per_node N; `accelerate launch` with a MULTI_CPU config starts only one "
                "process on CPU)" if self.world_size == 1 else "")
        raise ConfigError(f"key 'dp': dp={claimed} does not match the launch: {self.world_size} process(es){split} "
                          f"gives dp={self.dp}. Set dp: {self.dp} (or add `dp={self.dp}` on the command line), or "
                          f"launch a matching number of processes{hint}.")

    def describe(self) -> str:
        return " ".join([f"world={self.world_size}", f"dp={self.dp}"] + [
            f"{name}={getattr(self, name)}" for name in ("shard", "tp", "pp", "cp", "ep") if getattr(self, name) > 1])


def divisors(n: int, limit: int) -> list[int]:
    """The divisors of `n` up to `limit`, ascending (degrees a layout may split `n` ranks or rows into)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
