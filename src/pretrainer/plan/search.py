"""The layouts of the same world that a run could use instead, ranked: those that fit first, fastest first.

Candidates keep the model, the sequence length, the dtype and the global batch (micro-batch x accumulation x
data-parallel replicas), and vary the engine, ZeRO stage and offload, FSDP resharding and offload, tp/pp/cp
degrees and recomputation.
"""

from __future__ import annotations

import importlib.util

from .estimate import Estimate, estimate
from .layout import Layout

RECOMPUTE = ("none", "selective", "full")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _batch_splits(layout: Layout, dp: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs giving the layout's global batch over `dp` replicas."""
    per_replica, rest = divmod(layout.global_batch, dp)
    if rest or per_replica == 0:
        return []
    return [(mb, per_replica // mb) for mb in _divisors(per_replica, 4 * layout.micro_batch)][-4:]


def candidate_layouts(layout: Layout, shape, loss_chunk) -> list[Layout]:
    """`loss_chunk(micro_batch)`: the chunk the run would resolve for that micro-batch."""
    world, per_node = layout.world_size, layout.devices_per_node
    base = dict(world_size=world, devices_per_node=per_node, seq_length=layout.seq_length, dtype=layout.dtype)
    shapes: list[dict] = []
    if world == 1:
        shapes.append(dict(engine="single"))
    else:
        shapes.append(dict(engine="ddp"))
        for reshard in (True, False):
            for offload in (False, True):
                shapes.append(dict(engine="fsdp", fsdp_reshard=reshard, fsdp_offload=offload))
        if importlib.util.find_spec("deepspeed") is not None or layout.engine == "deepspeed":
            for stage in (1, 2, 3):
                shapes.append(dict(engine="deepspeed", zero_stage=stage))
                shapes.append(dict(engine="deepspeed", zero_stage=stage, offload_optimizer=True))
            shapes.append(dict(engine="deepspeed", zero_stage=3, offload_optimizer=True, offload_parameters=True))
        tensor_parallel = [tp for tp in _divisors(min(per_node, 8), 8) if tp > 1 and not (
            shape.heads % tp or shape.kv_heads % tp or shape.intermediate % tp)]
        for tp in [1, *tensor_parallel]:
            for pp in _divisors(world // tp, 8):
                if tp * pp == 1 or pp > shape.layers or (pp > 1 and shape.tied):
                    continue
                shapes.append(dict(engine="megatron", tp=tp, pp=pp, sequence_parallel=tp > 1))
        for cp in (2, 4, 8):
            if world % cp or layout.seq_length % (2 * cp) or layout.seq_length // cp < 1024:
                continue
            shapes.append(dict(engine="fsdp", cp=cp))
            shapes.append(dict(engine="ddp", cp=cp))
            for tp in tensor_parallel:  # Megatron's long-context layout: tp within a node, cp across
                if world % (tp * cp) == 0:
                    shapes.append(dict(engine="megatron", tp=tp, cp=cp, sequence_parallel=True))
    out = []
    for parallel in shapes:
        dp = world // (parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1))
        for micro, accumulation in _batch_splits(layout, dp):
            if parallel.get("pp", 1) > 1 and accumulation < parallel["pp"]:
                continue
            for recompute in RECOMPUTE:
                out.append(Layout(**base, **parallel, micro_batch=micro, accumulation=accumulation,
                                  recompute=recompute, loss_chunk=loss_chunk(micro)))
    return out


def alternatives(layout: Layout, shape, config, device, loss_chunk, trainable="all",
                 checkpoint="none") -> list[Estimate]:
    """Every candidate's estimate: those that fit, fastest first, then the rest, smallest first."""
    estimates = []
    for candidate in candidate_layouts(layout, shape, loss_chunk):
        if candidate == layout:
            continue
        estimates.append(estimate(candidate, shape, config, device, trainable, checkpoint))
    return sorted(estimates, key=rank)


def rank(e: Estimate) -> tuple:
    """Fitting layouts first, fastest first (equal times: the larger micro-batch, then the smaller peak); the
    others smallest first."""
    if not e.fits:
        return (1, e.peak)
    return (0, float(f"{e.step_seconds:.3g}"), -e.layout.micro_batch, e.peak)
