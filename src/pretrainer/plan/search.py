"""The layouts of the same world that a run could use instead, ranked: those that fit first, fastest first.

Candidates keep the model, the sequence length, the dtype and the global batch (micro-batch x accumulation x
data-parallel replicas), and vary what each engine offers for this world (its `layout_variants`: ZeRO stage and
offload, FSDP resharding and offload, tp/pp/cp degrees) and recomputation.
"""

from __future__ import annotations

from ..config.dims import divisors
from ..parallel import ENGINES, Layout
from .estimate import Estimate, estimate

RECOMPUTE = ("none", "selective", "full")


def _batch_splits(layout: Layout, dp: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs giving the layout's global batch over `dp` replicas."""
    per_replica, rest = divmod(layout.global_batch, dp)
    if rest or per_replica == 0:
        return []
    return [(mb, per_replica // mb) for mb in divisors(per_replica, 4 * layout.micro_batch)][-4:]


def candidate_layouts(layout: Layout, shape, loss_chunk) -> list[Layout]:
    """`loss_chunk(micro_batch)`: the chunk the run would resolve for that micro-batch."""
    variants = [{"engine": entry, **variant} for entry in ENGINES
                if layout.optimizer != "muon" or entry.cls.trains_muon
                if not shape.experts or entry.cls.trains_moe
                for variant in entry.cls.layout_variants(layout.world_size, layout.devices_per_node, shape,
                                                         layout.seq_length)
                if not shape.experts or variant["dims"].cp == 1]  # an MoE model trains whole sequences
    variants.sort(key=lambda v: v["dims"].cp)  # the layouts of whole sequences first
    out = []
    for variant in variants:
        dims = variant["dims"]
        for micro, accumulation in _batch_splits(layout, dims.dp):
            if dims.pp > 1 and accumulation < dims.pp:
                continue
            for recompute in RECOMPUTE:
                fields = {"sequence_parallel": False, "pipeline_schedule": "1f1b", "settings": None, **variant}
                out.append(layout.replace(**fields, micro_batch=micro, accumulation=accumulation, recompute=recompute,
                                          loss_chunk=loss_chunk(micro)))
    return out


def alternatives(layout: Layout, shape, config, device, loss_chunk, trainable="all",
                 weights="none") -> list[Estimate]:
    """Every candidate's estimate: those that fit, fastest first, then the rest, smallest first."""
    estimates = []
    for candidate in candidate_layouts(layout, shape, loss_chunk):
        if candidate == layout:
            continue
        estimates.append(estimate(candidate, shape, config, device, trainable, weights))
    return sorted(estimates, key=rank)


def rank(e: Estimate) -> tuple:
    """Fitting layouts first, fastest first (equal times: the larger micro-batch, then the smaller peak); the
    others smallest first."""
    if not e.fits:
        return (1, e.peak)
    return (0, float(f"{e.step_seconds:.3g}"), -e.layout.micro_batch, e.peak)
