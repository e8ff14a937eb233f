"""One assembly of a run, for every command that runs a model: `train`, `evaluate`, `export`, the lm-eval adapter
and the planner's baseline run all go through `assemble_run`, so each puts a run together the same way (the steps, in
order: docs/architecture.md, 'One assembly').
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from ..config import ConfigError
from ..config.fault_tolerance import replica_group
from ..data import DataPlacement, RunData, assemble_data
from ..models import (
    LoadStats,
    add_multi_token_prediction,
    build_model,
    count_parameters,
    idle_expert_parameters,
    install_chunked_loss,
    pending_checkpoint,
    select_trainable,
)
from ..models.parametrization import trained_roles
from ..optim import build_optimizer, build_scheduler
from ..parallel import Engine, World, create_engine
from ..perf import flops_per_token
from ..perf.flops import FlopsCount
from ..perf.host_memory import RETURN_ABOVE_BYTES, apply_heap_policy
from .callbacks import Callback, SourceAccounting, model_callbacks
from .resolve import ResolvedRun, resolve_run

logger = logging.getLogger("pretrainer")


@dataclass(frozen=True)
class DataSources:
    """Where a training run's batches come from: the config's data (the default), the seed's datasets-provider
    hook, or the user's own DataLoaders."""
    train_dataloader: object = None
    eval_dataloader: object = None
    datasets_provider: object = None


@dataclass(frozen=True)
class ModelFacts:
    """What the run trains, read off the model before an engine shards it (the start row records them)."""
    parameters: int
    trainable: int
    vocab_rows: int
    loss_chunk_size: int
    flops: FlopsCount
    load_stats: LoadStats | None  # how a checkpoint read in slices went (None: not read so)


@dataclass
class AssembledRun:
    resolved: ResolvedRun
    engine: Engine
    model: torch.nn.Module
    facts: ModelFacts
    optimizer: object = None
    scheduler: object = None
    data: RunData | None = None
    callbacks: list[Callback] = field(default_factory=list)  # the model's, the mixture's, then the user's
    predicted_memory: object = None   # what `before_build` returned (the memory plan's prediction)
    host_heap: str | None = None      # on a CPU, what malloc does with freed blocks (reuse | return); None: unchanged


def assemble_run(args, world: World, *, model=None, optimizer=None, lr_scheduler=None,
                 data: DataSources | None = DataSources(), before_build=None, callbacks=()) -> AssembledRun:
    """The run `args` describes on `world` (docs/architecture.md, 'One assembly'). `data` None: no data and no
    optimizer (the model is only placed); `before_build(args, resolved, world) -> (resolved, prediction)` runs
    before anything large is allocated and may decide what the run left to it (`accumulate_gradients: auto`)."""
    resolved = resolve_run(args, world, model_config=model.config if model is not None else None,
                           check_model=model is None or data is None or data.train_dataloader is None)
    predicted = None
    if before_build is not None and model is None:
        resolved, predicted = before_build(args, resolved, world)
    if resolved.options.accumulate == "auto":  # no memory plan decided it
        resolved = resolved.with_accumulation("sharded", "auto: no memory plan (preflight_memory_check: off, or a "
                                              "model passed in) to say whole gradients fit")
    logger.info("run: %s", resolved.describe())
    heap = _set_host_heap(resolved, world)
    engine = create_engine(resolved.engine, resolved.options, world)
    try:
        run = _assemble_on(engine, args, resolved, world, model, optimizer, lr_scheduler, data, predicted, callbacks)
        return replace(run, host_heap=heap)
    except BaseException:
        engine.release()  # its meshes and groups go before the process group does
        raise


def _set_host_heap(resolved: ResolvedRun, world: World) -> str | None:
    """On a CPU, before the model takes memory: what malloc does with freed blocks, for this layout
    (`host_malloc_reuse`, perf/host_memory.py); the policy set, or None where nothing was changed."""
    if world.device.type != "cpu":
        return None
    policy = resolved.layout(world.local_size).cpu_heap
    if not apply_heap_policy(policy):
        return None
    if policy == "return":
        logger.info("host memory: freed blocks of %d MiB and more go back to the kernel (%s gathers or "
                    "reduce-scatters layer-sized buffers every micro-batch; host_malloc_reuse: on keeps them for "
                    "reuse: faster steps, a larger heap)", RETURN_ABOVE_BYTES >> 20, resolved.engine.name)
    return policy


def replica_placement(args) -> tuple[int, int]:
    """(this process's replica group, the groups) of a fault-tolerant run; (0, 1) otherwise."""
    settings = args.replica_settings
    return (replica_group(settings), settings.replica_groups) if settings is not None else (0, 1)


def _assemble_on(engine: Engine, args, resolved: ResolvedRun, world: World, model, optimizer, lr_scheduler,
                 data: DataSources | None, predicted, callbacks) -> AssembledRun:
    training = data is not None
    if optimizer is not None and engine.shards_parameters:
        raise ConfigError(f"engine {engine.name} re-creates the model's parameters when it wraps the model "
                          "(shards or replicas), so an optimizer made before cannot be used; leave optimizer= unset "
                          "(configure it with lr, adam_*, weight_decay)")
    run_data = None
    if training:
        group, groups = replica_placement(args)  # a fault-tolerant run's group reads its own share of each batch
        placement = DataPlacement(group * engine.data_world_size + engine.data_rank, groups * engine.data_world_size,
                                  engine.is_main, engine.barrier, engine.all_gather_object, world.local_rank,
                                  engine.data_world_size if groups > 1 else 0)
        run_data = assemble_data(args, resolved.sizes, resolved.tokenizer, placement,
                                 datasets_provider=data.datasets_provider, train_dataloader=data.train_dataloader,
                                 eval_dataloader=data.eval_dataloader)
    if model is None:
        model = build_model(args, resolved.model, read_slices=engine.reads_slices)
    else:
        model.config.use_cache = False
    add_multi_token_prediction(model, resolved.mtp_depths, resolved.model, args.seed, resolved.options.parametrization)
    facts, made = _prepare_model(args, resolved, model, engine, training)
    if not training:
        return AssembledRun(resolved, engine, engine.place(model), facts, predicted_memory=predicted)
    model, optimizer, lr_scheduler = engine.setup(
        model, optimizer, lr_scheduler,
        build_optimizer=lambda m: _build_optimizer(engine.trained_module(m), resolved, engine.device),
        build_scheduler=lambda o: build_scheduler(o, resolved.schedule))
    if run_data.mixture is not None:
        made.append(SourceAccounting(run_data.mixture, run_data.train))
    for callback in (*made, *callbacks):
        callback.attach(engine, model)
    return AssembledRun(resolved, engine, model, facts, optimizer, lr_scheduler, run_data, [*made, *callbacks],
                       predicted)


def _build_optimizer(model: torch.nn.Module, resolved: ResolvedRun, device: torch.device) -> torch.optim.Optimizer:
    parametrization = resolved.options.parametrization
    return build_optimizer(model, resolved.optimizer, device, parametrization, trained_roles(model, parametrization))


def _prepare_model(args, resolved: ResolvedRun, model: torch.nn.Module, engine: Engine, training: bool
                   ) -> tuple[ModelFacts, list[Callback]]:
    """Before the engine wraps it: the trainable parameters and the chunked loss (training), and what the run
    trains, read off the whole model."""
    parameters = count_parameters(model)
    checkpoint = pending_checkpoint(model)  # read by the engine as it lays the model out
    trainable = parameters
    if training:
        trainable = select_trainable(model, args.trainable_parameters)
        chunk = resolved.loss_chunk  # `loss_chunk_size`: the head computes the loss in chunks (models/chunked_loss.py)
        if chunk.reason:
            logger.info("chunked loss not used: %s", chunk.reason)
        if chunk.size:
            install_chunked_loss(model, chunk.size, chunk.explicit, resolved.z_loss_coeff)
    idle = idle_expert_parameters(model, resolved.moe.shape) if resolved.moe is not None else 0
    facts = ModelFacts(parameters, trainable, model.get_input_embeddings().weight.shape[0],
                       getattr(model.get_output_embeddings(), "loss_chunk_size", 0),
                       flops_per_token(model, resolved.sizes.seq_length, idle, resolved.mtp_depths),
                       checkpoint.stats if checkpoint is not None else None)
    return facts, model_callbacks(model, resolved) if training else []
