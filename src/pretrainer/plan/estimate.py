"""Per-rank memory and step time of one layout: the model the planner, `pretrainer plan` and `train`'s
pre-launch check share.

Memory per rank, in the engines' own terms:
- parameters: fp32 master weights (all, a shard, or a stage / tp slice), plus what is materialised to compute:
  autocast's compute-dtype copies of the weights (single, ddp, megatron), FSDP's gathered layers, DeepSpeed's
  16-bit weights (and ZeRO-3's live layer);
- gradients: fp32 (DeepSpeed: compute dtype), sharded where the engine shards them; FSDP accumulating over
  several micro-batches keeps them unsharded until the last;
- optimizer: AdamW's two fp32 moments (DeepSpeed adds its fp32 master weights and gradients, as its own
  estimator counts them);
- activations: the probed bytes (activations.py) x micro-batch x layers on the rank x micro-batches in flight
  (pipeline), plus the recomputed layer in backward;
- logits: the output head's fp32 logits, log-softmax and their gradients (or one chunk of them);
- communication: DDP's gradient buckets (a second copy of the gradients), DeepSpeed's reduce buckets;
- runtime: the process before the model (device.py).
The peak is the runtime plus the persistent state plus the larger of two moments of a step: the start of
backward (activations, logits and the last layer's backward alive; gradients too when micro-batches accumulate)
and its end (every gradient and the first layer's backward). On CPU the tensors' bytes are scaled by the heap's
overhead (CPU_HEAP_OVERHEAD, measured; higher for tensor-parallel layers recomputed in full), and FSDP/ZeRO-3
ranks add what the heap keeps of their per-layer gathers (CPU_GATHER_RETENTION, measured). A model loaded
from weights is first read whole in fp32 on every rank (`build_model`), which can be the peak itself for
engines that shard it afterwards. Pipeline stages differ: the first holds the embedding and the most
micro-batches in flight, the last the head and its logits; the higher of their peaks is the estimate.

Step time: model FLOPs per step over the world's peak at an assumed MFU (recompute adds its forward,
a pipeline its bubble), plus the communication volume over an assumed bandwidth, not overlapped: both
assumptions are printed with the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..parallel.factory import engine_class
from .activations import probe
from .device import DeviceSpec
from .layout import Layout
from .model_shape import ModelShape

LOSS_BYTES_PER_LOGIT = 12    # fp32 logits (or log-softmax), and two gradients of that size at the start of backward
OFFLOAD_BYTES_PER_S = 25e9   # host <-> device copies (assumed, PCIe 5-class)
# On CPU a process's RSS exceeds the bytes of its live tensors: glibc's heap keeps freed blocks that later
# requests of other sizes do not fit exactly. Fitted on bench/plan_accuracy.py's 27M model (single and ddp,
# with and without recompute: 1.14-1.25), checked on the other sizes.
CPU_HEAP_OVERHEAD = 1.2
# Megatron's tensor-parallel layers under full recomputation fragment the heap further: each layer recomputed
# in backward allocates its DTensor temporaries (shards, all-reduced outputs) among the gradients as they are
# created, and later requests do not fit the holes. Fitted on bench/plan_accuracy.py's 27M model (tp=2, full
# recompute: 1.45), checked on its 5M and 82M models (1.44-1.66).
CPU_HEAP_OVERHEAD_TP_RECOMPUTE = 1.45
# On CPU, engines that gather every layer's weights and reduce-scatter its gradients each step (FSDP, DeepSpeed
# ZeRO-3) leave the heap far above their live tensors: activations are carved out of the freed layer-sized
# buffers, so the next gather cannot reuse them and glibc's heap grows until an FSDP rank holds about what a
# DDP rank does. Counted as a multiple of the model's fp32 bytes, by engine and recomputation, measured on
# bench/plan_accuracy.py's 27M model (2 ranks) and checked on its 5M and 82M models.
CPU_GATHER_RETENTION = {("fsdp", "full"): 2.9, ("fsdp", "other"): 1.6,
                        ("zero3", "full"): 3.6, ("zero3", "other"): 4.1}
SELECTIVE_RECOMPUTE_COST = 0.03  # share of the step's compute (assumed)
HOST_ADAM_BYTES_PER_S = 10e9  # a host Adam step streams its states at about this rate (assumed)


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
    retained: int                # freed buffers the CPU heap keeps (CPU_GATHER_RETENTION), 0 elsewhere
    heap_overhead: float         # RSS over live tensor bytes on CPU (CPU_HEAP_OVERHEAD...), 1 elsewhere
    compute_seconds: float
    communication_seconds: float
    device: DeviceSpec
    notes: dict = field(default_factory=dict)  # component -> what it holds
    stage: str = ""              # the pipeline stage whose rank peaks highest ("" without a pipeline)

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


def compute_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def estimate(layout: Layout, shape: ModelShape, config, device: DeviceSpec, trainable: str | list = "all",
             checkpoint: str = "none") -> Estimate:
    """`config`: the HF model config (the probes build from it); `trainable`: `trainable_parameters`;
    `checkpoint`: how the run reads its weights: "none" (random init), "whole" (every rank loads the whole
    model) or "slices" (an engine that lays the model out first reads only its own slices).

    Under pipeline parallelism the ranks differ (the first stage's hold the embedding and the most micro-batches
    in flight, the last stage's the head and its logits): the rank with the highest peak is the estimate."""
    return max((_estimate_rank(layout, shape, config, device, trainable, checkpoint, part)
                for part in rank_parts(layout, shape)), key=lambda e: e.peak)


@dataclass(frozen=True)
class RankPart:
    """What a rank holds of the model and of the step: its pipeline stage's share, split by tp."""
    stage: str        # "first", "last", or "" (the whole model: no pipeline)
    parameters: int
    matmul: int       # of them, in matmuls (autocast keeps compute-dtype copies of these)
    in_flight: int    # micro-batches whose activations the rank holds at once
    head: bool        # computes the logits and the loss


def rank_parts(layout: Layout, shape: ModelShape) -> list[RankPart]:
    """The kinds of rank a layout has: one, or a pipeline's first and last stages (the middle ones hold less
    than either). With 1F1B a stage s of pp holds min(pp - s, micro-batches) forwards before its first
    backward; GPipe runs every forward first; the interleaved schedule is counted as 1F1B's first stage."""
    tp = layout.tp if layout.engine == "megatron" else 1
    if layout.engine != "megatron" or layout.pp == 1:
        return [RankPart("", shape.parameters // tp, shape.matmul_parameters // tp, 1, True)]
    layers = -(-shape.layers // layout.pp) * shape.layer_parameters
    most = min(layout.pp, layout.accumulation)
    in_flight = {"gpipe": (layout.accumulation, layout.accumulation), "1f1b": (most, 1)}.get(layout.schedule,
                                                                                         (most, most))
    return [RankPart("first", (layers + shape.embedding_parameters) // tp, layers // tp, in_flight[0], False),
            RankPart("last", (layers + shape.head_parameters + shape.other_parameters) // tp,
                     (layers + shape.vocab * shape.hidden) // tp, in_flight[1], True)]


def _estimate_rank(layout: Layout, shape: ModelShape, config, device: DeviceSpec, trainable, checkpoint: str,
                   part: RankPart) -> Estimate:
    low = layout.dtype != "fp32"
    c = compute_bytes(layout.dtype)
    trained_share = _trained_share(shape, trainable)
    n, n_mm = part.parameters, part.matmul
    t = int(n * trained_share)
    notes: dict = {}
    engine = layout.engine
    offload = 0
    comm = 0
    if engine == "deepspeed":
        params, grads, optimizer, comm, offload = _deepspeed_states(layout, shape, n, t, c, device, notes)
    elif engine == "fsdp":
        params, grads, optimizer, offload = _fsdp_states(layout, shape, n, t, c, device, notes)
    else:
        params = 4 * n + (c * n_mm if low else 0)
        notes["parameters"] = "fp32 weights" + (f" + {layout.dtype} copies autocast keeps for backward" if low else "")
        grads, optimizer = 4 * t, 8 * t
        replicas = layout.world_size // (layout.tp * layout.pp)
        if replicas > 1:
            comm = 4 * t
            notes["communication"] = "gradient buckets of the data-parallel all-reduce"
    if part.stage:
        notes["parameters"] = f"the {part.stage} pipeline stage's " + notes["parameters"]
    activations, working = _activations(layout, shape, config, part, notes)
    logits = _logits(layout, shape) if part.head else 0
    loading = _loading(layout, shape, checkpoint, notes)
    retained = _heap_retained(layout, shape, device, notes)
    return Estimate(layout, params, grads, optimizer, activations, working, logits, comm, device.runtime_bytes, loading,
                    offload, retained, _heap_overhead(layout, device),
                    _compute_seconds(layout, shape, device, trained_share),
                    _communication_seconds(layout, shape, device, t, c), device, notes, part.stage)


def _heap_retained(layout: Layout, shape: ModelShape, device: DeviceSpec, notes: dict) -> int:
    """Bytes the CPU heap keeps of an FSDP or ZeRO-3 rank's per-layer gathers (see CPU_GATHER_RETENTION)."""
    engine = "zero3" if layout.engine == "deepspeed" and layout.zero_stage == 3 else layout.engine
    gathers = layout.fsdp_shards > 1 if engine == "fsdp" else engine == "zero3" and layout.dp > 1
    if device.kind != "cpu" or not gathers:
        return 0
    factor = CPU_GATHER_RETENTION[engine, "full" if layout.recompute == "full" else "other"]
    notes["heap_retained"] = (f"freed per-layer gather and gradient buffers the CPU heap keeps ({factor:g} x the fp32 "
                              "model, measured)")
    return int(factor * 4 * shape.parameters)


def _heap_overhead(layout: Layout, device: DeviceSpec) -> float:
    if device.kind != "cpu":
        return 1.0
    if layout.engine == "megatron" and layout.tp > 1 and layout.recompute == "full":
        return CPU_HEAP_OVERHEAD_TP_RECOMPUTE
    return CPU_HEAP_OVERHEAD


def _loading(layout: Layout, shape: ModelShape, checkpoint: str, notes: dict) -> int:
    """Host bytes while the weights are read: the whole model in fp32, or (reading slices) one tensor at a time
    beside the rank's own parameters, which the other terms already hold."""
    if checkpoint == "none":
        return 0
    whole_first = layout.engine == "deepspeed" and layout.zero_stage < 3  # ZeRO-1/2 build every weight whole
    if checkpoint == "slices" and engine_class(layout.engine).reads_weight_slices and not whole_first:
        notes["loading"] = "each rank reads its own slices of the checkpoint, one tensor at a time"
        return 4 * max(shape.embedding_parameters, shape.head_parameters, 1)
    notes["loading"] = "the checkpoint read whole in fp32 on every rank before the engine lays it out"
    return 4 * shape.parameters


def _trained_share(shape: ModelShape, trainable) -> float:
    if trainable == "embeddings":
        return (shape.embedding_parameters + shape.head_parameters) / shape.parameters
    return 1.0  # all, or globs (counted as all: an upper bound)


def _deepspeed_states(layout, shape, n, t, c, device, notes):
    """ZeRO's model states as DeepSpeed's own estimators count them: 16-bit weights (a shard and the largest
    live layer at stage 3), 16-bit gradients (none kept at stage 3), and per trained parameter an fp32 master
    copy, two moments and an fp32 gradient, partitioned from stage 1 (fp32 runs count their weights as 4)."""
    dp, stage = layout.dp, layout.zero_stage
    largest_layer = max(shape.layer_parameters, shape.embedding_parameters, shape.head_parameters)
    params = c * n if stage < 3 else c * n // dp + 4 * largest_layer
    partition = dp if stage >= 1 else 1
    low_grads = {0: c * t, 1: c * t, 2: c * t // dp, 3: 0}[stage]
    grads = low_grads + 4 * t // partition
    optimizer = 12 * t // partition
    # DeepSpeed's own buffers: the gradient reduce bucket, and the all-gather bucket (stages 1-2) or the
    # prefetch bucket and the parameters it keeps gathered (stage 3: up to stage3_max_live_parameters)
    comm = c * min(layout.reduce_bucket, t)
    if stage < 3:
        comm += c * min(layout.allgather_bucket, n)
    else:
        comm += c * min(layout.prefetch_bucket, n) + c * min(layout.max_live_parameters, n - n // dp)
    notes["parameters"] = f"{'16-bit' if c < 4 else 'fp32'} weights" + (" shards + the largest live layer"
                                                                       if stage == 3 else "")
    notes["gradients"] = ("16-bit gradients and the fp32 gradient partition" if c < 4 else
                          "gradients and their partition")
    notes["optimizer"] = "fp32 master weights and AdamW moments" + (" (partitioned)" if stage else "")
    notes["communication"] = ("reduce and all-gather buckets" if stage < 3 else
                              "reduce and prefetch buckets, parameters kept gathered (stage3_max_live_parameters)")
    offload = 0
    if layout.offload_optimizer and device.kind != "cpu":
        offload += optimizer + grads
        optimizer, grads = 0, 0
        notes["optimizer"] += ", on the host"
    if layout.offload_parameters and stage == 3 and device.kind != "cpu":
        offload += c * n // dp
        params = 4 * largest_layer
    return params, grads, optimizer, comm, offload


def _fsdp_states(layout, shape, n, t, c, device, notes):
    shards = layout.fsdp_shards
    root = shape.embedding_parameters + shape.head_parameters + shape.other_parameters
    if layout.fsdp_reshard:
        gathered = c * max(2 * shape.layer_parameters, root + shape.layer_parameters)
        notes["parameters"] = "fp32 shards + the gathered layers being computed"
    else:
        gathered = c * (n - n // shards)
        notes["parameters"] = "fp32 shards + every layer gathered from forward to backward"
    sharded_params, grads, optimizer = 4 * n // shards, 4 * t // shards, 8 * t // shards
    grads += 4 * shape.layer_parameters  # one layer's full gradient before its reduce-scatter
    if layout.accumulation > 1:
        grads += 4 * t - 4 * t // shards  # gradients stay unsharded until the last micro-batch
        notes["gradients"] = "unsharded while micro-batches accumulate"
    offload = 0
    if layout.fsdp_offload and device.kind != "cpu":
        offload = sharded_params + 4 * t // shards + optimizer
        sharded_params, optimizer = 0, 0
        grads -= 4 * t // shards
    return sharded_params + gathered, grads, optimizer, offload


def _activations(layout: Layout, shape: ModelShape, config, part: RankPart, notes: dict) -> tuple[int, int]:
    """(bytes saved for backward at the end of forward, bytes one layer's backward works with)."""
    seq = layout.seq_length // layout.cp
    autocast = layout.engine in ("single", "ddp", "megatron")
    profile = probe(config, seq, layout.dtype, autocast, layout.tp, layout.sequence_parallel)
    c = compute_bytes(layout.dtype)
    gathered_kv = 0
    if layout.cp > 1:  # every rank keeps the all-gathered keys and values of the whole sequence
        gathered_kv = 2 * (layout.seq_length - seq) * max(shape.kv_heads // layout.tp, 1) * shape.head_dim * c
    per_layer = {"none": profile.per_layer + gathered_kv, "selective": profile.selective_layer + gathered_kv,
                 "full": profile.layer_input}[layout.recompute]
    layers = -(-shape.layers // layout.pp)
    in_flight = part.in_flight
    # the layer in backward: its activations (recomputed when checkpointed) and gradients of that size
    working = layout.micro_batch * (profile.per_layer + gathered_kv) * (2 if layout.recompute != "none" else 1)
    notes["activations"] = (f"{layers} layer(s) x {per_layer / 2**20:,.1f} MiB per sequence ({layout.recompute} "
                            f"recompute) x {layout.micro_batch} sequence(s)" + (f" x {in_flight} in flight"
                                                                               if in_flight > 1 else "")
                            + ", and one layer's backward")
    return layout.micro_batch * in_flight * (layers * per_layer + profile.rest), working


def _logits(layout: Layout, shape: ModelShape) -> int:
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    if layout.loss_chunk:  # one chunk at a time, of this rank's vocabulary rows under tensor parallelism
        return LOSS_BYTES_PER_LOGIT * min(tokens, layout.loss_chunk) * -(-shape.vocab // layout.tp)
    per_logit = LOSS_BYTES_PER_LOGIT
    if layout.engine == "megatron" and layout.tp > 1:  # the head's vocabulary shard and the all-gather's buffer
        per_logit += 4 + 4 / layout.tp
    return int(per_logit * tokens * shape.vocab)


def _compute_seconds(layout: Layout, shape: ModelShape, device: DeviceSpec, trained_share: float) -> float:
    flops = shape.flops(layout.seq_length)
    per_token = flops.per_token
    if layout.recompute == "full":  # one more forward: 2 FLOPs per parameter, a third of the attention term
        attention = 12.0 * shape.layers * shape.heads * shape.head_dim * layout.seq_length
        per_token += 2.0 * flops.matmul_parameters + attention / 3
    elif layout.recompute == "selective":  # norms, activations and rotary again: memory-bound, a few percent
        per_token *= 1 + SELECTIVE_RECOMPUTE_COST
    tokens = layout.global_batch * layout.seq_length
    seconds = tokens * per_token / (layout.world_size * device.peak_tflops * 1e12 * device.mfu)
    if layout.pp > 1:  # pipeline bubble: (pp - 1) idle slots per accumulation window
        seconds *= 1 + (layout.pp - 1) / layout.accumulation
    if device.kind != "cpu" and (layout.offload_optimizer or layout.fsdp_offload):
        states = 16 * shape.parameters * trained_share / layout.dp
        seconds += states / HOST_ADAM_BYTES_PER_S + 2 * 2 * shape.parameters / layout.dp / OFFLOAD_BYTES_PER_S
    return seconds


def _communication_seconds(layout: Layout, shape: ModelShape, device: DeviceSpec, trained: int, c: int) -> float:
    """Bytes each rank sends per step over its groups, over an assumed bandwidth (no overlap)."""
    per_node = layout.devices_per_node

    def ring(bytes_: float, group: int, span: int) -> float:
        """A ring collective of `bytes_` over `group` ranks spaced `span` apart."""
        if group <= 1:
            return 0.0
        return bytes_ * (group - 1) / group / device.bandwidth(group * span <= per_node)

    micro, n = layout.accumulation, shape.parameters
    tokens = layout.micro_batch * layout.seq_length // layout.cp
    seconds = 0.0
    grad_group = layout.world_size // (layout.tp * layout.pp)
    if layout.engine in ("single", "ddp", "megatron"):
        seconds += ring(2 * 4 * trained / (layout.tp * layout.pp), grad_group, layout.tp * layout.pp)
    elif layout.engine == "fsdp":
        gathers = 2 if layout.fsdp_reshard else 1
        seconds += micro * ring(gathers * c * n, layout.fsdp_shards, 1) + ring(4 * trained, layout.fsdp_shards, 1)
    else:
        seconds += ring(2 * c * trained, layout.dp, 1)
        if layout.zero_stage == 3:
            seconds += micro * ring(2 * c * n, layout.dp, 1)
    layers = -(-shape.layers // layout.pp)
    activation = tokens * shape.hidden * c
    if layout.tp > 1:  # two all-reduces (or all-gather + reduce-scatter) per layer forward, two backward
        seconds += micro * layers * ring(2 * 4 * activation, layout.tp, 1)
    if layout.pp > 1:
        seconds += micro * 2 * activation / device.bandwidth(layout.tp * layout.pp <= per_node)
    if layout.cp > 1:
        kv = 2 * tokens * shape.kv_heads * shape.head_dim * c
        seconds += micro * layers * 2 * ring(kv * layout.cp, layout.cp, 1)
    return seconds
