"""The deepspeed engine's traits and cost model (parallel/layout.py's questions): ZeRO's model states and buckets, a
step's collectives, the heap ZeRO-3's gathers leave on a CPU, and the ZeRO stages and offloads it offers for a world."""

from __future__ import annotations

import importlib.util

from ..config import ParallelDims
from .deepspeed_config import DeepSpeedSettings
from .layout import Collective, CostModel, EngineTraits, Layout, ModelStates, RankShare, compute_bytes

# On CPU, ZeRO-3's per-layer gathers leave the heap far above the live tensors (see fsdp_plan.py): a multiple of
# the model's fp32 bytes, with full recompute and without, measured on bench/plan_accuracy.py's 27M model.
CPU_GATHER_RETENTION = {"full": 3.6, "other": 4.1}


class DeepSpeedTraits(EngineTraits):
    trains_muon = False
    muon_refusal = ("ZeRO hands its optimizer flat fp32 partitions, not matrices, so Newton-Schulz cannot see a "
                    "matrix's shape (DeepSpeed's own Muon trains stage 0 as SGD and skips Muon on its bf16 path).")

    @classmethod
    def parallel_dims(cls, world_size: int, cp: int, settings: DeepSpeedSettings) -> ParallelDims:
        """Every rank is a data-parallel replica; ZeRO stages 1-3 shard state over all of them."""
        return ParallelDims(world_size, cp=cp, shard=world_size if settings.zero_stage >= 1 else 1)

    @classmethod
    def reads_weight_slices(cls, settings: DeepSpeedSettings) -> bool:
        return settings.zero_stage == 3  # ZeRO-3 partitions module by module; stages 1-2 build the whole model


class DeepSpeedCosts(CostModel):
    traits = DeepSpeedTraits
    baseline_engine = "deepspeed"  # DeepSpeed's own imports and buffers are part of every rank's runtime
    baseline_overrides = {"deepspeed": {"zero_optimization": {"stage": 2}}}

    @classmethod
    def autocasts(cls, layout: Layout) -> bool:
        return False  # DeepSpeed holds the weights in the compute dtype itself

    @classmethod
    def model_states(cls, layout: Layout, shape, share: RankShare, on_cpu: bool) -> ModelStates:
        """Counted as DeepSpeed's estimators do (docs/plan.md, 'How the prediction is made'); fp32 runs count the
        16-bit weights and gradients as 4 bytes."""
        settings, dp, c = layout.settings, layout.dims.dp, compute_bytes(layout.dtype)
        stage, n, t = settings.zero_stage, share.parameters, share.trained
        largest_layer = max(shape.layer_parameters, shape.embedding_parameters, shape.head_parameters)
        weights, working = (c * n, 0) if stage < 3 else (c * n // dp, 4 * largest_layer)
        partition = dp if stage >= 1 else 1
        grads = {0: c * t, 1: c * t, 2: c * t // dp, 3: 0}[stage] + 4 * t // partition
        optimizer = 12 * t // partition
        comm = c * min(settings.buffer("reduce_bucket_size"), t)
        if stage < 3:
            comm += c * min(settings.buffer("allgather_bucket_size"), n)
        else:
            comm += (c * min(settings.buffer("stage3_prefetch_bucket_size"), n)
                     + c * min(settings.buffer("stage3_max_live_parameters"), n - n // dp))
        notes = {"parameters": f"{'16-bit' if c < 4 else 'fp32'} weights" + (" shards + the largest live layer"
                                                                            if stage == 3 else ""),
                 "gradients": ("16-bit gradients and the fp32 gradient partition" if c < 4 else
                               "gradients and their partition"),
                 "optimizer": "fp32 master weights and AdamW moments" + (" (partitioned)" if stage else ""),
                 "communication": "reduce and all-gather buckets" if stage < 3 else
                 "reduce and prefetch buckets, parameters kept gathered (stage3_max_live_parameters)"}
        offload = 0
        if settings.offloads("optimizer") and not on_cpu:
            offload += optimizer + grads
            optimizer, grads = 0, 0
            notes["optimizer"] += ", on the host"
        if settings.offloads("param") and stage == 3 and not on_cpu:
            offload += c * n // dp
            weights, working = 0, 4 * largest_layer
        return ModelStates(weights, working, grads, optimizer, comm, offload, notes)

    @classmethod
    def gradient_traffic(cls, layout: Layout, shape, trained: int) -> list[Collective]:
        """Gradients reduced over replicas in the compute dtype; ZeRO-3 gathers all parameters twice per micro-batch."""
        dp, c = layout.dims.dp, compute_bytes(layout.dtype)
        traffic = [Collective(2 * c * trained, dp, overlaps=True)]  # bucketed as backward produces them
        if layout.settings.zero_stage == 3:  # prefetched a few layers ahead
            traffic.append(Collective(2 * c * shape.parameters, dp, per_micro_batch=True, overlaps=True))
        return traffic

    # returns_freed_blocks stays False: the heap that keeps them is predicted closer (docs/plan.md, 'Accuracy')

    @classmethod
    def cpu_gather_retention(cls, layout: Layout) -> float:
        gathers = layout.settings.zero_stage == 3 and layout.dims.dp != 1
        return CPU_GATHER_RETENTION["full" if layout.recompute == "full" else "other"] if gathers else 0.0

    @classmethod
    def offloads_to_host(cls, layout: Layout) -> bool:
        return layout.settings.offloads("optimizer")

    @classmethod
    def layout_variants(cls, world_size: int, devices_per_node: int, shape, seq_length: int) -> list[dict]:
        if world_size == 1 or importlib.util.find_spec("deepspeed") is None:
            return []
        settings = [DeepSpeedSettings.for_zero(stage, offload) for stage in (1, 2, 3) for offload in (False, True)]
        settings.append(DeepSpeedSettings.for_zero(3, True, True))
        return [{"dims": cls.traits.parallel_dims(world_size, 1, s), "settings": s} for s in settings]

    @classmethod
    def settings_overrides(cls, layout: Layout) -> list[str]:
        settings = layout.settings
        offload = "".join(f", offload_{kind}: {{device: cpu}}" for kind in ("optimizer", "param")
                          if settings.offloads(kind))
        return [f"deepspeed={{zero_optimization: {{stage: {settings.zero_stage}{offload}}}}}"]

    @classmethod
    def describe_settings(cls, layout: Layout) -> str:
        settings = layout.settings
        return (f"zero={settings.zero_stage}" + (" offload_optimizer" if settings.offloads("optimizer") else "")
                + (" offload_parameters" if settings.offloads("param") else ""))
