"""The processes of a run: joined from what the launcher (torchrun, accelerate, deepspeed) put in the
environment, or planned (`pretrainer plan`: a world size and no process group).

The world process group is made here, once, before the run is resolved (a `dtype: auto` measured on every
rank needs rank 0's choice broadcast); engines build their meshes and subgroups on it. It is destroyed once,
last (`destroy_process_group`: by `World.close`, or at interpreter exit), while the interpreter is fully
alive, and then gloo's worker threads are let finish: a gloo worker that drops the last reference to a
finished collective takes the GIL to free its tensors; if the interpreter is already finalizing, CPython ends
that thread with a forced unwind through a `noexcept` destructor and the process aborts ("terminate called
without an active exception", SIGABRT: pytorch/pytorch#190489). Waiting for them first removes that race.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ConfigError

logger = logging.getLogger(__name__)

# The Worlds joined to the process group this module created and not closed yet (by a number each): the group is
# destroyed when the last leaves, so closing one run in a process (a trainer, an export) never ends another's, and a
# group the caller created is never destroyed here.
_OPEN_WORLDS: set[int] = set()
_LEASES = itertools.count(1)
_created = False  # this module created the default group
GLOO_WORKER = "pt_gloo_runloop"  # the name of ProcessGroupGloo's worker threads
FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())  # the futex syscall's number
# How a blocked thread waits: a condition variable (a gloo worker on its queue), or a plain futex word (an OpenMP
# worker between parallel regions; those a gloo worker starts inherit its thread name)
FUTEX_WAIT, FUTEX_WAIT_BITSET, FUTEX_CMD_MASK = 0, 9, 0x7F


def launch_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int              # processes on this machine
    device: torch.device         # this process's device
    joined: bool = False         # a process group exists (every engine's run; not a planned world)
    lease: int = 0               # this World's number among those using the group this module created (0: none)

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

    def close(self, barrier: bool = True) -> None:
        """Leave the process group; the last World of this process to leave the group this module created destroys
        it: with `barrier`, once every rank has got here (a clean end; after a failure a peer may be gone)."""
        global _created
        if self.lease in _OPEN_WORLDS:
            _OPEN_WORLDS.discard(self.lease)
            if not _OPEN_WORLDS and _created:
                _created = False
                destroy_process_group(barrier)


def open_worlds() -> int:
    """How many Worlds of this process still use the group this module created."""
    return len(_OPEN_WORLDS)


def planned_world(size: int, local_size: int, device: torch.device) -> World:
    """A world that is only planned: rank 0 of `size` processes, `local_size` to a machine, no process group."""
    return World(0, size, 0, min(local_size, size), device)


def join_world(device: torch.device, timeout_minutes: float) -> World:
    """Join (or create) the world process group the launch describes; a launch-free process gets a group of
    one. On an accelerator, this process takes the device of its local rank."""
    global _created
    local_rank, launched = int(os.environ.get("LOCAL_RANK", "0")), launch_world_size()
    if launched > 1 and "MASTER_ADDR" not in os.environ:
        raise ConfigError(f"WORLD_SIZE={launched} but MASTER_ADDR is not set: start the processes with torchrun, "
                          "accelerate launch or deepspeed")
    if device.type != "cpu" and (launched > 1 or device.index is None):  # one process keeps a device it names
        device = torch.device(device.type, local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    lease = 0
    if not dist.is_initialized():
        backend = {"cpu": "gloo", "cuda": "nccl"}.get(device.type)
        # A rank that dies or hangs makes the others' next collective fail after this long.
        options = {"backend": backend, "timeout": datetime.timedelta(minutes=timeout_minutes)}
        if launched == 1:
            # A group of one meets in this process's memory: no port to pick, none another process could take, and
            # a shell's leftover MASTER_ADDR / MASTER_PORT are not read.
            options.update(store=dist.HashStore(), rank=0, world_size=1)
        elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            options.update(_restart_store(options["timeout"]))
        excepthook = sys.excepthook
        dist.init_process_group(**options)
        if launched == 1:
            sys.excepthook = excepthook  # no rank to prefix each traceback line with, however often a group is made
        atexit.register(destroy_process_group)
        _created = True
        _OPEN_WORLDS.clear()  # any left are of a group destroyed since
    if _created:
        lease = next(_LEASES)
        _OPEN_WORLDS.add(lease)
    else:  # the caller's group (an Accelerator's): theirs to use until exit, where gloo's workers are let finish
        atexit.register(destroy_process_group)
    size = dist.get_world_size()
    return World(dist.get_rank(), size, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", size)), device, True,
                 lease)


def destroy_process_group(barrier: bool = False) -> None:
    """Destroy every process group (a no-op when there is none), free the groups nothing else holds (their
    destructors join their worker threads), and wait until gloo's remaining workers are idle."""
    if not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
    # A worker may still be freeing the last collective, holding its queue's lock while it waits for the GIL;
    # destroying the group takes that lock with the GIL held: a deadlock (a rank hung at exit after a resume
    # that found the run complete). Waiting without the GIL lets the worker finish first.
    wait_for_idle_gloo_workers()
    dist.destroy_process_group()
    gc.collect()  # groups held only in reference cycles (meshes, wrapped modules) are freed now, threads joined
    if not wait_for_idle_gloo_workers():
        logger.warning("gloo worker threads are still busy after the process group was destroyed")


def wait_for_idle_gloo_workers(timeout_s: float = 10.0) -> bool:
    """Wait, without the GIL, until every gloo worker thread of this process is idle (blocked on its queue's
    condition variable, untimed) or gone; a worker still freeing a collective (it waits for the GIL with a
    timeout) or running is busy. Linux only (elsewhere: a short pause). False if still busy at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = _gloo_worker_states()
        if states is None:
            time.sleep(0.05)
            return True
        if all(_idle(state) for state in states):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)  # releases the GIL for a worker that needs it


def _gloo_worker_states() -> list[list[str]] | None:
    """The `/proc/self/task/*/syscall` lines of the threads named as gloo workers: theirs, and the OpenMP threads a
    worker starts (None: not readable here)."""
    if FUTEX is None:
        return None
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() != GLOO_WORKER:
                    continue
            with open(f"/proc/self/task/{task}/syscall") as f:
                states.append(f.read().split())
        except OSError:  # the thread ended meanwhile
            continue
    return states


def _idle(syscall: list[str]) -> bool:
    try:
        number, operation, timeout = int(syscall[0]), int(syscall[2], 16), int(syscall[4], 16)
    except (IndexError, ValueError):  # "running"
        return False
    return number == FUTEX and operation & FUTEX_CMD_MASK in (FUTEX_WAIT, FUTEX_WAIT_BITSET) and timeout == 0


def _restart_store(timeout: datetime.timedelta) -> dict:
    """After `torchrun --max-restarts` restarts the workers, the store can still hold the previous attempt's
    process-group keys (a dead rank's address): a fresh key prefix per attempt keeps the new group off them."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return {"store": dist.PrefixStore(f"pretrainer/attempt{attempt}/", store), "rank": rank,
            "world_size": world_size}
