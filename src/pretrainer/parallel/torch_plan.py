"""The torch backend's traits (its `dp x pp x cp x tp` dimensions, where it runs pipeline stages) and two of its cost
models (parallel/layout.py's questions), beside the backend (torch_backend.py): ddp's, a whole model replicated over
every context-parallel degree, and that of a model run as stages (megatron's, and ddp's or fsdp's where the model is
split: which stages a pipeline rank holds, the distributed optimizer's FSDP2 shards or replicated states over the
stage's tp share, the tp x pp (x cp, x ep) layouts it offers). fsdp's whole-model cost model is in fsdp_plan.py."""

from __future__ import annotations

from dataclasses import replace

from ..config import ConfigError, ParallelDims
from ..config.dims import divisors
from ..models.registry import pipeline_misfit, tensor_parallel_misfit
from .context_parallel import context_parallel_degrees
from .layout import (
    Collective,
    CostModel,
    EngineTraits,
    Layout,
    ModelStates,
    RankShare,
    compute_bytes,
    optimizer_bytes,
    optimizer_note,
)
from .megatron_settings import SHARDING_STRATEGIES, MegatronSettings
from .pipeline import split_layers, stages_of_rank


class TorchTraits(EngineTraits):
    supports_context_parallel = True
    supports_expert_parallel = True
    can_shard_gradients = True
    reads_plugin_layout = True
    stages_always = False  # the model runs as pipeline stages even where nothing splits it (megatron's default)

    @classmethod
    def runs_stages(cls, settings: MegatronSettings) -> bool:
        return cls.stages_always or settings.tp > 1 or settings.pp > 1

    @classmethod
    def shards_gradients(cls, settings: MegatronSettings) -> bool:
        """The distributed optimizer reduce-scatters gradients (FSDP2 over dp x cp); else they are all-reduced whole."""
        return settings.distributed_optimizer

    @classmethod
    def parallel_dims(cls, world_size: int, cp: int, settings: MegatronSettings) -> ParallelDims:
        """A `dp x pp x cp x tp` mesh; the distributed optimizer shards its state over dp."""
        holders = world_size // (settings.tp * settings.pp)  # dp x cp ranks hold the same parameters
        shard = (settings.shard_size or holders) if settings.distributed_optimizer and holders >= 1 else 1
        if holders >= 1 and holders % shard:
            raise ConfigError(f"key 'fsdp_shard_size': {shard} does not divide the {holders} ranks holding the same "
                              "parameters (dp x context_parallel_degree); use a divisor of it")
        return ParallelDims(world_size, tp=settings.tp, pp=settings.pp, cp=cp, shard=shard)

    @classmethod
    def reads_weight_slices(cls, settings) -> bool:
        return True


class SingleTraits(TorchTraits):
    """One process: nothing to split sequences, experts, gradients or layers over, HF weights read whole."""

    supports_context_parallel = supports_expert_parallel = can_shard_gradients = reads_plugin_layout = False

    @classmethod
    def reads_weight_slices(cls, settings) -> bool:
        return False


class DDPCosts(CostModel):
    """A whole model replicated over the data ranks: a plain torch engine's answers, for every cp degree."""

    traits = TorchTraits
    one_process = False  # the worlds it offers layouts for: one process, or several

    @classmethod
    def layout_variants(cls, world_size: int, devices_per_node: int, shape, seq_length: int) -> list[dict]:
        if (world_size == 1) != cls.one_process:
            return []
        return [{"dims": cls.traits.parallel_dims(world_size, cp, MegatronSettings()), "settings": MegatronSettings()}
                for cp in context_parallel_degrees(world_size, seq_length)]


class SingleCosts(DDPCosts):
    """The single engine's cost model: the backend's answers on one process."""

    traits = SingleTraits
    one_process = True


class MegatronCosts(CostModel):
    """A model run as pipeline stages (split by tp and pp, or whole under megatron)."""

    traits = TorchTraits
    models_expert_parallel = True

    @classmethod
    def stages_per_rank(cls, layout: Layout) -> int:
        return layout.settings.virtual_stages

    @classmethod
    def returns_freed_blocks(cls, layout: Layout) -> bool:
        """Sharded data parallelism is FSDP2 over the data ranks: gradients reduce-scattered per layer (and
        parameters gathered per layer under optim_grads_params)."""
        return layout.dims.shard > 1

    @classmethod
    def pipeline_layers(cls, layout: Layout, num_layers: int) -> tuple[int, int]:
        """The stages of the first and of the last pipeline rank, as `wrap` splits them."""
        s = layout.settings
        ranges = split_layers(num_layers, s.num_stages, s.pipeline_layers)
        return tuple(sum(len(ranges[i]) for i in stages_of_rank(rank, s.pp, s.num_stages)) for rank in (0, s.pp - 1))

    @classmethod
    def model_states(cls, layout: Layout, shape, share: RankShare, on_cpu: bool) -> ModelStates:
        """With the distributed optimizer each stage is FSDP2 over dp x cp, counted as fsdp's states are (FSDP's mixed
        precision, no autocast); else a torch engine's states over the stage's tp share."""
        shards = layout.dims.shard
        if not cls.shards_over_data(layout):
            return super().model_states(layout, shape, share, on_cpu)
        n, t, c = share.parameters, share.trained, compute_bytes(layout.dtype)
        layer = shape.layer_parameters // layout.tp
        # split experts (their 1 / ep on this rank) are sharded over the dp / ep ranks holding them instead
        experts = shape.expert_parameters // layout.dims.ep if layout.dims.ep > 1 else 0

        def sharded(held: int) -> int:
            own = experts * held / n if n else 0
            return int((held - own) / shards + own / layout.dims.expert_replicas)

        whole_while_accumulating = layout.accumulation > 1 and not layout.accumulates_sharded
        grads = 4 * sharded(t) + 4 * layer + (4 * t - 4 * sharded(t) if whole_while_accumulating else 0)
        if layout.settings.reshard_parameters:  # the layers being computed gathered, the rest resharded
            ends = (shape.embedding_parameters + shape.head_parameters + shape.other_parameters) // layout.tp
            gathered = c * max(2 * layer, ends + layer)
            held = f"fp32 shards over dp x cp + the layers being computed, gathered in {layout.dtype}"
        else:  # fp32: the gathered copy is the parameter itself (measured); below it, a copy beside the shards
            gathered = 4 * (n - sharded(n)) if c == 4 else c * n
            held = f"fp32 shards over dp x cp + every layer gathered in {layout.dtype} from forward to backward"
        notes = {"parameters": held,
                 "optimizer": optimizer_note(layout, f"sharded: {layout.settings.sharding_strategy}")}
        return ModelStates(4 * sharded(n), gathered, grads, sharded(optimizer_bytes(share)), 0, notes=notes)

    @classmethod
    def shards_over_data(cls, layout: Layout) -> bool:
        """Each stage is FSDP2 over more than one rank (the distributed optimizer on dp x cp > 1)."""
        return layout.settings.distributed_optimizer and layout.dims.shard > 1

    @classmethod
    def autocasts(cls, layout: Layout) -> bool:
        """FSDP2's mixed-precision policy casts the gathered parameters itself; whole stages run under autocast."""
        return not cls.shards_over_data(layout)

    @classmethod
    def held_parameters(cls, layout: Layout, shape, parameters: int, layers: int) -> int:
        """tp splits all but the MoE blocks, which it leaves whole; ep splits their routed experts."""
        whole = min(layers * shape.layer_moe_block_parameters, parameters)
        experts = min(layers * shape.layer_expert_parameters, whole)
        return (parameters - whole) // layout.tp + whole - experts + experts // layout.dims.ep

    @classmethod
    def gradient_traffic(cls, layout: Layout, shape, trained: int) -> list[Collective]:
        """An all-reduce of the stage's gradients over dp x cp (every micro-batch if they accumulate sharded); with ep
        the experts' over the dp / ep ranks holding them; the MoE blocks' (tp leaves them whole) summed over tp."""
        dims, each = layout.dims, layout.accumulates_sharded
        blocks, experts = shape.moe_block_parameters, shape.expert_parameters
        split = dims.ep > 1
        dense = trained - (experts if split else 0)
        traffic = [Collective(2 * 4 * cls.held_parameters(layout, shape, dense, shape.layers) / dims.pp,
                              dims.gradient_ranks, dims.tp * dims.pp, each, overlaps=True)]
        if split:
            traffic.append(Collective(2 * 4 * experts / (dims.ep * dims.pp), dims.expert_replicas,
                                      dims.tp * dims.pp * dims.ep, each, overlaps=True))
        settings = layout.settings
        if cls.shards_over_data(layout):  # FSDP2 gathers the parameters in the compute dtype
            reshard = settings.reshard_parameters
            held = cls.held_parameters(layout, shape, shape.parameters, shape.layers) / dims.pp
            traffic.append(Collective((2 if reshard else 1) * compute_bytes(layout.dtype) * held, dims.shard,
                                      dims.tp * dims.pp, reshard, overlaps=True))
        if blocks and dims.tp > 1:
            traffic.append(Collective(2 * 4 * (blocks - experts + experts / dims.ep) / dims.pp, dims.tp))
        return traffic

    @classmethod
    def muon_gather_ranks(cls, layout: Layout) -> int:
        """tp, and dp x cp too with the distributed optimizer (its matrices are FSDP2 shards)."""
        return layout.tp * (layout.dims.shard if layout.settings.distributed_optimizer else 1)

    @classmethod
    def layout_variants(cls, world_size: int, devices_per_node: int, shape, seq_length: int) -> list[dict]:
        """tp within a node (dividing the heads and the MLP) by pp; and Megatron's long-context layout, tp within a
        node and cp across. An MoE model (whole sequences): tp by pp by ep, ep dividing the experts and the dp ranks."""
        if world_size == 1:
            return []
        tensor_parallel = [tp for tp in divisors(min(devices_per_node, 8), 8) if tp > 1 and not (
            tensor_parallel_misfit(tp, shape.heads, shape.kv_heads, shape.intermediate))]
        variants = []
        for tp in [1, *tensor_parallel]:
            for pp in divisors(world_size // tp, 8):
                if pipeline_misfit(pp, shape.layers, shape.tied):
                    continue
                dp = world_size // (tp * pp)
                for ep in [e for e in range(1, dp + 1) if dp % e == 0 and shape.experts % e == 0] \
                        if shape.experts else [1]:
                    if tp * pp * ep > 1:  # each with the data ranks replicating, sharding state, or parameters too
                        variants += [cls._variant(world_size, tp, pp, 1, ep, strategy)
                                     for strategy in (SHARDING_STRATEGIES if dp > 1 else SHARDING_STRATEGIES[:1])]
        if shape.experts:  # whole sequences
            return variants
        for cp in context_parallel_degrees(world_size, seq_length)[1:]:
            variants += [cls._variant(world_size, tp, 1, cp) for tp in tensor_parallel if world_size % (tp * cp) == 0]
        return variants

    @classmethod
    def _variant(cls, world_size: int, tp: int, pp: int, cp: int, ep: int = 1, strategy: str = "no_shard") -> dict:
        level = SHARDING_STRATEGIES.index(strategy)  # no_shard, optim_grads, optim_grads_params
        settings = MegatronSettings(tp=tp, pp=pp, sequence_parallel=tp > 1, distributed_optimizer=level >= 1,
                                    reshard_parameters=level == 2)
        return {"dims": replace(cls.traits.parallel_dims(world_size, cp, settings), ep=ep), "settings": settings,
                "sequence_parallel": settings.sequence_parallel}

    @classmethod
    def describe_settings(cls, layout: Layout) -> str:
        settings = layout.settings
        if not settings.distributed_optimizer:
            return ""
        hybrid = f" fsdp_shard_size={layout.dims.shard}" if layout.dims.shard < layout.dims.gradient_ranks else ""
        return f"sharding={settings.sharding_strategy}{hybrid}"

    @classmethod
    def settings_overrides(cls, layout: Layout) -> list[str]:
        settings = layout.settings
        return [f"plugin_args.tp_degree={layout.tp}", f"plugin_args.pp_degree={layout.pp}",
                f"plugin_args.sequence_parallelism={str(layout.sequence_parallel).lower()}",
                f"plugin_args.use_distributed_optimizer={str(settings.distributed_optimizer).lower()}",
                f"plugin_args.data_parallel_sharding_strategy={settings.sharding_strategy}"]
