"""The resolved run: the loaded arguments, the launch (or a planned world) and the model's config turned into frozen,
typed parts, once. `train`, `pretrainer plan` and `pretrainer export` all call `resolve_run`, so what the planner
predicts is what the run does (engine and settings, parallel dimensions, dtype, padded vocabulary, sizes, loss chunk,
optimizer, schedule). Nothing writes to the arguments afterwards; each consumer takes its part (`options`: the engine,
`sizes`: the data builders, `optimizer` and `schedule`: the optimizer builder, `layout()`: the planner).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from ..config import (
    BatchSizes,
    BranchPoint,
    ConfigError,
    MoeSettings,
    MtpSettings,
    OptimizerSettings,
    ParallelDims,
    Parametrization,
    ScheduleSettings,
    expert_shape,
    key_error,
    mtp_settings,
    resolve_seq_length,
)
from ..config.architecture import Architecture
from ..models import (
    LossChunk,
    ModelSpec,
    load_tokenizer,
    model_source,
    preflight,
    reads_checkpoint_in_slices,
    resolve_loss_chunk,
)
from ..models.rope import check_stage_positions, stage_rope_config
from ..parallel import EngineEntry, EngineOptions, Layout, World, join_world, select_engine
from ..parallel.activation_checkpoint import RecomputeSettings
from .branch import read_branch_point
from .device import resolve_device, resolve_dtype
from .rules import check_rules

logger = logging.getLogger("pretrainer")


@dataclass(frozen=True)
class ResolvedRun:
    engine: EngineEntry               # the engine's registry entry (parallel/registry.py)
    options: EngineOptions            # the engine's part: dims, dtype, its settings, recompute, compile, seed
    sizes: BatchSizes
    model_config: object              # the HF config the model is built from
    model: ModelSpec | None           # config, tokenizer, weights, vocabulary growth (None: a user's model and data)
    tokenizer: object | None
    loss_chunk: LossChunk
    optimizer: OptimizerSettings
    schedule: ScheduleSettings
    dtype_reason: str | None = None   # why `dtype: auto` chose what it did
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"
    weights: str = "none"             # where the weights come from: none (random init), whole, or slices
    trainable: str | list = "all"     # trainable_parameters
    loss_chunk_setting: int | str = "auto"
    custom_loss: bool = False         # custom_loss_function: per-token losses (no chunked loss)
    moe: MoeSettings | None = None    # a model with experts: its shape and how its routing is balanced
    z_loss_coeff: float = 0.0         # the output z-loss's weight (run/callbacks.py's OutputZLoss)
    mtp: MtpSettings | None = None    # multi-token prediction depths and their loss weight
    host_malloc: str = "auto"         # host_malloc_reuse (what a CPU heap keeps of freed blocks)

    @property
    def dims(self) -> ParallelDims:
        return self.options.dims

    @property
    def dtype(self) -> str:
        return self.options.dtype

    @property
    def recompute(self) -> RecomputeSettings:
        return self.options.recompute

    @property
    def mtp_depths(self) -> int:
        return self.mtp.depths if self.mtp is not None else 0

    @property
    def vocab_size(self) -> int:
        growth = self.model.growth if self.model is not None else None
        return growth.new_size if growth is not None else self.model_config.vocab_size

    def layout(self, devices_per_node: int) -> Layout:
        """The planner's view of this run (`devices_per_node` processes to a machine)."""
        sizes = self.sizes
        return Layout(self.engine, self.dims, sizes.micro_batch_size, sizes.gradient_accumulation_steps,
                      sizes.seq_length, self.dtype, min(devices_per_node, self.dims.world_size),
                      self.recompute.mode, self.options.settings, self.sequence_parallel, self.pipeline_schedule,
                      self.loss_chunk.size, self.optimizer.name, self.options.accumulate, self.options.compile,
                      self.host_malloc)

    def with_accumulation(self, mode: str, reason: str) -> "ResolvedRun":
        """This run with `accumulate_gradients: auto` decided (by the memory plan, see plan/memory_check.py)."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, accumulate=mode,
                                                                     accumulate_reason=reason))

    def loss_chunk_for(self, micro_batch_size: int) -> int:
        """The loss chunk this run would resolve with another micro-batch (the planner's alternatives)."""
        return resolve_loss_chunk(self.loss_chunk_setting, micro_batch_size, self.sizes.seq_length, self.model_config,
                                  self.custom_loss, self.vocab_size).size

    def describe(self) -> str:
        return (f"{self.sizes.describe()} {self.dims.describe()} dtype={self.dtype}"
                + (f" loss_chunk={self.loss_chunk.size}" if self.loss_chunk.size else "")
                + (f" moe=({self.moe.describe()})" if self.moe is not None else ""))


def check_experts_first(args, config, where: str) -> None:
    """What the model itself rules out, before any check of the layout: expert parallelism of a dense model, or
    of a degree that does not divide its experts (otherwise the advice of a layout message leads nowhere)."""
    ep = args.expert_parallel_degree
    if ep == 1 or config is None:
        return
    experts = expert_shape(config, where)
    if experts is None:
        raise ConfigError(f"key 'expert_parallel_degree': {ep} is set but {where} describes a dense model (no "
                          "experts to split); set it to 1")
    if experts.experts % ep:
        raise ConfigError(f"key 'expert_parallel_degree': {ep} does not divide the {experts.experts} experts "
                          f"{where} declares; use a divisor of {experts.experts}")


def moe_settings(args, config, where: str, dims: ParallelDims) -> MoeSettings | None:
    """The MoE part of a model with experts (after check_experts_first), refused if this layout cannot train it yet."""
    moe = MoeSettings.of(args, config, where)
    if moe is not None and dims.cp > 1:
        raise ConfigError("key 'context_parallel_degree': a Mixture-of-Experts model is trained with whole "
                          "sequences on each rank (its balancing losses are per sequence); set it to 1")
    return moe


def accumulation_mode(args, entry: EngineEntry, settings, sizes: BatchSizes) -> tuple[str, str]:
    """`accumulate_gradients` for this engine: (mode, why). `auto` stays for the memory plan to decide where
    micro-batches accumulate and the engine shards gradients (rules.py refuses a mode where gradients are whole)."""
    if not entry.cls.shards_gradients(settings):
        return "unsharded", ""
    if sizes.gradient_accumulation_steps == 1 and args.accumulate_gradients == "auto":
        return "sharded", "one micro-batch per step"
    return args.accumulate_gradients, ""


def launch_world(args) -> World:
    """The processes of this launch, their process group joined (a group of one without a launcher), on `device`."""
    select_engine(args)  # the engine against the launch first (engine: single under several processes)
    return join_world(resolve_device(args.device), args.distributed_timeout_minutes)


def resolve_run(args, world: World, model_config=None, accelerator_bf16: bool | None = None,
                check_model: bool = True, check_dp: bool = True, warn: bool = True) -> ResolvedRun:
    """The run `args` describes on `world` (docs/architecture.md, 'The resolved run'). `check_model` False: the
    caller brings its own model and DataLoaders; `check_dp` False: the world is not the config's `dp` one
    (`pretrainer plan --world-size`); `warn` False: the workers that resolve it again warn."""
    entry = select_engine(args, world.size)
    cls = entry.cls
    dtype, reason = resolve_dtype(args.dtype, world.device.type, world.broadcast_object, accelerator_bf16)
    source = model_source(args, model_config) if check_model else None
    config = source.config if source is not None else model_config
    check_experts_first(args, config, source.config_source if source is not None else "the model's config")
    settings = cls.read_settings(args, config, world.size, dtype)
    warn = warn and world.rank == 0  # a warning about the config is said once, by the main rank
    check_rules(args, entry, settings, world.size, warn)
    dims = parallel_dims(args, entry, world.size, settings, check_dp)
    if source is not None:
        spec = preflight(args, source, vocab_multiple=dims.vocab_multiple)
        tokenizer, where = spec.tokenizer, spec.config_source
    else:
        spec, where = None, "the model's config"
        path = args.resolved_tokenizer_path
        tokenizer = load_tokenizer(path, Path(path)) if path else None
    stages = args.seq_stages  # the run's length is the last stage's, within the positions of that stage's RoPE
    if stages is not None and args.seq_length:
        check_stage_positions(stages.resolved(args.seq_length), config, where)
    last = stage_rope_config(config, stages.stages[-1], where) if stages is not None and config is not None \
        else config
    replicas = args.replica_settings  # fault tolerance: the data-parallel replicas of every replica group
    sizes = BatchSizes.of(args, resolve_seq_length(args.seq_length, last, where),
                          dims.dp * (replicas.replica_groups if replicas is not None else 1))
    check_stage_positions(sizes.stages, config, where)
    lr_schedule = schedule_settings(args, sizes, read_branch_point(args))
    if lr_schedule.branch is not None:  # a cooldown branch ends with the update that finishes its tokens
        sizes = sizes.with_steps(lr_schedule.total_steps, sizes.ramp_schedule(args.batch_size_schedule))
    if warn:
        warn_of_unreached_stages(sizes)
    custom_loss = (args.plugin_args or {}).get("custom_loss_function") is not None
    vocab = spec.growth.new_size if spec is not None and spec.growth is not None else config.vocab_size
    chunk = resolve_loss_chunk(args.loss_chunk_size, sizes.micro_batch_size, sizes.seq_length, config, custom_loss,
                               vocab)
    moe = moe_settings(args, config, where, dims)
    shortest = min(stage.seq_length for stage in sizes.stages.stages) if sizes.stages else sizes.seq_length
    mtp = mtp_settings(args, config, shortest, dims.cp)  # every stage's windows leave each depth its targets
    sequence_parallel, schedule = cls.parallel_style(settings)
    accumulate, why = accumulation_mode(args, entry, settings, sizes)
    options = EngineOptions(dims, dtype, settings, cls.recompute(args, settings), args.compile, args.seed,
                            sizes.seq_length, sizes.micro_batch_size, accumulate, why,
                            Parametrization.of(args, Architecture.of(config) if config is not None else None))
    weights = "none" if spec is None or not spec.has_weights else (
        "slices" if reads_checkpoint_in_slices(args, spec) else "whole")
    return ResolvedRun(entry, options, sizes, config, spec, tokenizer, chunk,
                       OptimizerSettings.of(args, dtype), lr_schedule, reason,
                       sequence_parallel, schedule, weights, args.trainable_parameters, args.loss_chunk_size,
                       custom_loss, moe, args.z_loss_coeff, mtp, args.host_malloc_reuse)


def schedule_settings(args, sizes: BatchSizes, branch: BranchPoint | None = None) -> ScheduleSettings:
    """The schedule in updates; lengths given in tokens are divided by the target tokens of one update and must
    fit in the run. A cooldown `branch` sets the run's length."""
    schedule = ScheduleSettings.of(args, sizes, branch)
    if branch is not None:
        return schedule
    run_tokens = f"{schedule.total_steps} steps, {sizes.train_samples * sizes.seq_length} tokens"
    for key, steps in (("warmup_tokens", schedule.warmup_steps), ("wsd_decay_tokens", schedule.decay_steps)):
        if getattr(args, key) is not None and steps > schedule.total_steps:
            raise key_error(key, f"{key} {getattr(args, key):g} is longer than the run ({run_tokens}); give fewer "
                            "tokens or more num_training_steps")
    return schedule


def parallel_dims(args, entry: EngineEntry, world_size: int, settings, check_dp: bool = True) -> ParallelDims:
    """The engine's dims for `world_size` processes, checked against `context_parallel_degree` and the config's `dp`."""
    cls, cp = entry.cls, args.context_parallel_degree
    if cp > 1 and world_size % cp:
        raise ConfigError(f"key 'context_parallel_degree': {cp} does not divide the {world_size} processes; launch "
                          f"dp x {cp} processes")
    dims = cls.parallel_dims(world_size, cp, settings)
    ep = args.expert_parallel_degree
    if ep > 1:
        dims = dataclasses.replace(dims, ep=ep)
    if check_dp:
        dims.check_claimed_dp(args.dp)
    return dims


def described_world_size(args) -> int:
    """The processes a config describes: dp x the ranks of one replica of its engine (tp x pp x cp)."""
    return args.dp * select_engine(args, args.dp).cls.replica_ranks(args)


def warn_of_unreached_stages(sizes) -> None:
    """A batch_size_schedule (or seq_length_schedule) stage that starts after the run's last token never trains (a
    shortened trial of a long run's config, say, or a parent whose long-context stage a cooldown branch starts):
    said once, since the run then never reaches the config's global batch (or the stage's length and RoPE)."""
    end = sizes.tokens_before(sizes.num_training_steps)
    ramp_key = "batch_size_schedule" if sizes.stages is None or all(
        stage.sequences is None for stage in sizes.stages.stages) else "seq_length_schedule's sequences"
    late = [f"{start:,}" for start, _ in sizes.ramp.stages if start >= end] if sizes.ramp is not None else []
    if late:
        logger.warning("%s: the stage(s) from token %s start after the run's last token (%s in %d steps) and are "
                       "never reached; the last step trains %d sequences", ramp_key, ", ".join(late), f"{end:,}",
                       sizes.num_training_steps, sizes.ramp.sequences(max(sizes.num_training_steps - 1, 0)))
    schedule = sizes.stages
    late = [index + 1 for index in range(len(schedule.stages)) if schedule.start_tokens(index) >= end] \
        if schedule is not None else []
    if late:
        logger.warning("seq_length_schedule: stage(s) %s start after the run's last token (%s in %d steps) and are "
                       "never reached; the run ends at seq_length %d", ", ".join(map(str, late)), f"{end:,}",
                       sizes.num_training_steps, sizes.seq_length_at(max(sizes.num_training_steps - 1, 0)))
