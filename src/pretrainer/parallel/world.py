"""The processes of a run: joined from what the launcher (torchrun, accelerate, deepspeed) put in the
environment, or planned (`pretrainer plan`: a world size and no process group).

The world process group is made here, once, before the run is resolved (a `dtype: auto` measured on every
rank needs rank 0's choice broadcast); engines build their meshes and subgroups on it. It is destroyed once,
last, by `World.close` (or at exit when a run ends by an exception).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ConfigError


def launch_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int              # processes on this machine
    device: torch.device         # this process's device
    joined: bool = False         # a process group exists (the distributed engines)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast_object(self, obj):
        """The main rank's `obj` (picklable) on every rank."""
        if not self.joined or self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.joined or self.size == 1:
            return [obj]
        gathered = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self) -> None:
        if self.joined:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group: every rank waits for the others, then the group is destroyed (once)."""
        if self.joined and dist.is_initialized():
            dist.barrier()
            destroy_process_group()


def planned_world(size: int, local_size: int, device: torch.device) -> World:
    """A world that is only planned: rank 0 of `size` processes, `local_size` to a machine, no process group."""
    return World(0, size, 0, min(local_size, size), device)


def join_world(device: torch.device, timeout_minutes: float) -> World:
    """Join (or create) the world process group the launch describes; a launch-free process gets a group of
    one. On an accelerator, this process takes the device of its local rank."""
    local_rank = launch_local_rank()
    if device.type != "cpu":
        device = torch.device(device.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    if not dist.is_initialized():
        backend = {"cpu": "gloo", "cuda": "nccl"}.get(device.type)
        # A rank that dies or hangs makes the others' next collective fail after this long.
        options = {"backend": backend, "timeout": datetime.timedelta(minutes=timeout_minutes)}
        if "MASTER_ADDR" not in os.environ:
            if launch_world_size() > 1:
                raise ConfigError(f"WORLD_SIZE={launch_world_size()} but MASTER_ADDR is not set: start the "
                                  "processes with torchrun, accelerate launch or deepspeed")
            options.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            options.update(_restart_store(options["timeout"]))
        dist.init_process_group(**options)
        atexit.register(destroy_process_group)
    size = dist.get_world_size()
    return World(dist.get_rank(), size, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", size)), device, True)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _restart_store(timeout: datetime.timedelta) -> dict:
    """After `torchrun --max-restarts` restarts the workers, the store can still hold the previous attempt's
    process-group keys (a dead rank's address); a fresh key prefix per attempt keeps the new group from
    connecting to them."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return {"store": dist.PrefixStore(f"pretrainer/attempt{attempt}/", store), "rank": rank,
            "world_size": world_size}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
