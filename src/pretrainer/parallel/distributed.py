"""What every multi-process engine shares: the collectives on the world process group (parallel/world.py joins
it), context parallelism's groups, and the tensor-by-tensor export."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..config.names import parameter_name
from . import context_parallel
from .engine import Engine

logger = logging.getLogger(__name__)


class DistributedEngine(Engine):
    """An engine over the world's process group (one process is a group of one)."""

    joins_process_group = True
    own_keys = ("distributed_timeout_minutes",)

    def __init__(self, options, world, meshes):
        super().__init__(options, world, meshes)
        cp = self.dims.cp
        self.context = context_parallel.ContextParallel(cp, meshes.context_rank(), meshes.context(),
                                                        multiple=self.context_multiple) if cp > 1 else None

    @property
    def context_multiple(self) -> int:
        """What each rank's piece of a sequence must be a multiple of (sequence parallelism splits it again)."""
        return 1

    # ------------------------------------------------------------ context parallelism
    def shard_batch(self, batch: dict) -> dict:
        return self.context.shard(batch) if self.context else batch

    def release(self) -> None:
        self.context = None
        self.meshes.release()

    def install_context_parallel(self, model: torch.nn.Module) -> None:
        """Context-parallel attention on the whole model (the first of the parallelize steps)."""
        if self.context:
            context_parallel.install(model, self.context.degree)

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

    def forward(self, model: torch.nn.Module, batch: dict, per_token: bool = False):
        with self.sequence_layout(batch):
            return super().forward(model, batch, per_token)

    def backward(self, loss: torch.Tensor) -> None:
        with self.sequence_layout():
            super().backward(loss)

    def export_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
        """One tensor at a time (see Engine.export_tensors): the ranks holding a tensor gather it whole (a DTensor's
        shards over its own mesh), and the first of them sends it to the main rank unless it is the main rank. Ranks
        not holding a tensor (other pipeline stages) have it on the meta device; all see the same names in order."""
        state = {parameter_name(k): v for k, v in self.unwrap(model).state_dict().items()}
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

    def any_rank(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.meshes.host())
        return bool(value.item())
