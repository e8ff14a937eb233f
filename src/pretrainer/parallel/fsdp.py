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
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh

from ..config import ConfigError, ParallelDims
from .activation_checkpoint import decoder_layers
from .ddp import context_parallel_degrees
from .distributed import DistributedEngine
from .expert_parallel import shard_experts
from .layout import Collective, Layout, ModelStates, RankShare, compute_bytes, optimizer_bytes, optimizer_note
from .parallelize import ExpertSharding, parallelize, shard_layers

logger = logging.getLogger(__name__)

# On CPU, FSDP's per-layer gathers leave the heap far above the live tensors: activations are carved out of
# the freed layer-sized buffers, so the next gather cannot reuse them and glibc's heap grows until a rank
# holds about what a DDP rank does. A multiple of the model's fp32 bytes, with full recompute and without,
# measured on bench/plan_accuracy.py's 27M model (2 ranks) and checked on its 5M and 82M models.
CPU_GATHER_RETENTION = {"full": 2.9, "other": 1.6}


@dataclass(frozen=True)
class FSDPSettings:
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    shard_size: int | None = None   # ranks per shard group (hybrid sharding); None: all of them


class FSDPEngine(DistributedEngine):
    name = "fsdp"
    shards_parameters = True
    supports_context_parallel = True
    supports_expert_parallel = True

    def __init__(self, options, world):
        super().__init__(options, world)
        dims = self.dims
        if dims.shard == dims.world_size:
            self.mesh = init_device_mesh(self.device.type, (dims.world_size,), mesh_dim_names=("shard",))
        else:
            self.mesh = init_device_mesh(self.device.type, (dims.world_size // dims.shard, dims.shard),
                                         mesh_dim_names=("replicate", "shard"))
        # expert parallelism: ep consecutive ranks split the experts; the ranks holding the same ones shard them
        self.expert_mesh = None
        if dims.ep > 1:
            self.expert_mesh = init_device_mesh(self.device.type, (dims.expert_replicas, dims.ep),
                                                mesh_dim_names=("expert_shard", "ep"))

    @classmethod
    def read_settings(cls, args, model_config, world_size: int, dtype: str) -> FSDPSettings:
        if args.expert_parallel_degree > 1 and args.fsdp_shard_size not in (None, world_size):
            raise ConfigError("key 'fsdp_shard_size': hybrid sharding with expert_parallel_degree > 1 is not "
                              "supported yet; shard over all ranks (fsdp_shard_size: null)")
        return FSDPSettings(args.fsdp_reshard_after_forward, args.fsdp_cpu_offload, args.fsdp_shard_size)

    @classmethod
    def parallel_dims(cls, world_size: int, cp: int, settings: FSDPSettings) -> ParallelDims:
        """1-D: shard over all ranks. 2-D (hybrid): replicate across groups of `shard_size`, shard within."""
        shard = settings.shard_size or world_size
        if world_size % shard:
            raise ConfigError(f"key 'fsdp_shard_size': {shard} does not divide the {world_size} processes")
        return ParallelDims(world_size, cp=cp, shard=shard)

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
                                         self.dims.expert_replicas / self.gradient_average_size))

        def shard(module: torch.nn.Module) -> torch.nn.Module:
            place(module)
            expert_sharding = ExpertSharding(experts, self.expert_mesh["expert_shard"]) if experts else None
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

    def gradient_group_size(self, model: torch.nn.Module) -> int:
        return self.mesh.size()  # reduce-scattered over the shards, all-reduced over the replicas

    def shard_group_size(self) -> int:
        return self.mesh["shard"].size()

    def describe(self) -> str:
        mesh = mesh_text(self.mesh) + (f", experts: {mesh_text(self.expert_mesh)}" if self.expert_mesh else "")
        return (super().describe() + f" mesh=({mesh}) reshard_after_forward={self.reshard_after_forward}"
                f" cpu_offload={self.cpu_offload}")

    # ---- the planner's questions ----
    @classmethod
    def reads_weight_slices(cls, settings) -> bool:
        return True

    @classmethod
    def autocasts(cls, layout: Layout) -> bool:
        return False

    @classmethod
    def model_states(cls, layout: Layout, shape, share: RankShare, on_cpu: bool) -> ModelStates:
        """fp32 shards; the layers being computed gathered in the compute dtype (every layer, from forward to
        backward, without resharding); sharded gradients plus one layer's whole gradient before its reduce-
        scatter, whole while micro-batches accumulate; sharded AdamW moments."""
        settings, shards = layout.settings, layout.dims.shard
        n, t, c = share.parameters, share.trained, compute_bytes(layout.dtype)
        root = shape.embedding_parameters + shape.head_parameters + shape.other_parameters
        # expert parallelism: a rank gathers only its own experts (1 / ep of them); every state stays sharded
        layer = shape.layer_parameters - _not_held_experts(layout, shape.layer_expert_parameters)
        whole = n - _not_held_experts(layout, shape.expert_parameters)
        notes = {"optimizer": optimizer_note(layout, "sharded")}
        if settings.reshard_after_forward:
            gathered = c * max(2 * layer, root + layer)
            notes["parameters"] = "fp32 shards + the gathered layers being computed"
        else:
            gathered = c * (whole - n // shards)
            notes["parameters"] = "fp32 shards + every layer gathered from forward to backward"
        if layout.dims.ep > 1:
            notes["parameters"] += f" (of the experts, this rank's 1/{layout.dims.ep})"
        weights, grads, optimizer = 4 * n // shards, 4 * t // shards, optimizer_bytes(share) // shards
        grads += 4 * layer
        if layout.accumulation > 1:
            grads += 4 * (whole - n + t) - 4 * t // shards
            notes["gradients"] = "unsharded while micro-batches accumulate"
        offload = 0
        if settings.cpu_offload and not on_cpu:
            offload = weights + 4 * t // shards + optimizer
            weights, optimizer = 0, 0
            grads -= 4 * t // shards
        return ModelStates(weights, gathered, grads, optimizer, 0, offload, notes)

    @classmethod
    def gradient_traffic(cls, layout: Layout, shape, trained: int) -> list[Collective]:
        """Each micro-batch gathers every layer (twice when resharded after forward); gradients are
        reduce-scattered once."""
        shards, c = layout.dims.shard, compute_bytes(layout.dtype)
        gathers = 2 if layout.settings.reshard_after_forward else 1
        experts = shape.expert_parameters if layout.dims.ep > 1 else 0  # gathered and reduced apart, see below
        traffic = [Collective(gathers * c * (shape.parameters - experts), shards, per_micro_batch=True),
                   Collective(4 * (trained - experts), shards)]
        if experts:  # each rank's experts (1 / ep), over the ranks holding the same ones
            replicas = layout.dims.expert_replicas
            traffic += [Collective(gathers * c * experts / layout.dims.ep, replicas, layout.dims.ep, True),
                        Collective(4 * experts / layout.dims.ep, replicas, layout.dims.ep)]
        return traffic

    @classmethod
    def muon_gather_ranks(cls, layout: Layout) -> int:
        return layout.dims.shard

    @classmethod
    def cpu_gather_retention(cls, layout: Layout) -> float:
        if layout.dims.shard == 1:
            return 0.0
        return CPU_GATHER_RETENTION["full" if layout.recompute == "full" else "other"]

    @classmethod
    def offloads_to_host(cls, layout: Layout) -> bool:
        return layout.settings.cpu_offload

    @classmethod
    def layout_variants(cls, world_size: int, devices_per_node: int, shape, seq_length: int) -> list[dict]:
        if world_size == 1:
            return []
        whole = cls.parallel_dims(world_size, 1, FSDPSettings())
        variants = [{"dims": whole, "settings": FSDPSettings(reshard, offload)}
                    for reshard in (True, False) for offload in (False, True)]
        # an MoE model's experts split over ep of the ranks (each ep dividing the experts and the world)
        splits = [ep for ep in range(2, world_size + 1) if shape.experts % ep == 0 and world_size % ep == 0]
        variants += [{"dims": dataclasses.replace(whole, ep=ep), "settings": FSDPSettings()}
                     for ep in (splits if shape.experts else [])]
        return variants + [{"dims": cls.parallel_dims(world_size, cp, FSDPSettings()), "settings": FSDPSettings()}
                           for cp in context_parallel_degrees(world_size, seq_length)[1:]]

    @classmethod
    def settings_overrides(cls, layout: Layout) -> list[str]:
        return [f"fsdp_reshard_after_forward={str(layout.settings.reshard_after_forward).lower()}",
                f"fsdp_cpu_offload={str(layout.settings.cpu_offload).lower()}"]

    @classmethod
    def describe_settings(cls, layout: Layout) -> str:
        settings = layout.settings
        return f"reshard={settings.reshard_after_forward}" + (" cpu_offload" if settings.cpu_offload else "")


def mesh_text(mesh) -> str:
    return " x ".join(f"{name}={size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape))


def _not_held_experts(layout: Layout, experts: int) -> int:
    """Of `experts` parameters, those a rank never gathers under expert parallelism (the other ranks' experts)."""
    return experts - experts // layout.dims.ep
