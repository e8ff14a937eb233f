"""The layouts of the same world that a run could use instead, ranked: those that fit first, best first.

Candidates keep the model, the sequence length, the dtype and the global batch (micro-batch x accumulation x
data-parallel replicas), and vary what each engine offers for this world (its `layout_variants`: ZeRO stage and
offload, FSDP resharding and offload, tp/pp/cp degrees and the megatron engine's data-parallel sharding), the
recomputation, and where gradients can be sharded, whether micro-batches accumulate them sharded or whole.
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
                for variant in entry.costs.layout_variants(layout.world_size, layout.devices_per_node, shape,
                                                         layout.seq_length)
                # an MoE model and multi-token prediction depths train whole sequences
                if not (shape.experts or shape.mtp_depths) or variant["dims"].cp == 1]
    variants.sort(key=lambda v: v["dims"].cp)  # the layouts of whole sequences first
    out = []
    for variant in variants:
        dims = variant["dims"]
        for micro, accumulation in _batch_splits(layout, dims.dp):
            if dims.pp > 1 and accumulation < dims.pp:
                continue
            for recompute in RECOMPUTE:
                fields = {"sequence_parallel": False, "pipeline_schedule": "1f1b", "settings": None, **variant}
                candidate = layout.replace(**fields, micro_batch=micro, accumulation=accumulation,
                                           recompute=recompute, loss_chunk=loss_chunk(micro), accumulate="unsharded")
                out.append(candidate)
                if accumulation > 1 and candidate.engine_class.shards_gradients(candidate.settings):
                    out.append(candidate.replace(accumulate="sharded"))  # each micro-batch reduce-scatters
    return out


def alternatives(layout: Layout, shape, config, device, loss_chunk, trainable="all",
                 weights="none") -> list[Estimate]:
    """Every candidate's estimate, ranked (see `ranked`)."""
    return ranked([estimate(candidate, shape, config, device, trainable, weights)
                   for candidate in candidate_layouts(layout, shape, loss_chunk) if candidate != layout])


# Predictions within this share of the fastest are a tie: the estimate is good to a few percent, not better.
TIE = 0.05
# Each parallelism beyond data parallelism (tp, pp, cp, ep, offloading) costs this share of the step when ranked:
# every extra dimension is more to tune and more to fail, and (cp, tp) shorter GEMMs than the estimate sees.
EXTRA_DIMENSION_COST = 0.03


def ranked(estimates: list[Estimate]) -> list[Estimate]:
    """Fitting layouts first, ties (TIE, EXTRA_DIMENSION_COST) simplest first, then the fastest; then those that do
    not fit, smallest first (docs/plan.md, 'How the prediction is made')."""
    fitting = sorted((e for e in estimates if e.fits), key=_ranked_seconds)
    best = _ranked_seconds(fitting[0]) if fitting else 0.0
    tied = [e for e in fitting if _ranked_seconds(e) <= best * (1 + TIE)]
    rest = [e for e in fitting if _ranked_seconds(e) > best * (1 + TIE)]
    tied.sort(key=lambda e: (_extra_dimensions(e.layout), e.peak))
    rest.sort(key=lambda e: (float(f"{_ranked_seconds(e):.3g}"), -e.layout.micro_batch, e.peak))
    return tied + rest + sorted((e for e in estimates if not e.fits), key=lambda e: e.peak)


def _extra_dimensions(layout: Layout) -> int:
    extra = sum(d > 1 for d in (layout.tp, layout.pp, layout.cp, layout.dims.ep))
    return extra + int(layout.costs.offloads_to_host(layout))


def _ranked_seconds(e: Estimate) -> float:
    return e.step_seconds * (1 + EXTRA_DIMENSION_COST * _extra_dimensions(e.layout))
