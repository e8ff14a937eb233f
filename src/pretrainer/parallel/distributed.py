"""Process groups and the collectives every multi-process engine shares."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from ..config import ConfigError
from ..models import checkpoint_name
from . import context_parallel
from .engine import Engine, Precision, resolve_device

logger = logging.getLogger(__name__)


def launch_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


class DistributedEngine(Engine):
    """Joins the process group the launcher (torchrun, accelerate, deepspeed) describes in the environment."""

    supports_context_parallel = False  # engines whose ranks can split sequences (see context_parallel.py)

    def __init__(self, args):
        super().__init__(args)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.device.type != "cpu":
            self.device = torch.device(self.device.type, self.local_rank)
            torch.accelerator.set_device_index(self.local_rank)
            self.precision.device = self.device
        if not dist.is_initialized():
            backend = {"cpu": "gloo", "cuda": "nccl"}.get(self.device.type)
            # A rank that dies or hangs makes the others' next collective fail after this long.
            options = {"backend": backend, "timeout": datetime.timedelta(minutes=args.distributed_timeout_minutes)}
            if "MASTER_ADDR" not in os.environ:
                if launch_world_size() > 1:
                    raise ConfigError(f"WORLD_SIZE={launch_world_size()} but MASTER_ADDR is not set: start the "
                                      "processes with torchrun, accelerate launch or deepspeed")
                # started without a launcher: a group of one
                options.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
            elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
                options.update(_restart_store(options["timeout"]))
            dist.init_process_group(**options)
            atexit.register(_destroy_process_group)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.dtype_reason is not None and self.world_size > 1:  # dtype: auto, measured on each rank
            chosen = self.broadcast_object(args.dtype)  # rank 0's choice, so no two ranks differ
            if chosen != args.dtype:
                args.dtype = chosen
                self.precision = Precision(chosen, self.device)
        self.context = None
        if args.context_parallel_degree > 1:
            if not self.supports_context_parallel:
                raise ConfigError(f"key 'context_parallel_degree': engine {self.name} does not split sequences "
                                  "over ranks; use engine ddp, fsdp or megatron")
            self.context = self.context_group(args.context_parallel_degree)
            self.model_parallel_size = args.context_parallel_degree  # ranks that read one replica's batches

    def context_group(self, degree: int) -> context_parallel.ContextParallel | None:
        """This rank's context-parallel group (consecutive ranks)."""
        return context_parallel.create(degree, self.rank, self.world_size)

    # ------------------------------------------------------------ context parallelism
    @property
    def data_rank(self) -> int:
        return self.rank // self.context.degree if self.context else self.rank

    @property
    def data_world_size(self) -> int:
        return self.world_size // self.context.degree if self.context else self.world_size

    @property
    def gradient_average_size(self) -> int:
        # ddp and fsdp average over every rank; the cp ranks of a replica each hold part of its loss
        return self.world_size if self.context else self.data_world_size

    def shard_batch(self, batch: dict) -> dict:
        return self.context.shard(batch) if self.context else batch

    def prepare_layers(self, model: torch.nn.Module) -> None:
        if self.context:
            context_parallel.install(model, self.context.degree)
        super().prepare_layers(model)

    def describe(self) -> str:
        return super().describe() + (f" context_parallel_degree={self.context.degree}" if self.context else "")

    def sequence_layout(self, batch: dict | None = None):
        """Context: attention runs on the context-parallel layout of `batch` (or of the last batch given, for
        its backward, where activation checkpointing recomputes attention); nothing without cp."""
        if not self.context:
            return contextlib.nullcontext()
        if batch is not None:
            self._window = batch["cp_length"]
        return self.context.active(self._window)

    def forward(self, model: torch.nn.Module, batch: dict):
        with self.sequence_layout(batch):
            return super().forward(model, batch)

    def backward(self, loss: torch.Tensor) -> None:
        with self.sequence_layout():
            super().backward(loss)

    def save_state_async(self, folder, model, optimizer):
        # The background writer coordinates over its own gloo group, so its collectives never interleave
        # with the training loop's on the main group.
        if getattr(self, "_checkpoint_group", None) is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return dcp.async_save(self.checkpoint_state(model, optimizer), checkpoint_id=str(folder),
                              process_group=self._checkpoint_group)

    def export_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
        """One tensor at a time (see Engine.export_tensors): the ranks holding a tensor gather it whole (a
        DTensor's shards over its own mesh), and the first of them sends it to the main rank unless that is
        the main rank itself. Ranks that do not hold a tensor (other pipeline stages) hold it on the meta
        device; every rank sees the same names in the same order."""
        state = {checkpoint_name(k): v for k, v in self.unwrap(model).state_dict().items()}
        holders = self.all_gather_object([name for name, tensor in state.items() if not tensor.is_meta])
        sender = {}
        for rank, names in enumerate(holders):
            for name in names:
                sender.setdefault(name, rank)
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

    def sum_over_ranks(self, value: torch.Tensor) -> None:
        dist.all_reduce(value)

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        dist.all_reduce(value)
        return value

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        counts = super().reduce_counts(counts)
        dist.all_reduce(counts)
        return counts

    def reduce_max(self, value: float) -> float:
        tensor = torch.tensor(value, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj) -> list:
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def any_rank(self, flag: bool) -> bool:
        if getattr(self, "_host_group", None) is None:  # CPU tensors need a gloo group beside NCCL
            self._host_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._host_group)
        return bool(value.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            _destroy_process_group()


def _restart_store(timeout: datetime.timedelta) -> dict:
    """After `torchrun --max-restarts` restarts the workers, the store can still hold the previous attempt's
    process-group keys (a dead rank's address); a fresh key prefix per attempt keeps the new group from
    connecting to them."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return {"store": dist.PrefixStore(f"pretrainer/attempt{attempt}/", store), "rank": rank,
            "world_size": world_size}


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


__all__ = ["DistributedEngine", "launch_world_size", "resolve_device"]
