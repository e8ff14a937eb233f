"""The cost model (parallel/layout.py's questions) of a whole model under fsdp (torch_backend.py's FSDP2 over every
rank): a rank's model states, a step's collectives, the heap FSDP's gathers leave on a CPU, and the layouts of a world
it offers (resharding, offload, ep, cp)."""

from __future__ import annotations

import dataclasses

from .context_parallel import context_parallel_degrees
from .layout import (
    Collective,
    CostModel,
    Layout,
    ModelStates,
    RankShare,
    compute_bytes,
    optimizer_bytes,
    optimizer_note,
)
from .megatron_settings import MegatronSettings
from .torch_plan import TorchTraits

# On CPU, FSDP's per-layer gathers leave the heap far above the live tensors (docs/plan.md, 'Accuracy'): a multiple
# of the model's fp32 bytes, measured on bench/plan_accuracy.py's 27M model (2 ranks), checked on its 5M and 82M.
CPU_GATHER_RETENTION = {"full": 2.9, "other": 1.6}


def sharded(reshard_after_forward: bool = True, cpu_offload: bool = False) -> MegatronSettings:
    """fsdp's settings: every state sharded over the data ranks (parameters resharded after forward or not)."""
    return MegatronSettings(distributed_optimizer=True, reshard_parameters=reshard_after_forward,
                            cpu_offload=cpu_offload)


class FSDPCosts(CostModel):
    traits = TorchTraits
    models_expert_parallel = True

    @classmethod
    def autocasts(cls, layout: Layout) -> bool:
        return False

    @classmethod
    def model_states(cls, layout: Layout, shape, share: RankShare, on_cpu: bool) -> ModelStates:
        """fp32 shards, gathered layers, sharded gradients and moments: docs/plan.md, 'How the prediction is made'."""
        settings, shards = layout.settings, layout.dims.shard
        n, t, c = share.parameters, share.trained, compute_bytes(layout.dtype)
        root = shape.embedding_parameters + shape.head_parameters + shape.other_parameters
        # expert parallelism: a rank gathers only its own experts (1 / ep of them); every state stays sharded
        layer = shape.layer_parameters - _not_held_experts(layout, shape.layer_expert_parameters)
        whole = n - _not_held_experts(layout, shape.expert_parameters)
        notes = {"optimizer": optimizer_note(layout, "sharded")}
        if settings.reshard_parameters:
            gathered = c * max(2 * layer, root + layer)
            notes["parameters"] = "fp32 shards + the gathered layers being computed"
        else:
            gathered = c * (whole - n // shards)
            notes["parameters"] = "fp32 shards + every layer gathered from forward to backward"
        if layout.dims.ep > 1:
            notes["parameters"] += f" (of the experts, this rank's 1/{layout.dims.ep})"
        weights, grads, optimizer = 4 * n // shards, 4 * t // shards, optimizer_bytes(share) // shards
        grads += 4 * layer
        if layout.accumulation > 1 and not layout.accumulates_sharded:
            grads += 4 * (whole - n + t) - 4 * t // shards
            notes["gradients"] = "unsharded while micro-batches accumulate"
        elif layout.accumulation > 1:
            notes["gradients"] = "sharded: reduce-scattered every micro-batch"
        offload = 0
        if settings.cpu_offload and not on_cpu:
            offload = weights + 4 * t // shards + optimizer
            weights, optimizer = 0, 0
            grads -= 4 * t // shards
        return ModelStates(weights, gathered, grads, optimizer, 0, offload, notes)

    @classmethod
    def gradient_traffic(cls, layout: Layout, shape, trained: int) -> list[Collective]:
        """Each micro-batch gathers every layer (twice when resharded after forward); gradients are reduce-scattered
        once a step, or every micro-batch when they accumulate sharded. All of it overlaps compute (prefetched)."""
        shards, c = layout.dims.shard, compute_bytes(layout.dtype)
        gathers = 2 if layout.settings.reshard_parameters else 1
        experts = shape.expert_parameters if layout.dims.ep > 1 else 0  # gathered and reduced apart, see below
        each = layout.accumulates_sharded
        traffic = [Collective(gathers * c * (shape.parameters - experts), shards, per_micro_batch=True, overlaps=True),
                   Collective(4 * (trained - experts), shards, per_micro_batch=each, overlaps=True)]
        if experts:  # each rank's experts (1 / ep), over the ranks holding the same ones
            replicas = layout.dims.expert_replicas
            traffic += [Collective(gathers * c * experts / layout.dims.ep, replicas, layout.dims.ep, True, True),
                        Collective(4 * experts / layout.dims.ep, replicas, layout.dims.ep, each, True)]
        return traffic

    @classmethod
    def muon_gather_ranks(cls, layout: Layout) -> int:
        return layout.dims.shard

    @classmethod
    def returns_freed_blocks(cls, layout: Layout) -> bool:
        return layout.dims.shard > 1

    @classmethod
    def cpu_gather_retention(cls, layout: Layout) -> float:
        gathers = layout.dims.shard != 1
        return CPU_GATHER_RETENTION["full" if layout.recompute == "full" else "other"] if gathers else 0.0

    @classmethod
    def offloads_to_host(cls, layout: Layout) -> bool:
        return layout.settings.cpu_offload

    @classmethod
    def layout_variants(cls, world_size: int, devices_per_node: int, shape, seq_length: int) -> list[dict]:
        if world_size == 1:
            return []
        whole = cls.traits.parallel_dims(world_size, 1, sharded())
        variants = [{"dims": whole, "settings": sharded(reshard, offload)}
                    for reshard in (True, False) for offload in (False, True)]
        # an MoE model's experts split over ep of the ranks (each ep dividing the experts and the world)
        splits = [ep for ep in range(2, world_size + 1) if shape.experts % ep == 0 and world_size % ep == 0]
        variants += [{"dims": dataclasses.replace(whole, ep=ep), "settings": sharded()}
                     for ep in (splits if shape.experts else [])]
        return variants + [{"dims": cls.traits.parallel_dims(world_size, cp, sharded()),
                            "settings": sharded()} for cp in context_parallel_degrees(world_size, seq_length)[1:]]

    @classmethod
    def settings_overrides(cls, layout: Layout) -> list[str]:
        return [f"fsdp_reshard_after_forward={str(layout.settings.reshard_parameters).lower()}",
                f"fsdp_cpu_offload={str(layout.settings.cpu_offload).lower()}"]

    @classmethod
    def describe_settings(cls, layout: Layout) -> str:
        settings = layout.settings
        return f"reshard={settings.reshard_parameters}" + (" cpu_offload" if settings.cpu_offload else "")


def _not_held_experts(layout: Layout, experts: int) -> int:
    """Of `experts` parameters, those a rank never gathers under expert parallelism (the other ranks' experts)."""
    return experts - experts // layout.dims.ep
