"""The engine interface the training loop talks to, and the single-process engine.

An engine owns devices, process groups, model wrapping, mixed precision,
the optimizer step and what goes into a checkpoint. The loop never branches on
the engine's name: engines implement the same methods, and what differs between
them is declared as capabilities (class attributes below) that the loop reads.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ..batch import batch_targets, forward_logits
from ..config import ConfigError, RunPlan, torch_dtype
from ..models import checkpoint_name, cpu_attention, has_meta_tensors, materialize
from .activation_checkpoint import apply_activation_checkpointing, decoder_layers
from .gradient_norm import clip_, global_norm

logger = logging.getLogger(__name__)

# Optimizer state and hyperparameters keyed by parameter name (`param_groups.<name>.lr`), not by group
# position: ranks that hold different parameters (pipeline stages) save and load their own groups, and a
# checkpoint loads on any other layout.
CHECKPOINT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        try:
            device = torch.device(name)
        except RuntimeError as exc:
            raise ConfigError(f"key 'device': {exc}") from None
        available = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if device.type != "cpu" and (available is None or available.type != device.type):
            raise ConfigError(f"key 'device': {name!r}, but this machine has "
                              f"{'no accelerator' if available is None else 'a ' + available.type + ' device'}"
                              "; set device: auto (or cpu)")
        return device
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device(accelerator.type) if accelerator is not None else torch.device("cpu")


def check_dtype(args, device: torch.device) -> str | None:
    """Resolve `dtype: auto` for `device` (returns why), and warn when an explicit low precision is slower
    than fp32 on this CPU (measured, see perf/dtype_choice.py)."""
    from ..perf.dtype_choice import choose_dtype, cpu_matrix_flags, cpu_speedup, slow_dtype_warning

    on_cpu = device.type == "cpu"
    if args.dtype == "auto":
        accelerator_bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else not on_cpu
        args.dtype, reason = choose_dtype(device.type, accelerator_bf16, cpu_speedup("bf16") if on_cpu else None,
                                          cpu_matrix_flags() if on_cpu else [])
        logger.info("dtype: auto -> %s: %s", args.dtype, reason)
        return reason
    if on_cpu and args.dtype != "fp32":
        warning = slow_dtype_warning(args.dtype, cpu_speedup(args.dtype), cpu_matrix_flags())
        if warning:
            logger.warning("%s", warning)
    return None


class Precision:
    """fp32 master weights; bf16/fp16 compute by autocast; fp16 adds dynamic loss scaling."""

    def __init__(self, dtype: str, device: torch.device):
        self.dtype = dtype
        self.device = device
        self.compute_dtype = torch_dtype(dtype)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    def autocast(self):
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def compile_layers(model: torch.nn.Module, precision: Precision) -> None:
    """`torch.compile` each decoder layer in place (as torchtitan does): identical layers share one compiled
    graph, the compile stays inside FSDP/DDP wrapping, and state-dict keys do not change. In bf16/fp16 on a
    CPU, `sdpa` attention becomes models/cpu_attention.py's, whose backward the compile fuses."""
    if precision.device.type == "cpu" and precision.dtype != "fp32":
        cpu_attention.install(model)
    for layer in decoder_layers(model):
        layer.compile()


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class Engine(ABC):
    name: str

    # ---- capabilities: what the loop and the checkpointer may rely on (subclasses override) ----
    # Parameters are re-created as shards when the model is wrapped: an optimizer built over the
    # unwrapped model's parameters cannot be used.
    shards_parameters = False
    # Builds an HF checkpoint's model on the meta device and fills each rank's slices from the files
    # (models/hf_weights.py) instead of loading it whole in every process.
    reads_weight_slices = False
    # Every update handed to `step` is applied (the engine's own optimizer step cannot be skipped).
    applies_every_update = False
    # How model/optimizer state is written: "dcp" (torch.distributed.checkpoint, reshardable onto any
    # layout) or the engine's own format.
    checkpoint_format = "dcp"
    # Checkpoints load only on the same number of processes.
    checkpoint_needs_same_world_size = False
    supports_async_save = True
    # The HF export streams the weights tensor by tensor (`export_tensors`) instead of one full state dict.
    exports_tensor_by_tensor = True
    model_parallel_size = 1  # ranks that hold one model replica together (tensor x pipeline parallel)

    def __init__(self, args):
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype_reason = check_dtype(args, self.device)
        self.precision = Precision(args.dtype, self.device)
        self.rank = 0
        self.world_size = 1
        self.plan: RunPlan | None = None  # given by setup()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel replicas (which part of the data it reads)."""
        return self.rank

    @property
    def data_world_size(self) -> int:
        """How many replicas read different data."""
        return self.world_size

    @property
    def gradient_average_size(self) -> int:
        """Over how many ranks' gradients the engine averages (the loop scales the loss to undo it)."""
        return self.data_world_size

    def shard_batch(self, batch: dict) -> dict:
        """This rank's part of a host batch (context parallelism splits sequences; others keep it whole)."""
        return batch

    @abstractmethod
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place and wrap the model (DDP/FSDP/...); return what the loop calls forward on."""

    def setup(self, model: torch.nn.Module, plan: RunPlan, optimizer, scheduler, build_optimizer, build_scheduler):
        """Wrap the model for the run `plan` describes and pair it with an optimizer and schedule (given, or
        built over the wrapped model)."""
        model = self.place(model, plan)
        optimizer = optimizer or build_optimizer(model)
        return model, optimizer, scheduler or build_scheduler(optimizer)

    def place(self, model: torch.nn.Module, plan: RunPlan) -> torch.nn.Module:
        """Wrap the model for the run `plan` describes, without an optimizer (training setup, export)."""
        self.plan = plan
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
        self.precision.scale(loss).backward()

    def forward(self, model: torch.nn.Module, batch: dict) -> torch.Tensor | None:
        """Logits of a device batch (None on ranks that produce none, e.g. early pipeline stages)."""
        return forward_logits(model, batch)

    def forward_backward(self, model: torch.nn.Module, micro_batches: list[dict], loss_fn,
                         scale: float) -> torch.Tensor:
        """Forward and backward over one accumulation window; gradients of sum(loss_fn) * scale.

        `loss_fn(logits, targets)` returns a micro-batch's summed token loss. Returns this rank's summed
        loss over the window (a device tensor). Only the last micro-batch communicates gradients.
        """
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for index, batch in enumerate(micro_batches):
            is_last = index == len(micro_batches) - 1
            with (contextlib.nullcontext() if is_last else self.no_sync(model)):
                with self.autocast():
                    logits = self.forward(model, batch)
                summed = loss_fn(logits, batch_targets(batch))
                self.backward(summed * scale)
            local += summed.detach().double()
        return local

    def step(self, model: torch.nn.Module, optimizer, max_norm: float | None,
             skip_nonfinite: bool = True, skip: bool = False) -> tuple[torch.Tensor, bool]:
        """Unscale, clip, step. Returns (grad norm before clipping, whether the update was applied).

        With `skip_nonfinite`, a non-finite gradient norm (a NaN/inf loss or gradient on any rank: the norm
        is global) skips the update; that check reads the norm, the one device sync of a step. fp16 runs
        leave it to the loss scaler, which skips and lowers the scale. `skip` drops this update regardless
        (a loss spike); the norm is still computed, for the log.
        """
        scaler = self.precision.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = self.clip_gradients([p for p in model.parameters() if p.grad is not None], max_norm)
        if skip:
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
        grad_norm = global_norm(grads, self.gradient_holders, self.sum_over_ranks, self.device)
        if max_norm and grads:
            clip_(grads, max_norm, grad_norm)
        return grad_norm

    @property
    def gradient_holders(self) -> int:
        """Ranks over which each gradient is copied or split (a plain tensor is copied on each): all of them."""
        return self.world_size

    def sum_over_ranks(self, value: torch.Tensor) -> None:
        """Sum a device tensor over every rank, in place."""

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Host-side integer counts, summed over ranks, as a device tensor. Never waits for the device: the
        copy is asynchronous from pinned memory and the all-reduce (distributed engines) is queued."""
        return to_device_async(counts, self.device)

    def reduce_max(self, value: float) -> float:
        """The largest of a host-side number over ranks."""
        return value

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj):
        """The main rank's `obj` on every rank (picklable objects)."""
        return obj

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        return [obj]

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (a host-side collective: never waits for the device)."""
        return flag

    def save_state(self, folder, model: torch.nn.Module, optimizer) -> None:
        """Write model and optimizer state into `folder` (every rank takes part)."""
        dcp.save(self.checkpoint_state(model, optimizer), checkpoint_id=str(folder))

    def save_state_async(self, folder, model: torch.nn.Module, optimizer):
        """Stage the state in host memory and write it in the background; returns a future."""
        return dcp.async_save(self.checkpoint_state(model, optimizer), checkpoint_id=str(folder), no_dist=True)

    def load_state(self, folder, model: torch.nn.Module, optimizer) -> None:
        options = CHECKPOINT_OPTIONS
        state = self.checkpoint_state(model, optimizer)
        try:
            dcp.load(state, checkpoint_id=str(folder))
        except (RuntimeError, CheckpointException) as exc:
            if "Missing key in checkpoint state_dict: optimizer.param_groups." not in str(exc):
                raise
            # Written with optimizer state keyed by parameter-group position (the layout before pipeline
            # ranks needed per-name groups; one process or data parallel): read that layout.
            options = StateDictOptions()
            state = self.checkpoint_state(model, optimizer, options)
            dcp.load(state, checkpoint_id=str(folder))
        self.load_checkpoint_state(model, optimizer, state, options)

    def checkpoint_state(self, model: torch.nn.Module, optimizer, options: StateDictOptions = CHECKPOINT_OPTIONS
                         ) -> dict:
        """Model and optimizer state for torch.distributed.checkpoint (sharded where the engine shards)."""
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_checkpoint_state(self, model: torch.nn.Module, optimizer, state: dict,
                              options: StateDictOptions = CHECKPOINT_OPTIONS) -> None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)

    def full_state_dict(self, model: torch.nn.Module) -> dict:
        """The whole model's weights on CPU, for HF export (complete on the main rank only)."""
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def export_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The model's weights under their HF names, in its state-dict order, one whole tensor at a time: on
        the main rank on the CPU, None on the others. Every rank iterates to the end (each takes part in
        gathering each tensor), and no rank holds more than one whole tensor at a time."""
        for name, tensor in self.unwrap(model).state_dict().items():
            yield checkpoint_name(name), tensor.detach().cpu()

    def materialize_if_meta(self, model: torch.nn.Module) -> None:
        if has_meta_tensors(model):
            materialize(model, self.device, self.args.seed)

    def prepare_layers(self, model: torch.nn.Module) -> None:
        """Per-layer transforms, before an engine wraps or shards the model: checkpointing, then compile."""
        apply_activation_checkpointing(model, self.args.activation_checkpointing)
        if self.args.compile:
            compile_layers(model, self.precision)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return (f"engine={self.name} world_size={self.world_size} device={self.device} dtype={self.args.dtype} "
                f"activation_checkpointing={self.args.activation_checkpointing}")


class SingleEngine(Engine):
    """One process, one device."""

    name = "single"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.prepare_layers(model)
        self.materialize_if_meta(model)
        return model.to(self.device)
