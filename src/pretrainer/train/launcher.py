"""`pretrainer train|evaluate ... --nproc-per-node N`: check the run for its world size here, then start the
workers through torch's elastic launcher and end with one line and one exit code.

The parent resolves the config for the launched world (the same checks a worker makes before any allocation),
so most mistakes end before any worker starts. The workers are the same command without the launcher flags,
started by `torch.distributed.launcher.api.launch_agent` (what torchrun runs). Each worker leaves its exit
code and, for an error, its one-line message in a status folder the parent names (`WORKER_STATUS_ENV`); the
parent prints each distinct message once, for the ranks that gave it, and exits with the code the failing
ranks agree on (a rank killed by a signal, or one that crashed, is named with its code).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

WORKER_STATUS_ENV = "PRETRAINER_WORKER_STATUS"  # the folder a launched worker writes rank<N>.json into
EXIT_WORKER_CRASHED = 1
LAUNCHER_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--shutdown-timeout")
DEFAULT_SHUTDOWN_TIMEOUT_S = 300  # a stop request's checkpoint gets this long before the workers are killed


def add_launcher_flags(parser: argparse.ArgumentParser, int_type) -> None:
    group = parser.add_argument_group("launcher (start the workers from this command instead of torchrun)")
    group.add_argument("--nproc-per-node", type=int_type(1), metavar="N",
                       help="worker processes on this machine (one per GPU); the run is checked for the whole world "
                            "before any starts")
    group.add_argument("--nnodes", type=int_type(1), default=1, metavar="M", help="machines in the run (default 1)")
    group.add_argument("--node-rank", type=int_type(0), default=0, metavar="R", help="this machine's index, 0..M-1")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="where the machines meet: node 0's address and a free port (needed when M > 1)")
    group.add_argument("--rdzv-id", metavar="ID", help="the run's id, the same on every machine (default: "
                                                       "SLURM_JOB_ID, else 'pretrainer')")
    group.add_argument("--shutdown-timeout", type=int_type(1), default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                       help="on SIGTERM/SIGINT, seconds the workers get to checkpoint before they are killed "
                            f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S})")


@dataclass(frozen=True)
class LaunchPlan:
    nproc_per_node: int
    nnodes: int
    node_rank: int
    endpoint: str | None
    run_id: str
    shutdown_timeout: int

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @classmethod
    def of(cls, ns) -> LaunchPlan:
        if ns.node_rank >= ns.nnodes:
            raise ConfigError(f"--node-rank {ns.node_rank}: machines are numbered 0..{ns.nnodes - 1} (--nnodes "
                              f"{ns.nnodes})")
        if ns.nnodes > 1 and not ns.rdzv_endpoint:
            raise ConfigError(f"--nnodes {ns.nnodes}: give --rdzv-endpoint HOST:PORT (node 0's address and a free "
                              "port), the same on every machine")
        if ns.rdzv_endpoint and not re.fullmatch(r"[^\s:]+:\d{1,5}", ns.rdzv_endpoint):
            raise ConfigError(f"--rdzv-endpoint {ns.rdzv_endpoint!r}: expected HOST:PORT, e.g. node0:29500")
        run_id = ns.rdzv_id or os.environ.get("SLURM_JOB_ID") or "pretrainer"
        return cls(ns.nproc_per_node, ns.nnodes, ns.node_rank, ns.rdzv_endpoint, run_id, ns.shutdown_timeout)


def worker_argv(argv: list[str]) -> list[str]:
    """The command line without the launcher's flags (`--flag V` and `--flag=V`): what each worker runs."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in LAUNCHER_FLAGS:
            skip = True
        elif not item.startswith(tuple(f"{flag}=" for flag in LAUNCHER_FLAGS)):
            kept.append(item)
    return kept


def check_before_launch(args, world_size: int, local_size: int) -> None:
    """What a worker would refuse before allocating anything, decided here for the planned world: the config's
    keys, the engine and layout for `world_size` processes, the model and tokenizer folders, and the memory
    plan. A run whose model comes from a custom_model_provider_function is checked by its workers."""
    from ..parallel.world import planned_world
    from ..plan.memory_check import check_memory_before_build
    from ..run import resolve_run
    from ..run.device import resolve_device

    if (args.plugin_args or {}).get("custom_model_provider_function"):
        return
    world = planned_world(world_size, local_size, resolve_device(args.device))
    check_memory_before_build(args, resolve_run(args, world), world)


def launch(plan: LaunchPlan, argv: list[str]) -> int:
    """Run `pretrainer ARGV` as `plan.world_size` workers (this machine's share of them) and return the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the outcome is told below
    single = plan.nnodes == 1 and plan.endpoint is None
    config = LaunchConfig(
        min_nodes=plan.nnodes, max_nodes=plan.nnodes, nproc_per_node=plan.nproc_per_node, run_id=plan.run_id,
        # One machine: the store binds a free port itself (torchrun --standalone). Several: node 0 hosts it at
        # the endpoint and each machine says its index (torchrun's static rendezvous).
        rdzv_backend="c10d" if single else "static", rdzv_endpoint="localhost:0" if single else plan.endpoint,
        rdzv_configs={} if single else {"rank": plan.node_rank}, max_restarts=0,
        shutdown_timeout=plan.shutdown_timeout)
    with tempfile.TemporaryDirectory(prefix="pretrainer-workers-") as status:
        os.environ[WORKER_STATUS_ENV] = status
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc_per_node)))
        failures, signalled = {}, None
        try:
            launch_agent(config, sys.executable, ["-m", "pretrainer.cli", *argv])
        except ChildFailedError as exc:
            failures = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        except SignalException as exc:
            signalled = exc.sigval
        finally:
            os.environ.pop(WORKER_STATUS_ENV, None)
        statuses = read_statuses(Path(status))
    if signalled is not None and len(statuses) < plan.nproc_per_node:
        print(f"pretrainer: error: stopped by {signalled.name}; {plan.nproc_per_node - len(statuses)} worker(s) "
              f"did not finish within --shutdown-timeout {plan.shutdown_timeout} s", file=sys.stderr)
        return 128 + int(signalled)
    return outcome(statuses, failures)


def read_statuses(folder: Path) -> dict[int, dict]:
    return {int(path.stem[len("rank"):]): json.loads(path.read_text()) for path in folder.glob("rank*.json")}


def outcome(statuses: dict[int, dict], failures: dict[int, int]) -> int:
    """Print what went wrong once, and return the launch's exit code. `statuses`: what the workers that ended
    on their own said (code, error line, and whether the error follows from another rank's failure);
    `failures`: the exit codes torch saw for the ranks that failed."""
    errors: dict[str, list[int]] = {}
    # Root causes first: a collective that failed because another rank died is a consequence.
    for rank, status in sorted(statuses.items(), key=lambda item: (item[1].get("consequence", False), item[0])):
        if status.get("message"):
            errors.setdefault(status["message"], []).append(rank)
    for message, ranks in errors.items():
        who = "" if len(errors) == 1 else f"rank {', '.join(map(str, ranks))}: "
        print(f"pretrainer: error: {who}{message}", file=sys.stderr)
    crashed = {rank: code for rank, code in failures.items() if rank not in statuses}
    if crashed and not any(not statuses[ranks[0]].get("consequence") for ranks in errors.values()):
        rank, code = min(crashed.items())
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        print(f"pretrainer: error: rank {rank} {how} (its output is above); the other ranks were stopped",
              file=sys.stderr)
        return 128 - code if code < 0 else code or EXIT_WORKER_CRASHED
    if errors:
        return statuses[next(iter(errors.values()))[0]]["code"]
    return max((status["code"] for status in statuses.values()), default=0)


def record_worker_status(code: int, message: str | None = None, consequence: bool = False) -> bool:
    """In a worker this launcher started: leave its exit code (and error line) for the parent; True if it did
    (then the parent prints the line). `consequence`: the error follows from another rank's failure."""
    folder = os.environ.get(WORKER_STATUS_ENV)
    if not folder:
        return False
    path = Path(folder, f"rank{os.environ.get('RANK', '0')}.json")
    if not path.exists():  # the first word stands: an error's line, then the exit code the process ends with
        path.write_text(json.dumps({"code": code, "message": message, "consequence": consequence}))
    return True
