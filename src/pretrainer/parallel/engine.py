"""The engine interface the training loop talks to, over the world's process group (parallel/world.py joins it; one
process is a group of one): the collectives, context parallelism's groups and the tensor-by-tensor export.

An engine owns the process groups it builds on the world, model wrapping, mixed precision, the optimizer step and what
goes into a checkpoint. The loop never branches on the engine's name: engines implement the same methods, and what
differs is declared as capabilities (class attributes below) that the loop reads. An engine is built from its part of
the resolved run (`EngineOptions`), never from the arguments. Its class inherits its traits (parallel/layout.py's
`EngineTraits`); its costs are a separate cost model registered beside it (parallel/registry.py).
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.tensor import DTensor

from ..batch import HeadOutput, batch_targets, forward_head
from ..config import ParallelDims, Parametrization
from ..config.names import parameter_name
from ..models import has_meta_tensors, materialize, takes_head_call
from . import context_parallel
from .activation_checkpoint import RecomputeSettings
from .expert_parallel import expert_ranks
from .gradient_norm import clip_, global_norm
from .layout import EngineTraits, HeldState, tensor_bytes
from .parallelize import Parallelism
from .precision import Precision
from .world import World

logger = logging.getLogger(__name__)


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if device.type == "cpu" else tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class EngineOptions:
    """An engine's part of the resolved run."""
    dims: ParallelDims
    dtype: str                          # compute dtype: bf16 | fp16 | fp32
    settings: object = None             # the engine's own (DeepSpeedSettings, MegatronSettings)
    recompute: RecomputeSettings = RecomputeSettings()
    compile: bool = False
    seed: int = 0                       # the init of a model built on the meta device
    seq_length: int = 0
    micro_batch_size: int = 1
    accumulate: str = "unsharded"       # sharded | unsharded (auto: decided by the memory plan) | auto
    accumulate_reason: str = ""         # why, when auto chose it
    parametrization: Parametrization = Parametrization()  # how init (and the optimizer's lrs) scale with size


class Engine(EngineTraits, ABC):
    name: str

    # ---- capabilities the loop and the checkpointer rely on (docs/architecture.md's table; subclasses override) ----
    shards_parameters = False
    applies_every_update = False
    checkpoint_format = "dcp"
    checkpoint_needs_same_world_size = False
    supports_async_save = True
    # The HF export streams the weights tensor by tensor (`export_tensors`) instead of one full state dict.
    exports_tensor_by_tensor = True
    one_process = False
    # Config keys only engines of this kind read (run/rules.py refuses or warns of them under other engines).
    own_keys: tuple[str, ...] = ("distributed_timeout_minutes",)

    def __init__(self, options: EngineOptions, world: World, meshes):
        self.options, self.world, self.meshes = options, world, meshes
        self.dims, self.settings = options.dims, options.settings
        self.device = world.device
        self.precision = Precision(options.dtype, self.device)
        self.rank, self.world_size = world.rank, world.size
        cp = self.dims.cp
        self.context = context_parallel.ContextParallel(cp, meshes.context_rank(), meshes.context(),
                                                        multiple=self.context_multiple) if cp > 1 else None

    # ---- what an engine is built from: the resolver asks the class (nothing is launched yet) ----
    @classmethod
    def read_settings(cls, args, model_config, world_size: int, dtype: str):
        """The engine's own settings from the config, checked (`model_config`: the HF config, None when not
        known; `dtype`: the resolved compute dtype)."""
        return None

    @classmethod
    def replica_ranks(cls, args) -> int:
        """The ranks of one replica the config describes (before a world is known): cp."""
        return args.context_parallel_degree

    @classmethod
    def parallel_style(cls, settings) -> tuple[bool, str]:
        """(sequence parallelism, pipeline schedule) of the settings."""
        return False, "1f1b"

    @classmethod
    def recompute(cls, args, settings) -> RecomputeSettings:
        """Activation checkpointing as this engine applies it."""
        return RecomputeSettings(args.activation_checkpointing)

    @property
    def reads_slices(self) -> bool:
        return self.reads_weight_slices(self.settings)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel replicas (which part of the data it reads): the ranks of
        one replica (tp x pp x cp) are consecutive."""
        return self.rank // self.dims.replica_ranks

    def mean_weight(self, units):
        """The weight of a summed loss in the gradient of its mean over `units` (global count of tokens, sequences or
        micro-batches): 1 / units times the ranks each gradient is averaged over, undoing every engine's averaging."""
        return self.dims.gradient_ranks / units

    @property
    def data_world_size(self) -> int:
        """How many replicas read different data."""
        return self.dims.dp

    def shard_batch(self, batch: dict) -> dict:
        """This rank's part of a host batch (context parallelism splits sequences; otherwise it is kept whole)."""
        return self.context.shard(batch) if self.context else batch

    @property
    def context_multiple(self) -> int:
        """What each rank's piece of a sequence must be a multiple of (sequence parallelism splits it again)."""
        return 1

    def sequence_layout(self, batch: dict | None = None):
        """Context: attention runs on the context-parallel layout of `batch` (or of the last batch given, for its
        backward, where activation checkpointing recomputes attention); nothing without cp."""
        if not self.context:
            return contextlib.nullcontext()
        if batch is not None:
            self._window = batch["cp_length"]
        return self.context.active(self._window)

    @abstractmethod
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place and wrap the model (DDP/FSDP/...); return what the loop calls forward on."""

    def setup(self, model: torch.nn.Module, optimizer, scheduler, build_optimizer, build_scheduler):
        """Wrap the model and pair it with an optimizer and schedule (given, or built over the wrapped model)."""
        model = self.place(model)
        optimizer = optimizer or build_optimizer(model)
        return model, optimizer, scheduler or build_scheduler(optimizer)

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap the model, without an optimizer (training setup, export)."""
        return self.wrap(model)

    def finish_step(self, optimizer, scheduler) -> None:
        """After an update: advance the schedule once and clear gradients."""
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def autocast(self):
        """Context for forward passes: autocast to the compute dtype (engines that cast weights opt out)."""
        return self.precision.autocast()

    def no_sync(self, model: torch.nn.Module):
        """Context for accumulation micro-batches that must not communicate gradients."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        with self.sequence_layout():
            self.precision.scale(loss).backward()

    def forward(self, model: torch.nn.Module, batch: dict, per_token: bool = False) -> HeadOutput | None:
        """A device batch's forward (None on ranks that produce none, e.g. early pipeline stages); `per_token`: a
        head that computes the loss returns each target's loss (scoring)."""
        with self.sequence_layout(batch):
            return forward_head(model, batch, takes_head_call(self.unwrap(model)), per_token)

    def forward_backward(self, model: torch.nn.Module, micro_batches: list[dict], loss_fn,
                         scale: float, extra_losses=None) -> torch.Tensor:
        """Forward and backward over one accumulation window: gradients of sum(loss_fn) * scale; returns this rank's
        summed loss over the window (a device tensor), without what `extra_losses()` (called after each forward:
        an already weighted addition to its backward, e.g. MoE balancing losses; None: nothing) adds. Only the last
        micro-batch communicates gradients."""
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for index, batch in enumerate(micro_batches):
            is_last = index == len(micro_batches) - 1
            with (contextlib.nullcontext() if is_last else self.no_sync(model)):
                with self.autocast():
                    output = self.forward(model, batch)
                summed = loss_fn(output, batch_targets(batch))
                extra = extra_losses() if extra_losses is not None else None
                self.backward(summed * scale if extra is None else summed * scale + extra)
            local += summed.detach().double()
        return local

    def step(self, model: torch.nn.Module, optimizer, max_norm: float | None,
             skip_nonfinite: bool = True, skip_rule=None) -> tuple[torch.Tensor, bool]:
        """Unscale, clip, step. Returns (grad norm before clipping, whether the update was applied). With
        `skip_nonfinite`, a non-finite norm (global: a NaN/inf on any rank) skips the update; reading it is the one
        device sync of a step (fp16 runs leave it to the loss scaler). `skip_rule(norm)` (the spike rules) may drop
        the update and the step's loss in the same sync; the norm is still computed, for the log."""
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = self.clip_gradients([p for p in model.parameters() if p.grad is not None], max_norm)
        if skip_rule is not None and skip_rule(grad_norm):
            if scaler is not None:
                scaler.update()  # keeps the scaler's per-step bookkeeping consistent
            return grad_norm, False
        if scaler is not None:
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            return grad_norm, scaler.get_scale() >= scale_before
        if skip_nonfinite and not torch.isfinite(grad_norm):
            return grad_norm, False
        optimizer.step()
        return grad_norm, True

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """The global norm of the parameters' gradients (before clipping); scales them down to `max_norm`."""
        grads = [p.grad for p in params]
        counted = [p.grad for p in params if not self.is_replica(p)]
        grad_norm = global_norm(counted, self.gradient_holders, self.sum_over_ranks, self.device)
        if max_norm and grads:
            clip_(grads, max_norm, grad_norm)
        return grad_norm

    def is_replica(self, param: torch.Tensor) -> bool:
        """Whether this rank holds `param` as a copy of a parameter another pipeline stage holds (its gradient then
        counts once in the global norm, where the other stage counts it)."""
        return False

    @property
    def gradient_holders(self) -> int:
        """Ranks over which each gradient is copied or split (a plain tensor is copied on each): all of them."""
        return self.world_size

    def sum_over_ranks(self, value: torch.Tensor) -> None:
        """Sum a device tensor over every rank, in place."""
        dist.all_reduce(value)

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        dist.all_reduce(value)
        return value

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Host-side integer counts, summed over ranks, as a device tensor. Never waits for the device: the
        copy is asynchronous from pinned memory and the all-reduce is queued."""
        counts = to_device_async(counts, self.device)
        dist.all_reduce(counts)
        return counts

    def reduce_max(self, value: float) -> float:
        """The largest of a host-side number over ranks."""
        tensor = torch.tensor(value, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    def barrier(self) -> None:
        self.world.barrier()

    def broadcast_object(self, obj):
        """The main rank's `obj` on every rank (picklable objects)."""
        return self.world.broadcast_object(obj)

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        return self.world.all_gather_object(obj)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (a host-side collective: never waits for the device)."""
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.meshes.host())
        return bool(value.item())

    def save_own_state(self, folder) -> None:
        """Write model and optimizer state in the engine's own format (not "dcp": train/checkpoint_io.py's)."""
        raise NotImplementedError

    def load_own_state(self, folder) -> None:
        raise NotImplementedError

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        """The whole model's weights on CPU, for HF export (complete on the main rank only)."""
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def export_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The model's weights under their HF names, in its state-dict order, one whole tensor at a time: on the main
        rank on the CPU, None on the others (docs/loading.md, 'Export without gathering'). Every rank iterates to the
        end; ranks that do not hold a tensor (other pipeline stages) hold it on the meta device."""
        state = {parameter_name(k): v for k, v in self.unwrap(model).state_dict().items()}
        holders = self.all_gather_object([name for name, tensor in state.items() if not tensor.is_meta])
        # each tensor's sender: the first rank holding it (ranks in reverse order: the lowest one's entry is kept)
        sender = {name: rank for rank, names in reversed(list(enumerate(holders))) for name in names}
        for name, tensor in state.items():
            whole = None
            if not tensor.is_meta:
                whole = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
            if sender[name] == 0:
                yield name, whole.cpu() if self.is_main else None
            elif self.rank == sender[name]:
                dist.send(whole.contiguous(), dst=0)
                yield name, None
            elif self.is_main:
                received = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
                dist.recv(received, src=sender[name])
                yield name, received.cpu()
            else:
                yield name, None

    def materialize_if_meta(self, model: torch.nn.Module, device: torch.device | None = None) -> None:
        if has_meta_tensors(model):
            materialize(model, device or self.device, self.options.seed, parametrization=self.options.parametrization)

    def parallelism(self, data_parallel=None, tensor_parallel=None) -> Parallelism:
        """The run's per-layer steps (recompute, compile) around an engine's own parallelism."""
        return Parallelism(tensor_parallel=tensor_parallel, recompute=self.options.recompute,
                           compile=self.precision if self.options.compile else None, data_parallel=data_parallel)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def trained_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module holding this rank's trained parameters, under HF names (the optimizer groups are built on it)."""
        return self.unwrap(model)

    def forward_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules whose forward runs once per micro-batch with the batch's rows first (an MoE model's
        routing hooks start each micro-batch there): the HF model, or a pipeline engine's stages."""
        return [self.unwrap(model)]

    @property
    def balancing_losses_on_activations(self) -> bool:
        """An MoE model's balancing losses ride on the routers' outputs (a pipeline schedule runs the backward of
        each micro-batch itself) instead of being added to each micro-batch's loss by `forward_backward`."""
        return False

    @property
    def routing_group(self):
        """The process group over which each sequence's tokens are split when an MoE block routes them (its
        balancing losses sum the group's token counts); None: every rank routes whole sequences."""
        return None

    # ---- what this rank really holds (the planner's answers are checked against it) ----
    def held_state(self, model: torch.nn.Module, optimizer) -> HeldState:
        return HeldState(tensor_bytes(model.parameters()), self.optimizer_state_bytes(optimizer),
                         self.measured_gradient_ranks(model), self.shard_group_size(),
                         isinstance(self.autocast(), torch.autocast), expert_ranks(self.unwrap(model)))

    def optimizer_state_bytes(self, optimizer) -> int:
        return tensor_bytes(t for state in optimizer.state.values() for t in state.values()
                            if isinstance(t, torch.Tensor))

    def measured_gradient_ranks(self, model: torch.nn.Module) -> int:
        """Ranks of the process group this engine reduces gradients over."""
        return 1

    def shard_group_size(self) -> int:
        return 1

    def release(self) -> None:
        """Drop this engine's references to process groups and meshes, so that destroying the process group
        frees them (their worker threads are joined while the interpreter is alive)."""
        self.context = None
        self.meshes.release()

    def close(self, barrier: bool = True) -> None:
        """Release the engine and leave the world (the process group is destroyed once, last)."""
        self.release()
        self.world.close(barrier)

    def describe(self) -> str:
        options = self.options
        accumulate = f" accumulate_gradients={options.accumulate}" + (f" ({options.accumulate_reason})" if
                                                                     options.accumulate_reason else "") \
            if self.shards_gradients(self.settings) else ""
        return (f"engine={self.name} world_size={self.world_size} device={self.device} dtype={self.precision.dtype} "
                f"activation_checkpointing={options.recompute.describe()}{accumulate}"
                + (f" context_parallel_degree={self.context.degree}" if self.context else ""))
