"""A layout: how a run spreads one model over its processes; what an engine can do (`EngineTraits`), and what it
costs there (`CostModel`).

The planner (`pretrainer plan`, train's memory check) describes a run as a `Layout` and asks the engine's cost model,
never the engine's name, what it does there: the bytes of model state a rank holds (`model_states`), whether it
autocasts, gathers layers or offloads to the host, a step's gradient collectives, the other layouts of the same world
it could use, and the `key=value` overrides selecting a layout. `CostModel` answers for a plain torch engine (whole
fp32 weights on every rank, autocast, AdamW's two moments); each engine's cost model (registered beside it,
parallel/registry.py) overrides what differs, and `assert_layout_answers` (tests/helpers.py, run on real ranks by the
engine tests) holds each answer to what the constructed engine really holds. An engine class inherits only its traits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import ParallelDims
from ..perf.host_memory import heap_policy

if TYPE_CHECKING:
    from .registry import EngineEntry


@dataclass(frozen=True)
class Layout:
    engine: "EngineEntry"         # the engine's registry entry (registry.py)
    dims: ParallelDims
    micro_batch: int              # sequences per forward on one replica
    accumulation: int             # micro-batches per optimizer step
    seq_length: int
    dtype: str                    # bf16 | fp16 | fp32 (compute; master weights are fp32)
    devices_per_node: int = 1     # processes that share one machine
    recompute: str = "none"       # none | selective | full
    settings: object = None       # the engine's own settings (DeepSpeedSettings, MegatronSettings)
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"
    loss_chunk: int = 0           # tokens per chunk of the fused head + loss; 0: full logits
    optimizer: str = "adamw"      # adamw | muon
    accumulate: str = "unsharded"  # sharded: gradients reduce-scattered every micro-batch (engines that shard them)
    compile: bool = False         # torch.compile fuses each layer's element-wise ops
    host_malloc: str = "auto"     # host_malloc_reuse: auto | on | off (what a CPU heap keeps of freed blocks)

    @property
    def engine_class(self):
        return self.engine.cls

    @property
    def costs(self) -> type["CostModel"]:
        return self.engine.costs

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp

    def describe(self) -> str:
        parts = [f"engine={self.engine.name}", f"processes={self.world_size}", f"dp={self.dp}"]
        parts += [f"{name}={value}" for name, value in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp),
                                                         ("ep", self.dims.ep)) if value > 1]
        own = self.costs.describe_settings(self)
        parts += [own] if own else []
        parts += [f"micro_batch={self.micro_batch}", f"accumulation={self.accumulation}", f"seq={self.seq_length}",
                  f"recompute={self.recompute}", f"dtype={self.dtype}"]
        parts += [text for shown, text in ((self.loss_chunk, f"loss_chunk={self.loss_chunk}"),
                                           (self.optimizer != "adamw", f"optimizer={self.optimizer}"),
                                           (self.accumulates_sharded, "accumulate=sharded"),
                                           (self.compile, "compile=true")) if shown]
        return " ".join(parts)

    @property
    def cpu_heap(self) -> str:
        """On a CPU: what the heap does with freed blocks (perf/host_memory.py): reuse, return or system."""
        return heap_policy(self.host_malloc, self.costs.returns_freed_blocks(self))

    @property
    def accumulates_sharded(self) -> bool:
        """Micro-batches accumulate sharded gradients (each reduce-scatters its own)."""
        return self.accumulate == "sharded" and self.accumulation > 1 and self.engine_class.shards_gradients(
            self.settings)

    def overrides(self) -> list[str]:
        """The `key=value` overrides that give this layout from any config of the same model and world (command
        line arguments: `shlex.join` them for a shell)."""
        cls = self.engine_class
        keys = [f"engine={self.engine.name}", f"dp={self.dp}", f"micro_batch_size={self.micro_batch}",
                f"gradient_accumulation_steps={self.accumulation}", f"activation_checkpointing={self.recompute}"]
        keys += self.costs.settings_overrides(self)
        if cls.supports_context_parallel:
            keys.append(f"context_parallel_degree={self.cp}")
        if cls.supports_expert_parallel:
            keys.append(f"expert_parallel_degree={self.dims.ep}")
        if cls.shards_gradients(self.settings):
            keys.append(f"accumulate_gradients={self.accumulate}")
        return keys

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RankShare:
    """What one rank holds of the model and of the step: its pipeline stage's share, split by tp."""
    stage: str        # "first", "last", or "" (the whole model: no pipeline)
    parameters: int
    matmul: int       # of them, in matmuls (autocast keeps compute-dtype copies of these)
    trained: int      # of them, trained (gradients and optimizer state)
    in_flight: int    # micro-batches whose activations the rank holds at once
    head: bool        # computes the logits and the loss
    muon: int = 0     # of the trained, in hidden matrices Muon updates (0 with AdamW)


@dataclass(frozen=True)
class ModelStates:
    """A rank's bytes of model state on a layout, as its engine holds them."""
    weights: int            # held between steps: fp32 master weights (whole, a shard, a stage) or 16-bit ones
    working_weights: int    # made to compute: autocast copies, gathered layers, a live ZeRO-3 layer
    gradients: int
    optimizer: int
    communication: int      # gradient buckets and the engine's other buffers
    host_offload: int = 0   # moved to host memory by offloading (on an accelerator)
    notes: dict = field(default_factory=dict)  # component -> what it holds

    @property
    def parameters(self) -> int:
        return self.weights + self.working_weights


@dataclass(frozen=True)
class HeldState:
    """What a constructed engine really holds on this rank, measured from its tensors and process groups: what
    `model_states` and the dimensions predict (tests/helpers.py's assert_layout_answers compares the two)."""
    weights: int            # bytes of this rank's own weights (local shards, partitions, its stages)
    optimizer: int          # bytes of its optimizer state (moments, and master weights where kept apart)
    gradient_ranks: int     # ranks of the group its gradients are reduced over
    shard_ranks: int        # ranks one copy of its sharded state is split over (1: none)
    autocasts: bool         # its forward runs under autocast
    expert_ranks: int = 1   # ranks its routed experts are split over by expert (the ep mesh of their DTensors)


def tensor_bytes(tensors) -> int:
    """Bytes of the local part of each distinct tensor (a DTensor's own shard)."""
    from torch.distributed.tensor import DTensor

    distinct = {id(tensor): tensor for tensor in tensors if tensor.numel() > 1}  # scalars: optimizer step counts
    parts = (tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in distinct.values())
    return sum(part.numel() * part.element_size() for part in parts)


@dataclass(frozen=True)
class Collective:
    """A ring collective a step runs: `bytes` over `group` ranks spaced `span` apart, once per step or once per
    micro-batch; `overlaps`: the engine runs it beside compute (prefetched, bucketed) rather than in its path."""
    bytes: float
    group: int
    span: int = 1
    per_micro_batch: bool = False
    overlaps: bool = False


def compute_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def optimizer_bytes(share: RankShare) -> int:
    """Unsharded fp32 optimizer state of trained parameters: two AdamW moments, or one Muon momentum (its matrices)."""
    return 8 * (share.trained - share.muon) + 4 * share.muon


def optimizer_note(layout: Layout, sharded: str = "") -> str:
    held = "AdamW moments" if layout.optimizer != "muon" else "Muon momentum (hidden matrices) + AdamW moments"
    return f"{held} (fp32{', ' + sharded if sharded else ''})"


class EngineTraits:
    """What an engine can do, asked of its class before anything is built (the resolver, the rule table, the
    planner's search); engines override what differs."""

    supports_context_parallel = False  # sequences can be split over ranks (context_parallel.py)
    supports_expert_parallel = False   # experts can be split over ranks (expert_parallel.py)
    trains_muon = True  # optimizer: muon runs here (whole matrices gathered where parameters are sharded)
    muon_refusal = ""   # why not, where it does not

    can_shard_gradients = False  # some layout of this engine shards gradients (see shards_gradients)
    reads_plugin_layout = False  # plugin_args' tp/pp/sequence-parallel/recompute settings lay out this engine

    @classmethod
    def runs_stages(cls, settings) -> bool:
        """The model runs as pipeline stages (parallel/pipeline.py), which plugin_args' layout settings shape."""
        return False

    @classmethod
    def shards_gradients(cls, settings) -> bool:
        """Each rank keeps only its shard of each gradient after the step's reduction (reduce-scatter), so
        micro-batches can accumulate sharded (`accumulate_gradients: sharded`) or whole until the last one."""
        return False

    @classmethod
    def reads_weight_slices(cls, settings) -> bool:
        """Builds an HF checkpoint's model on the meta device and each rank reads its own slices (docs/loading.md)."""
        return False

    @classmethod
    def parallel_dims(cls, world_size: int, cp: int, settings) -> ParallelDims:
        """How `world_size` processes split for this engine (context_parallel_degree `cp`)."""
        return ParallelDims(world_size, cp=cp)


class CostModel:
    """The planner's questions about a layout, answered for a plain torch engine; each engine's cost model
    overrides what differs. `traits`: the engine's traits (its dimensions, for the layouts it offers)."""

    traits: type[EngineTraits] = EngineTraits
    models_expert_parallel = False  # its answers hold for experts split over ranks (expert_parallel_degree)
    baseline_engine = "single"  # the engine whose tiny run measures a CPU process's runtime (plan/device_spec.py)
    baseline_overrides: dict = {}  # the config keys that tiny run needs on this engine

    @classmethod
    def autocasts(cls, layout: Layout) -> bool:
        """Forwards run under autocast (fp32 weights, compute-dtype copies made for the matmuls)."""
        return True

    @classmethod
    def model_states(cls, layout: Layout, shape, share: RankShare, on_cpu: bool) -> ModelStates:
        """`shape`: the planner's ModelShape of the whole model; `on_cpu`: a CPU device (offloading moves nothing)."""
        c, low = compute_bytes(layout.dtype), layout.dtype != "fp32"
        t = share.trained
        notes = {"parameters": "fp32 weights" + (f" + {layout.dtype} copies autocast keeps for backward" if low
                                                 else "")}
        communication = 0
        if layout.dims.gradient_ranks > 1:
            communication = 4 * t
            notes["communication"] = "gradient buckets of the data-parallel all-reduce"
        return ModelStates(4 * share.parameters, c * share.matmul if low else 0, 4 * t, optimizer_bytes(share),
                           communication, notes={**notes, "optimizer": optimizer_note(layout)})

    @classmethod
    def held_parameters(cls, layout: Layout, shape, parameters: int, layers: int) -> int:
        """Of `parameters` of the model (a pipeline stage's, with `layers` decoder layers), those one rank holds between
        steps as this engine lays them out: its tp share (a sharding engine's shards are counted in `model_states`)."""
        return parameters // layout.tp

    @classmethod
    def muon_gather_ranks(cls, layout: Layout) -> int:
        """Ranks one matrix is split over, gathered whole for Muon's update (1: every rank holds it whole)."""
        return layout.tp

    @classmethod
    def pipeline_layers(cls, layout: Layout, num_layers: int) -> tuple[int, int]:
        """Decoder layers held by the first and by the last pipeline rank (the whole model without one)."""
        per_rank = -(-num_layers // layout.pp)
        return per_rank, per_rank

    @classmethod
    def gradient_traffic(cls, layout: Layout, shape, trained: int) -> list[Collective]:
        """An all-reduce of the fp32 gradients (each rank's tp/pp share) over the ranks holding the same ones, in
        buckets as backward produces them."""
        dims = layout.dims
        return [Collective(2 * 4 * trained / (dims.tp * dims.pp), dims.gradient_ranks, dims.tp * dims.pp,
                           overlaps=True)]

    @classmethod
    def stages_per_rank(cls, layout: Layout) -> int:
        """Model chunks per pipeline rank (interleaved virtual stages); bubble: (pp - 1) / (micro-batches x this)."""
        return 1

    @classmethod
    def returns_freed_blocks(cls, layout: Layout) -> bool:
        """On a CPU under `host_malloc_reuse: auto`: this layout's runs give large freed blocks back to the kernel
        (perf/host_memory.py; docs/performance.md, 'Settings that matter', says which engines and why)."""
        return False

    @classmethod
    def cpu_gather_retention(cls, layout: Layout) -> float:
        """On a CPU whose heap keeps freed blocks: what it keeps of per-layer gathers, in fp32 models (measured)."""
        return 0.0

    @classmethod
    def offloads_to_host(cls, layout: Layout) -> bool:
        """The optimizer step runs on the host (states offloaded from an accelerator)."""
        return False

    @classmethod
    def layout_variants(cls, world_size: int, devices_per_node: int, shape, seq_length: int) -> list[dict]:
        """Other layouts of this engine for the same world: `Layout` fields (dims, settings, ...) each."""
        return []

    @classmethod
    def settings_overrides(cls, layout: Layout) -> list[str]:
        """The overrides of the engine's own settings in `layout`."""
        return []

    @classmethod
    def describe_settings(cls, layout: Layout) -> str:
        return ""
