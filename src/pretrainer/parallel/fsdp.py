"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the data-parallel ranks.

Each decoder layer is its own unit (all-gathered just before use, resharded after), the root holds the
embeddings and head. A meta-device model is sharded first and materialised afterwards, so no rank ever
holds the whole model. `fsdp_shard_size` below the world gives hybrid sharding: shard within groups of
that many ranks, replicate across them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from ..config import ConfigError
from .activation_checkpoint import decoder_layers
from .distributed import DistributedEngine
from .expert_parallel import shard_experts
from .fsdp_plan import FSDPSettings, FSDPTraits
from .parallelize import ExpertSharding, parallelize, shard_layers

logger = logging.getLogger(__name__)


class FSDPEngine(FSDPTraits, DistributedEngine):
    """Its traits and its cost model (the planner's answers) are in fsdp_plan.py."""

    name = "fsdp"
    shards_parameters = True
    own_keys = (*DistributedEngine.own_keys, "fsdp_reshard_after_forward", "fsdp_cpu_offload", "fsdp_shard_size")

    def __init__(self, options, world, meshes):
        super().__init__(options, world, meshes)
        self.mesh = meshes.sharding()
        # expert parallelism: ep consecutive ranks split the experts; the ranks holding the same ones shard them
        self.expert_mesh = meshes.experts() if self.dims.ep > 1 else None

    @classmethod
    def read_settings(cls, args, model_config, world_size: int, dtype: str) -> FSDPSettings:
        if args.expert_parallel_degree > 1 and args.fsdp_shard_size not in (None, world_size):
            raise ConfigError("key 'fsdp_shard_size': hybrid sharding with expert_parallel_degree > 1 is not "
                              "supported yet; shard over all ranks (fsdp_shard_size: null)")
        return FSDPSettings(args.fsdp_reshard_after_forward, args.fsdp_cpu_offload, args.fsdp_shard_size)

    @property
    def reshard_after_forward(self) -> bool:
        return self.settings.reshard_after_forward

    @property
    def cpu_offload(self) -> bool:
        return self.settings.cpu_offload

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        experts: list[torch.nn.Module] = []

        def place(module: torch.nn.Module) -> None:
            if not any(p.is_meta for p in module.parameters()) and not self.cpu_offload:
                module.to(self.device)

        def split_experts(module: torch.nn.Module) -> None:
            place(module)
            # FSDP averages expert gradients over the dp / ep ranks holding the same experts, not over all dp
            experts.extend(shard_experts(module, self.expert_mesh["ep"],
                                         self.dims.expert_replicas / self.dims.gradient_ranks))

        def shard(module: torch.nn.Module) -> torch.nn.Module:
            place(module)
            expert_sharding = ExpertSharding(experts, self.expert_mesh["expert_replicas"]) if experts else None
            shard_layers(module, self.mesh, decoder_layers(module), self.precision, self.reshard_after_forward,
                         self.cpu_offload, expert_sharding)
            # offloaded shards live in host memory: materialise them there
            self.materialize_if_meta(module, torch.device("cpu") if self.cpu_offload else None)
            return module

        self.install_context_parallel(model)
        steps = self.parallelism(data_parallel=shard)
        if self.expert_mesh is not None:
            steps = dataclasses.replace(steps, expert_parallel=split_experts)
        return parallelize(model, steps)

    @property
    def exports_tensor_by_tensor(self) -> bool:
        # Shards offloaded to host memory cannot be gathered over an accelerator's process group one by one.
        return not (self.cpu_offload and self.device.type != "cpu")

    def autocast(self):
        return contextlib.nullcontext()  # FSDP's mixed-precision policy casts parameters itself

    def no_sync(self, model: torch.nn.Module):
        if self.options.accumulate == "sharded":  # every micro-batch reduce-scatters: gradients stay sharded
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def skip_reduce_scatter():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return skip_reduce_scatter()

    def release(self) -> None:
        super().release()
        self.mesh = self.expert_mesh = None

    def measured_gradient_ranks(self, model: torch.nn.Module) -> int:
        return self.mesh.size()  # reduce-scattered over the shards, all-reduced over the replicas

    def shard_group_size(self) -> int:
        return self.mesh["shard"].size()

    def describe(self) -> str:
        experts = f", experts: expert_replicas={self.dims.expert_replicas} x ep={self.dims.ep}" if self.expert_mesh \
            else ""
        mesh = mesh_text(self.mesh) + experts
        return (super().describe() + f" mesh=({mesh}) reshard_after_forward={self.reshard_after_forward}"
                f" cpu_offload={self.cpu_offload}")


def mesh_text(mesh) -> str:
    return " x ".join(f"{name}={size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape))
