"""Replica fault tolerance (`fault_tolerance`, docs/checkpoints-and-faults.md 'Replica fault tolerance'): the run's
data-parallel replicate dimension as R replica groups that torchft's Manager and lighthouse keep in step.

Every group runs the same config on its own processes (inside a group every layout runs as without fault
tolerance). Each step a group asks the lighthouse for the quorum (the groups alive), averages its gradients with
the quorum's over torchft's process group, and applies the update only when every member commits. A group that
dies leaves the quorum and the others go on; restarted, it joins at the next quorum, receives the live groups' state
(model, optimizer, the loop's saved state) over torchft's checkpoint transport, and trains on from that step. Each
group reads its own share of every step's data; what a missing group would have read is counted as dropped.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import ReduceOp

from ..config import ConfigError
from ..config.fault_tolerance import FaultTolerance
from ..run.callbacks import Callback
from .checkpoint_io import live_state, load_live_state
from .errors import CollectiveFailure

logger = logging.getLogger("pretrainer")
DILOCO_STATE = "diloco"  # the saved-state component of the outer step (per rank)


def replica_id(group: int) -> str:
    """torchft orders the groups by their ids as strings: zero-padded, group 10 comes after group 9."""
    return f"group{group:05d}"


def advertised_host(lighthouse: str) -> str:
    """The address this machine reaches the lighthouse from: what the other groups are told to connect to (the
    machine's name may not resolve where they run)."""
    host, port = lighthouse.rsplit(":", 1)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), int(port)))  # a UDP connect sends nothing
            return probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"key 'fault_tolerance': the lighthouse's host {host!r} cannot be reached from here "
                          f"({exc}); give fault_tolerance.lighthouse as HOST:PORT of the machine running "
                          "`pretrainer lighthouse`") from None


class ReplicaGroups(Callback):
    """This group's part in the quorum: the Manager, the gradient average, the commit, the rows' counts."""

    def __init__(self, settings: FaultTolerance, group: int, world):
        """Joins the lighthouse at once (before the model is built), so the groups starting together meet in the
        first quorum; `bind` gives it the run's parts before the first step."""
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse client logs every quorum at info
        logging.getLogger("torchft").setLevel(logging.CRITICAL)  # a failure is this module's one line, not a trace
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError:
            raise ConfigError("fault_tolerance needs torchft: pip install torchft (pip install "
                              "'pretrainer[ft]')") from None

        self.settings, self.group, self.world, self.is_main = settings, group, world, world.rank == 0
        self._diloco = None
        self.model = self.optimizer = self.run_state = self.train_state = None
        self.group_samples = self.total_steps = 0
        self.samples_trained = self.samples_dropped = 0
        self._last_sync, self._saved_diloco = 0, None  # diloco: the step of the last sync, its state from storage
        self.participants, self._digest, self._members = settings.replica_groups, None, None
        timeout = timedelta(seconds=settings.timeout_seconds)
        host = world.broadcast_object(advertised_host(settings.lighthouse) if world.rank == 0 else None)
        if host.startswith("127.") and not settings.lighthouse.startswith(("127.", "localhost")):
            logger.warning("replica group %d advertises %s, a loopback address, to the other groups: the name of "
                           "fault_tolerance.lighthouse (%s) resolves to this machine's loopback here; give its "
                           "network address", group, host, settings.lighthouse)
        self.store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False) \
            if world.rank == 0 else None
        port = world.broadcast_object(self.store.port if self.store is not None else None)
        # a run's groups start (or resume) together: until the first commit (diloco: the first step) a step needs
        # every group; not a group its launcher started again (it joins the live groups)
        self._starting = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        try:
            self.manager = self._manager(Manager, ProcessGroupGloo, group, world, host, port, timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise ConfigError(f"key 'fault_tolerance': no lighthouse answered at {settings.lighthouse} within "
                              f"timeout_seconds ({settings.timeout_seconds:g} s): {str(exc).splitlines()[0][:200]}; "
                              f"start `pretrainer lighthouse --bind {settings.lighthouse} --min-replicas "
                              f"{settings.min_replicas}` there first") from None
        self.manager._client = _RecordingClient(self.manager._client)  # noqa: SLF001 - to name who took part

    def _manager(self, Manager, ProcessGroupGloo, group: int, world, host: str, port: int, timeout: timedelta):
        settings = self.settings
        return Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            min_replica_size=settings.replica_groups if self._starting else settings.min_replicas,
            load_state_dict=self._load, state_dict=self._state, replica_id=replica_id(group),
            lighthouse_addr=f"http://{settings.lighthouse}", hostname=host, store_addr=host, store_port=port,
            rank=world.rank, world_size=world.size, use_async_quorum=False, init_sync=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            checkpoint_transport=_transport(host, timeout))

    def bind(self, model, optimizer, train_state, group_samples: int, total_steps: int, stream) -> None:
        """The run's parts a heal reads and writes, and what the rows count; under diloco, the outer optimizer,
        whose step torchft's DiLoCo takes every `sync_every` inner steps (hooked on the optimizer's step)."""
        self.model, self.optimizer, self.train_state = model, optimizer, train_state
        self.group_samples, self.total_steps, self.stream = group_samples, total_steps, stream
        self._stream_state, self._wait_deadline = None, None
        self.count_tokens = lambda: None  # the loop's pending token count into the train state (set by the loop)

    def start(self, count_tokens) -> None:
        """Once the run is resumed (its own checkpoint loaded), before the first step."""
        self.count_tokens = count_tokens
        self._synced_at = self.manager.current_step()
        if self.settings.mode == "diloco":
            from torchft.local_sgd import DiLoCo

            self.outer = torch.optim.SGD(self.model.parameters(), lr=self.settings.outer_lr,
                                         momentum=self.settings.outer_momentum, nesterov=True)
            self._diloco = DiLoCo(self.manager, [self.model], self.optimizer, self.outer,
                                  sync_every=self.settings.sync_every, backup_device=torch.device("cpu"),
                                  pin_memory=False)
            self._diloco.__enter__()
            if self._saved_diloco is not None:
                self._load_diloco(self._saved_diloco)

    def register_state(self, state) -> None:
        """The counts (and torchft's step) in every checkpoint; the whole loop state is what a heal sends."""
        self.run_state = state
        state.register("replica_groups", self._counters, self._load_counters, default={"trained": 0, "dropped": 0})
        if self.settings.mode == "diloco":  # the outer step's state: this rank's part of the last sync's parameters
            state.register(DILOCO_STATE, self._diloco_state, self._stash_diloco, per_rank=True, default=None)

    # ------------------------------------------------------------- the step
    def start_step(self) -> None:
        """Before the step's data is read: the quorum (a restarted group receives the live groups' state here).
        Under diloco the quorum is the sync's, every sync_every steps."""
        if self._diloco is not None:
            if self._starting:
                self._gather_at_start()
            # the inner steps since the last sync, skipped updates included (DiLoCo's hook counts applied ones only),
            # so every group syncs at the same steps; a sync a skip postponed comes at the next step
            self._diloco._local_step = min(self.train_state.step - self._last_sync,  # noqa: SLF001
                                           self.settings.sync_every - 1)
            if self.train_state.step + 1 == self.total_steps:  # the run's last step syncs, wherever it falls
                self._sync_at_the_end()
            return
        self._stream_state = copy.deepcopy(self.stream.state_dict())  # read again if too few groups are there
        self._start_quorum()
        self.participants, self._members = self._quorum(f"step {self.train_state.step + 1}")

    def _sync_at_the_end(self) -> None:
        """The last step syncs; after fewer than sync_every inner steps, the sync averages the groups' parameters
        (outer lr 1, no momentum) rather than stepping the momentum of full intervals from a short one."""
        diloco = self._diloco
        if diloco._local_step < self.settings.sync_every - 1:  # noqa: SLF001
            for group in self.outer.param_groups:
                group.update(lr=1.0, momentum=0.0)
        diloco._local_step = self.settings.sync_every - 1  # noqa: SLF001 - its hook then syncs

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except (RuntimeError, TimeoutError) as exc:
            raise CollectiveFailure(f"replica group {self.group}: no quorum at step {self.train_state.step + 1} "
                                    f"within timeout_seconds; is the lighthouse at {self.settings.lighthouse} still "
                                    f"running? ({str(exc).splitlines()[0][:200]})") from None

    def _gather_at_start(self) -> None:
        """Under diloco, before a run's first step (fresh or resumed from its checkpoints): quorums until every group
        is in one (or timeout_seconds pass), so the first sync averages every group's steps."""
        begun = self.train_state.step
        while self.train_state.step == begun:  # a heal in the quorum ends the gathering
            self._start_quorum()
            self.participants, self._members = self._quorum("the start")
            if self.participants >= self.settings.replica_groups or not self._still_gathering():
                break
            time.sleep(0.2)
        self._wait_deadline = None
        self._go_on_with(self.settings.min_replicas)

    def _quorum(self, when: str) -> tuple[int, list[str]]:
        """The last quorum's size and members; a group in it twice is refused, and a change is one log line."""
        participants = self.manager.num_participants()
        members = self.manager._client.replica_ids  # noqa: SLF001
        twice = sorted({member for member in members if members.count(member) > 1})
        if twice:
            raise ConfigError(f"--replica-group: {', '.join(twice)} is in the quorum twice: two launches were given "
                              "the same --replica-group; give each group its own index")
        if self._members is not None and members != self._members and self.is_main:
            left, joined = sorted(set(self._members) - set(members)), sorted(set(members) - set(self._members))
            logger.warning("replica groups at %s: %d of %d take part%s%s", when, participants,
                           self.settings.replica_groups, f"; {', '.join(left)} left" if left else "",
                           f"; {', '.join(joined)} joined" if joined else "")
        return participants, members

    def average_gradients(self, model: torch.nn.Module, targets: torch.Tensor) -> None:
        """Make this group's gradients (of the mean loss over its `targets` tokens) those of the mean over every
        token of the quorum: each weighted by its tokens, summed in one flat buffer with the token count (a healing
        group's is zero). Under diloco, nothing: each group steps on its own gradients between syncs."""
        if self._diloco is not None:
            return
        grads = [_local(p.grad) for p in model.parameters()]
        tokens = targets.to(torch.float32).reshape(1)
        flat = torch.cat([*(g.reshape(-1) for g in grads if g is not None), torch.ones(1)]) * tokens
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        flat /= flat[-1:].clamp(min=1)
        offset = 0
        for grad in grads:
            if grad is not None:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def should_commit(self) -> bool:
        """Whether every group of the quorum finished the step (a failed one: nobody applies it)."""
        if self._diloco is not None:
            return True
        committed = self.manager.should_commit()
        if not committed and self.participants < self._needed():
            return self._gathering()
        self._wait_deadline = None
        if self._starting:
            self._go_on_with(self.settings.min_replicas)
        read = self.settings.replica_groups * self.group_samples
        trained = self.participants * self.group_samples if committed else 0
        self.samples_trained += trained
        self.samples_dropped += read - trained
        if not committed and self.is_main:
            error = self.manager.errored()
            cause = str(getattr(error, "original_exception", error)).splitlines()[0] if error else "no commit"
            logger.warning("step %d was not committed: a replica group failed during it (%s); its %d samples are "
                           "dropped and the step is trained again on the next ones", self.train_state.step + 1,
                           cause, read)
        return committed

    def _needed(self) -> int:
        return self.settings.replica_groups if self._starting else self.settings.min_replicas

    def _gathering(self) -> bool:
        """Too few groups for a step (every group at a fresh run's start, min_replicas after): nothing is applied and
        the step's data is read again (none dropped)."""
        self.stream.load_state_dict(self._stream_state)
        if self._still_gathering():
            time.sleep(0.2)
        return False

    def _still_gathering(self) -> bool:
        """Whether to wait on for the groups (one warning): for at most timeout_seconds; then the groups there go on
        (at the start, where they are min_replicas), or the run stops naming the key."""
        now = time.monotonic()
        if self._wait_deadline is None:
            self._wait_deadline = now + self.settings.timeout_seconds
            if self.is_main:
                logger.warning("replica groups: %d of the %d needed are in the quorum at step %d; waiting up to "
                               "timeout_seconds (%g s)", self.participants, self._needed(),
                               self.train_state.step + 1, self.settings.timeout_seconds)
        if now < self._wait_deadline:
            return True
        if self._starting and self.participants >= self.settings.min_replicas:
            if self.is_main:
                logger.warning("replica groups: %d of %d joined within timeout_seconds of the start; they go on "
                               "without the others", self.participants, self.settings.replica_groups)
            self._go_on_with(self.settings.min_replicas)
            self._wait_deadline = None
            return False
        raise ConfigError(f"key 'fault_tolerance': {self.participants} replica group(s) in the quorum for "
                          f"timeout_seconds ({self.settings.timeout_seconds:g} s), fewer than min_replicas "
                          f"({self.settings.min_replicas}); start the other groups, or lower "
                          "fault_tolerance.min_replicas (and the lighthouse's --min-replicas)")

    def _go_on_with(self, least: int) -> None:
        self._starting = False
        self.manager._min_replica_size = least  # noqa: SLF001 - torchft reads it at each commit

    def _count_syncs(self, applied: bool) -> None:
        """Under diloco, after a step that tried a sync: the groups that took part, and the samples of the inner steps
        since the last sync trained (a committed sync) or dropped (a failed one rolls every group back to it)."""
        if not applied or self._diloco._local_step != 0 or self.train_state.step == self._last_sync:  # noqa: SLF001
            return  # a skipped update ran no hook: no sync was tried
        synced = self.manager.current_step()
        participants, members = self._quorum(f"sync {synced} (step {self.train_state.step})")
        read = (self.train_state.step - self._last_sync) * self.settings.replica_groups * self.group_samples
        trained = read // self.settings.replica_groups * participants if synced != self._synced_at else 0
        self.samples_trained += trained
        self.samples_dropped += read - trained
        self.participants, self._members = participants, members
        self._synced_at, self._last_sync = synced, self.train_state.step

    # ------------------------------------------------------------- rows
    def end_step(self, result, state) -> None:
        if not result.committed:
            return
        if self._diloco is not None:  # a sync happens inside the optimizer's step
            self._count_syncs(result.applied)
        interval = self.settings.params_digest_interval
        if state.step == self.total_steps or interval and state.step % interval == 0:
            self._digest = params_sha256(self.model, self.world)

    def interval_row(self) -> dict:
        row = {"replica_groups": self.participants, "samples_trained": self.samples_trained,
               "samples_dropped": self.samples_dropped}
        if self._digest is not None:
            row["params_sha256"], self._digest = self._digest, None
        return row

    def describe(self) -> str:
        return f"replica group {self.group} of {self.settings.describe()}"

    # ------------------------------------------------------------- the heal
    def _state(self) -> dict:
        self.count_tokens()  # the meter's tokens of the steps since the last row, as a checkpoint counts them
        rank = self.run_state.saved(per_rank=True)
        rank.pop(DILOCO_STATE, None)  # torchft's DiLoCo sends its own state with a heal
        return {**live_state(self.model, self.optimizer), "run": self.run_state.saved(per_rank=False),
                "rank": rank, "step": self.train_state.step}

    def _load(self, state: dict) -> None:
        load_live_state(self.model, self.optimizer, state)
        self.run_state.restore(state["run"], state["rank"], "the live replica group's state")
        if self.is_main:
            logger.warning("replica group %d healed from a live group: step %d -> %d", self.group,
                           self.train_state.step, state["step"])
        self.train_state.step = int(state["step"])

    def _counters(self) -> dict:
        return {"trained": self.samples_trained, "dropped": self.samples_dropped, "last_sync": self._last_sync,
                "manager": self.manager.state_dict()}

    def _load_counters(self, saved: dict) -> None:
        self.samples_trained, self.samples_dropped = int(saved["trained"]), int(saved["dropped"])
        self._last_sync = int(saved.get("last_sync", 0))
        if "manager" in saved:
            self.manager.load_state_dict(saved["manager"])
        self._synced_at = self.manager.current_step()

    def _diloco_state(self) -> dict | None:
        """What a storage checkpoint keeps of DiLoCo (a heal gets it from torchft): the outer optimizer's momentum and
        this rank's part of the parameters at the last sync, from which the next sync's pseudo-gradient is taken."""
        if self._diloco is None:
            return None
        fragments = self._diloco._fragments  # noqa: SLF001 - one fragment: the whole model
        return {"outer": self.outer.state_dict(),
                "synced": [{name: tensor.clone() for name, tensor in fragment.original_parameters.items()}
                           for fragment in fragments]}

    def _stash_diloco(self, saved: dict | None) -> None:
        self._saved_diloco = saved  # a resume loads before DiLoCo is built (start())

    def _load_diloco(self, saved: dict) -> None:
        fragments = self._diloco._fragments  # noqa: SLF001
        if len(saved["synced"]) != len(fragments):
            raise ConfigError(f"the checkpoint's DiLoCo state has {len(saved['synced'])} fragment(s), this run "
                              f"{len(fragments)}; resume with the same fault_tolerance block")
        for fragment, synced in zip(fragments, saved["synced"]):
            mine = fragment.original_parameters
            if sorted(synced) != sorted(mine) or any(mine[n].shape != t.shape for n, t in synced.items()):
                raise ConfigError("the checkpoint's DiLoCo state (this rank's part of the parameters at the last sync) "
                                  "was saved on another layout; resume a diloco run on the processes and layout it "
                                  "was saved on")
            for name, tensor in synced.items():
                mine[name].copy_(tensor)
        self.outer.load_state_dict(saved["outer"])
        for group in self.outer.param_groups:  # the config's, not those of a run's averaging last sync
            group.update(lr=self.settings.outer_lr, momentum=self.settings.outer_momentum)
        self._saved_diloco = None

    def close(self) -> None:
        if getattr(self, "_diloco", None) is not None:
            self._diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


def params_sha256(model: torch.nn.Module, world) -> str:
    """A digest of the whole model's parameters, comparable across groups whatever their layout: each parameter's
    bytes hashed whole (every rank of a group takes part: a sharded parameter is gathered), the pipeline stages' named
    digests gathered from the group's ranks, and their digest taken in name order."""
    mine = {}
    for name, parameter in model.named_parameters():
        whole = parameter.detach()
        whole = whole.full_tensor() if hasattr(whole, "full_tensor") else whole
        mine[name] = hashlib.sha256(whole.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    named = {}
    for part in world.all_gather_object(mine) if world.size > 1 else [mine]:
        named.update(part)  # ranks holding the same parameter (data, tensor ranks) hold the same bytes
    return hashlib.sha256("".join(f"{name}:{named[name]};" for name in sorted(named)).encode()).hexdigest()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor  # a DTensor's shard


class _RecordingClient:
    """torchft's ManagerClient, remembering the last quorum's replica ids (the log names who left and joined)."""

    def __init__(self, client):
        self._client, self.replica_ids = client, []

    def _quorum(self, *args, **kwargs):
        quorum = self._client._quorum(*args, **kwargs)
        self.replica_ids = [member.split(":")[0] for member in quorum.replica_ids]
        return quorum

    def __getattr__(self, name):
        return getattr(self._client, name)


def _transport(host: str, timeout: timedelta):
    """torchft's HTTP checkpoint transport, telling the healing groups `host` (not the machine's name)."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


def replica_args(args):
    """`args` of this process's replica group: its rows and checkpoints in save_dir/replica-<I> (None: no fault
    tolerance)."""
    from ..config.fault_tolerance import replica_group

    group = replica_group(args.replica_settings)
    if group is None or args.save_dir is None:
        return args, group
    from ..storage import is_url, join_url

    folder = join_url(args.save_dir, f"replica-{group}") if is_url(args.save_dir) else \
        str(Path(args.save_dir) / f"replica-{group}")
    return dataclasses.replace(args, save_dir=folder), group
