"""Step time of a layout: each micro-batch's kernels timed from the device's rates, the collectives on the
links they cross, and what the engines overlap hidden behind compute (docs/plan.md, 'How the prediction is made').

The constants are set from published H100 measurements (bench/plan_vs_published.py prints the table, with its
sources, that docs/plan.md shows).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.layout import Layout, RankShare, compute_bytes
from .device_spec import CPU_MFU, DeviceSpec
from .elementwise import LayerTraffic
from .model_shape import ModelShape

# Fitted together on the published rows (bench/plan_vs_published.py): a training step's GEMMs reach about 55% of the
# rated peak at large micro-batches (cuBLAS alone: 70-80%; the rest: launch gaps, small optimizer/loss kernels, the data
# loader); torch.compile's fusion leaves 40% of the element-wise traffic (torchtitan: +16% tokens/s on 8B).
GEMM_PEAK_SHARE = 0.55       # of the rated dense peak
GEMM_HALF_TOKENS = 1024      # GEMM rows (tokens of a micro-batch on a rank) at which half of that is reached
ATTENTION_PEAK_SHARE = 0.35  # FlashAttention-2 forward and backward on H100 (about 35% of peak in its paper)
COMPILED_ELEMENTWISE = 0.4   # what torch.compile's fusion leaves of the element-wise traffic
MEMORY_EFFICIENCY = 0.8      # of the rated memory bandwidth, for streaming kernels
COLLECTIVE_EFFICIENCY = 0.8  # NCCL's bus bandwidth over the link's
OVERLAP_SHARE = 0.9          # of the compute that overlapped collectives can hide behind
BACKWARD_ATTENTION = 2.5     # flash attention's backward over its forward
SELECTIVE_RECOMPUTE_COST = 0.03  # on CPU: share of the step's compute (assumed)
HOST_ADAM_BYTES_PER_S = 10e9  # a host Adam step streams its states at about this rate (assumed)
OFFLOAD_BYTES_PER_S = 25e9   # host <-> device copies (assumed, PCIe 5-class)


@dataclass(frozen=True)
class StepTime:
    compute: float       # seconds of kernels per step on the rank
    communication: float  # seconds of collectives not hidden behind compute
    hidden: float = 0.0  # seconds of collectives overlapped with compute


def step_time(layout: Layout, shape: ModelShape, device: DeviceSpec, part: RankShare, state_bytes: int,
              trainable_share: float, traffic: LayerTraffic | None = None) -> StepTime:
    """`state_bytes`: the rank's weights, gradients and optimizer state (the optimizer step streams them);
    `traffic`: a layer's element-wise bytes per token on the rank (elementwise.py; needed on an accelerator)."""
    if device.kind == "cpu":
        return StepTime(_cpu_compute(layout, shape, device), sum(_collectives(layout, shape, device, part)))
    compute = layout.accumulation * micro_batch_seconds(layout, shape, device, part.matmul, traffic)
    if layout.pp > 1:  # (pp - 1) idle slots per accumulation window, v times fewer with v interleaved stages per rank
        compute *= 1 + (layout.pp - 1) / (layout.accumulation * layout.costs.stages_per_rank(layout))
    compute += 2 * state_bytes / (device.memory_bandwidth * MEMORY_EFFICIENCY)
    if layout.costs.offloads_to_host(layout):
        states = 16 * shape.parameters * trainable_share / layout.dp
        compute += states / HOST_ADAM_BYTES_PER_S + 2 * 2 * shape.parameters / layout.dp / OFFLOAD_BYTES_PER_S
    hideable, exposed = _collectives(layout, shape, device, part)
    hidden = min(hideable, OVERLAP_SHARE * compute)
    return StepTime(compute, exposed + hideable - hidden, hidden)


def micro_batch_seconds(layout: Layout, shape: ModelShape, device: DeviceSpec, matmul_parameters: int,
                        traffic: LayerTraffic) -> float:
    """One micro-batch's forward and backward on one rank holding `matmul_parameters` of the matmuls."""
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    layers = -(-shape.layers // layout.pp) + shape.mtp_depths  # the head's stage (MTP depths beside it) is the slowest
    peak = device.peak_tflops * 1e12
    full = layout.recompute == "full"
    gemm = (8 if full else 6) * matmul_parameters * tokens
    gemm_rate = peak * GEMM_PEAK_SHARE * tokens / (tokens + GEMM_HALF_TOKENS)
    forward = 2 * tokens * layout.seq_length * shape.head_dim * shape.heads / layout.tp * layers  # causal half
    attention = forward * (1 + BACKWARD_ATTENTION + (1 if full else 0))
    per_token = traffic.total + (traffic.forward if layout.recompute != "none" else 0)  # the forward again
    elementwise = tokens * layers * per_token * (COMPILED_ELEMENTWISE if layout.compile else 1)
    return (gemm / gemm_rate + attention / (peak * ATTENTION_PEAK_SHARE)
            + elementwise / (device.memory_bandwidth * MEMORY_EFFICIENCY))


def _cpu_compute(layout: Layout, shape: ModelShape, device: DeviceSpec) -> float:
    flops = shape.flops(layout.seq_length)
    per_token = flops.per_token
    if layout.recompute == "full":  # one more forward: 2 FLOPs per parameter, a third of the attention term
        attention = 12.0 * shape.layers * shape.heads * shape.head_dim * layout.seq_length
        per_token += 2.0 * flops.matmul_parameters + attention / 3
    elif layout.recompute == "selective":
        per_token *= 1 + SELECTIVE_RECOMPUTE_COST
    tokens = layout.global_batch * layout.seq_length
    seconds = tokens * per_token / (layout.world_size * device.peak_tflops * 1e12 * CPU_MFU)
    if layout.pp > 1:
        seconds *= 1 + (layout.pp - 1) / layout.accumulation
    return seconds


def ring_bandwidth(device: DeviceSpec, group: int, span: int, per_node: int) -> float:
    """Bytes/s a rank's share of a ring collective moves at: the link within a machine; across machines NCCL
    runs one ring per network card, so the k ranks of the group on each machine cross between machines over k
    cards at once (each carries 1/k of the traffic), up to the link within the machine."""
    if group * span <= per_node:
        return device.bandwidth(True)
    on_one_machine = max(1, min(group, per_node // span))
    return min(device.bandwidth(True), on_one_machine * device.bandwidth(False))


def _collectives(layout: Layout, shape: ModelShape, device: DeviceSpec, part: RankShare) -> tuple[float, float]:
    """(seconds the engine overlaps with compute, seconds in the critical path) of a step's collectives."""
    per_node, c = layout.devices_per_node, compute_bytes(layout.dtype)
    efficiency = 1.0 if device.kind == "cpu" else COLLECTIVE_EFFICIENCY

    def ring(bytes_: float, group: int, span: int) -> float:
        """A ring collective of `bytes_` over `group` ranks spaced `span` apart."""
        if group <= 1:
            return 0.0
        return bytes_ * (group - 1) / group / (ring_bandwidth(device, group, span, per_node) * efficiency)

    micro = layout.accumulation
    hideable = exposed = 0.0
    for x in layout.costs.gradient_traffic(layout, shape, part.trained):
        seconds = ring(x.bytes, x.group, x.span) * (micro if x.per_micro_batch else 1)
        hideable, exposed = (hideable + seconds, exposed) if x.overlaps else (hideable, exposed + seconds)
    # Muon: each sharded matrix's update all-gathered whole once per step (fp32)
    exposed += ring(4 * part.muon * layout.tp, layout.costs.muon_gather_ranks(layout), 1)
    layers = -(-shape.layers // layout.pp) + shape.mtp_depths
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    activation = tokens * shape.hidden * c
    if layout.tp > 1:  # two all-reduces (or all-gather + reduce-scatter) per layer forward, two backward
        exposed += micro * layers * ring(2 * 4 * activation, layout.tp, 1)
    if layout.pp > 1:
        exposed += micro * 2 * activation / device.bandwidth(layout.tp * layout.pp <= per_node)
    if layout.cp > 1:  # context parallelism all-gathers keys and values (context_parallel.py)
        kv = 2 * tokens * shape.kv_heads * shape.head_dim * c
        hideable += micro * layers * 2 * ring(kv * layout.cp, layout.cp, 1)
    if layout.dims.ep > 1:  # per MoE layer, each token's top_k hidden states out and back, forward and backward
        exchanges = 4 + (2 if layout.recompute == "full" else 0)
        moe_layers = -(-shape.expert_layers // layout.pp)
        exposed += micro * moe_layers * exchanges * ring(tokens * shape.top_k * shape.hidden * c, layout.dims.ep, 1)
    if device.kind == "cpu":  # gloo: nothing overlaps
        return 0.0, hideable + exposed
    return hideable, exposed
