"""Per-rank memory and step time of one layout: the model the planner, `pretrainer plan` and `train`'s
pre-launch check share (docs/plan.md, 'How the prediction is made').

The engine's cost model answers for its model states (`CostModel.model_states`, in each engine's plan module);
activations, logits, runtime and the peak's two moments are counted here. On CPU the tensors' bytes are scaled by
the heap's overhead (CPU_HEAP_OVERHEAD, measured; higher for tensor-parallel layers recomputed in full), and engines
that gather layers add what the heap keeps of the gathers (`cpu_gather_retention`) where it keeps freed blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..parallel.layout import Layout, RankShare, compute_bytes
from .activations import probe
from .device_spec import DeviceSpec
from .elementwise import layer_traffic
from .model_shape import ModelShape
from .step_time import step_time

LOSS_BYTES_PER_LOGIT = 12    # fp32 logits (or log-softmax), and two gradients of that size at the start of backward
# On CPU a process's RSS exceeds its live tensors' bytes: glibc's heap keeps freed blocks that later requests of
# other sizes do not fit. Both fitted on bench/plan_accuracy.py's 27M model (docs/plan.md, 'Accuracy').
CPU_HEAP_OVERHEAD = 1.2
# Tensor-parallel layers recomputed in full fragment it further (DTensor temporaries among the new gradients).
CPU_HEAP_OVERHEAD_TP_RECOMPUTE = 1.45


@dataclass
class Estimate:
    layout: Layout
    parameters: int
    gradients: int
    optimizer: int
    activations: int             # saved for backward at the end of forward
    working: int                 # one layer's backward: its (recomputed) activations and their gradients
    logits: int
    communication: int
    runtime: int
    loading: int                 # host bytes while the checkpoint is read (see _loading), 0 for a config
    host_offload: int            # bytes kept in host memory by offloading (on an accelerator)
    retained: int                # freed buffers the CPU heap keeps (the engine's cpu_gather_retention), 0 elsewhere
    heap_overhead: float         # RSS over live tensor bytes on CPU (CPU_HEAP_OVERHEAD...), 1 elsewhere
    compute_seconds: float
    communication_seconds: float
    device: DeviceSpec
    notes: dict = field(default_factory=dict)  # component -> what it holds
    stage: str = ""              # the pipeline stage whose rank peaks highest ("" without a pipeline)
    hidden_seconds: float = 0.0  # collectives overlapped with compute (in compute_seconds' shadow)

    @property
    def peak(self) -> int:
        persistent = self.parameters + self.optimizer + self.communication
        grads_in_forward = self.gradients if self.layout.accumulation > 1 else 0
        # backward starts with every activation and the logits' gradients alive, and ends with every gradient;
        # in between one layer at a time works on its own activations (recomputed ones too) and their gradients
        backward_start = self.activations + self.logits + self.working + grads_in_forward
        backward_end = self.gradients + self.working
        tensors = persistent + max(backward_start, backward_end)
        if self.device.kind == "cpu":  # offloaded state and the load are in the same memory
            tensors = self.heap_overhead * (tensors + self.host_offload + self.retained)
            return self.runtime + int(max(tensors, self.loading))
        return self.runtime + tensors

    @property
    def host_peak(self) -> int:
        """Host memory of a rank on an accelerator: the checkpoint read in fp32, or the offloaded state."""
        return 0 if self.device.kind == "cpu" else max(self.loading, self.host_offload)

    @property
    def fits(self) -> bool:
        host_fits = self.device.kind == "cpu" or self.host_peak <= self.device.host_memory_bytes
        return self.peak <= self.device.memory_bytes and host_fits

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.communication_seconds

    def per_rank_bytes(self) -> dict:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations + self.working, "logits": self.logits,
                "communication": self.communication,
                "runtime": self.runtime, "loading": self.loading, "host_offload": self.host_offload,
                "heap_retained": self.retained, "peak": self.peak}


def estimate(layout: Layout, shape: ModelShape, config, device: DeviceSpec, trainable: str | list = "all",
             weights: str = "none") -> Estimate:
    """`trainable`: `trainable_parameters`; `weights`: "none" (random init), "whole" (every rank loads the model)
    or "slices" (each rank reads its own). A pipeline's highest-peak rank is the estimate."""
    return max((_estimate_rank(layout, shape, config, device, trainable, weights, part)
                for part in rank_parts(layout, shape, trainable)), key=lambda e: e.peak)


def rank_parts(layout: Layout, shape: ModelShape, trainable="all") -> list[RankShare]:
    """The kinds of rank a layout has: one, or a pipeline's first and last stages (the middle ones hold less than
    either), each as its engine splits it, with the forwards in flight docs/plan.md counts per schedule."""
    share = _trained_share(shape, trainable)
    muon = layout.optimizer == "muon"
    held = functools.partial(layout.costs.held_parameters, layout, shape)

    def part(stage, parameters, matmul, in_flight, head, layers):
        matrices = int(held(layers * shape.layer_matrix_parameters, layers) * share) if muon else 0
        kept = held(parameters, layers)
        return RankShare(stage, kept, held(matmul, layers), int(kept * share), in_flight, head, matrices)

    if layout.pp == 1:
        return [part("", shape.parameters, shape.matmul_parameters, 1, True, shape.layers)]
    first_layers, last_layers = layout.costs.pipeline_layers(layout, shape.layers)
    first, last = first_layers * shape.layer_parameters, last_layers * shape.layer_parameters
    most = min(layout.pp, layout.accumulation)
    in_flight = {"gpipe": (layout.accumulation, layout.accumulation), "1f1b": (most, 1)}.get(
        layout.pipeline_schedule, (most, most))
    # multi-token prediction depths sit on the last stage with a copy of the embedding (models/mtp.py)
    depths = shape.mtp_depths * shape.mtp_layer_parameters + (shape.embedding_parameters if shape.mtp_depths else 0)
    depth_matmuls = shape.mtp_depths * (shape.mtp_layer_parameters + shape.vocab * shape.hidden)
    return [part("first", first + shape.embedding_parameters, first, in_flight[0], False, first_layers),
            part("last", last + shape.head_parameters + shape.other_parameters + depths,
                 last + shape.vocab * shape.hidden + depth_matmuls, in_flight[1], True, last_layers)]


def _estimate_rank(layout: Layout, shape: ModelShape, config, device: DeviceSpec, trainable, weights: str,
                   part: RankShare) -> Estimate:
    states = layout.costs.model_states(layout, shape, part, device.kind == "cpu")
    notes = dict(states.notes)
    if part.stage:
        notes["parameters"] = f"the {part.stage} pipeline stage's " + notes["parameters"]
    activations, working = _activations(layout, shape, config, part, notes)
    logits = _logits(layout, shape) if part.head else 0
    loading = _loading(layout, shape, weights, notes)
    retained = _heap_retained(layout, shape, device, notes)
    communication = states.communication + _muon_buffers(layout, shape, part, notes)
    held = states.weights + states.gradients + states.optimizer
    traffic = None if device.kind == "cpu" else layer_traffic(
        config, layout.seq_length // layout.cp, layout.dtype, layout.costs.autocasts(layout), layout.tp,
        layout.sequence_parallel)
    if traffic is not None:
        notes["elementwise"] = (f"element-wise kernels moving {traffic.total / 1024:,.0f} KiB per token and layer on "
                                f"a rank, counted on the model's own layer")
    time = step_time(layout, shape, device, part, held, _trained_share(shape, trainable), traffic)
    return Estimate(layout, states.parameters, states.gradients, states.optimizer, activations, working, logits,
                    communication, device.runtime_bytes, loading, states.host_offload, retained,
                    _heap_overhead(layout, device), time.compute, time.communication, device, notes, part.stage,
                    time.hidden)


def _muon_buffers(layout: Layout, shape: ModelShape, part: RankShare, notes: dict) -> int:
    """Muon's step works on one whole matrix at a time: the update gathered whole (fp32), its copy in the
    iteration's precision, the iterate and its Gram matrix (at most the matrix's size each)."""
    if not part.muon:
        return 0
    notes["communication"] = ", ".join(filter(None, [notes.get("communication"), "Muon's whole-matrix update "
                                                     "buffers (one matrix at a time)"]))
    return 4 * 4 * shape.largest_matrix


def _heap_retained(layout: Layout, shape: ModelShape, device: DeviceSpec, notes: dict) -> int:
    """Bytes the CPU heap keeps of an engine's per-layer gathers (`cpu_gather_retention`) if it keeps freed blocks."""
    keeps = device.kind == "cpu" and layout.cpu_heap != "return"
    factor = layout.costs.cpu_gather_retention(layout) if keeps else 0.0
    if not factor:
        return 0
    notes["heap_retained"] = (f"freed per-layer gather and gradient buffers the CPU heap keeps ({factor:g} x the fp32 "
                              "model, measured)")
    return int(factor * 4 * shape.parameters)


def _heap_overhead(layout: Layout, device: DeviceSpec) -> float:
    if device.kind != "cpu":
        return 1.0
    return CPU_HEAP_OVERHEAD_TP_RECOMPUTE if layout.tp > 1 and layout.recompute == "full" else CPU_HEAP_OVERHEAD


def _loading(layout: Layout, shape: ModelShape, weights: str, notes: dict) -> int:
    """Host bytes while the weights are read: the whole model in fp32, or (reading slices) one tensor at a time
    beside the rank's own parameters, which the other terms already hold."""
    if weights == "none":
        return 0
    if weights == "slices" and layout.engine_class.reads_weight_slices(layout.settings):
        notes["loading"] = "each rank reads its own slices of the checkpoint, one tensor at a time"
        return 4 * max(shape.embedding_parameters, shape.head_parameters, 1)
    notes["loading"] = "the checkpoint read whole in fp32 on every rank before the engine lays it out"
    return 4 * shape.parameters


def _trained_share(shape: ModelShape, trainable) -> float:
    if trainable == "embeddings":
        return (shape.embedding_parameters + shape.head_parameters) / shape.parameters
    return 1.0  # all, or globs (counted as all: an upper bound)


def _activations(layout: Layout, shape: ModelShape, config, part: RankShare, notes: dict) -> tuple[int, int]:
    """(bytes saved for backward at the end of forward, bytes one layer's backward works with)."""
    seq = layout.seq_length // layout.cp
    profile = probe(config, seq, layout.dtype, layout.costs.autocasts(layout), layout.tp, layout.sequence_parallel,
                    layout.compile)
    c = compute_bytes(layout.dtype)
    gathered_kv = 0
    if layout.cp > 1:  # every rank keeps the all-gathered keys and values of the whole sequence
        gathered_kv = 2 * (layout.seq_length - seq) * max(shape.kv_heads // layout.tp, 1) * shape.head_dim * c
    per_layer = {"none": profile.per_layer + gathered_kv, "selective": profile.selective_layer + gathered_kv,
                 "full": profile.layer_input}[layout.recompute]
    layers = -(-shape.layers // layout.pp) + (shape.mtp_depths if part.head else 0)  # MTP depths beside the head
    # the layer in backward: its activations (recomputed when checkpointed) and gradients of that size
    working = layout.micro_batch * (profile.per_layer + gathered_kv) * (2 if layout.recompute != "none" else 1)
    in_flight = f" x {part.in_flight} in flight" if part.in_flight > 1 else ""
    notes["activations"] = (f"{layers} layer(s) x {per_layer / 2**20:,.1f} MiB per sequence ({layout.recompute} "
                            f"recompute) x {layout.micro_batch} sequence(s){in_flight}, and one layer's backward")
    return layout.micro_batch * part.in_flight * (layers * per_layer + profile.rest), working


def _logits(layout: Layout, shape: ModelShape) -> int:
    """The main head's and each multi-token prediction depth's logits (docs/plan.md, 'How the prediction is made')."""
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    rows = -(-shape.vocab // layout.tp)
    if layout.loss_chunk:  # one chunk at a time, of this rank's vocabulary rows under tensor parallelism
        kept = shape.mtp_depths * 4 * (tokens * shape.hidden + rows * shape.hidden)
        return LOSS_BYTES_PER_LOGIT * min(tokens, layout.loss_chunk) * rows + kept
    per_logit = LOSS_BYTES_PER_LOGIT
    if layout.tp > 1:  # the head's vocabulary shard and the all-gather's buffer
        per_logit += 4 + 4 / layout.tp
    return int(per_logit * tokens * shape.vocab * (1 + shape.mtp_depths))
