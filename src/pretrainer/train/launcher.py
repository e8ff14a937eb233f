"""`pretrainer train|evaluate ... --nproc-per-node N`: check the run for its world size here, then start the workers
through torch's elastic launcher and end with one line and one exit code.

The parent resolves the config for the launched world (a worker's checks before any allocation), so most mistakes end
before any worker starts. The workers, started by `torch.distributed.launcher.api.launch_agent` (what torchrun runs),
run the same command without the launcher flags. Each leaves its exit code (and an error's one-line message) in a status
folder the parent names (`WORKER_STATUS_ENV`); the parent prints each distinct message once, for the ranks that gave it,
and exits with the code the failing ranks agree on (a crashed or signalled rank is named with its code).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..config.loading import int_at_least
from .errors import CollectiveFailure

WORKER_STATUS_ENV = "PRETRAINER_WORKER_STATUS"  # the folder a launched worker writes rank<N>.json into
EXIT_WORKER_CRASHED = 1
DEFAULT_SHUTDOWN_TIMEOUT_S = 300  # a stop request's checkpoint gets this long before the workers are killed
DEFAULT_RDZV_TIMEOUT_S = 600  # torch's own for a rendezvous (the static one's store, the c10d one's join)
# The flags that only mean something with --nproc-per-node, with their defaults (the parser's are None, so a
# flag given without the launcher is told from one left out).
LAUNCHER_DEFAULTS = {"nnodes": 1, "node_rank": 0, "rdzv_endpoint": None, "rdzv_id": None,
                     "rdzv_timeout": DEFAULT_RDZV_TIMEOUT_S, "shutdown_timeout": DEFAULT_SHUTDOWN_TIMEOUT_S,
                     "max_restarts": 0}
LAUNCHER_FLAGS = ("--nproc-per-node", *(f"--{name.replace('_', '-')}" for name in LAUNCHER_DEFAULTS))


def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launcher (start the workers from this command instead of torchrun)")
    group.add_argument("--nproc-per-node", type=int_at_least(1), metavar="N",
                       help="worker processes on this machine (one per GPU); the run is checked for the whole world "
                            "before any starts")
    group.add_argument("--nnodes", type=int_at_least(1), metavar="M", help="machines in the run (default 1)")
    group.add_argument("--node-rank", type=int_at_least(0), metavar="R", help="this machine's index, 0..M-1")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="where the machines meet: node 0's address and a free port (needed when M > 1)")
    group.add_argument("--rdzv-id", metavar="ID", help="the run's id, the same on every machine (default: "
                                                       "SLURM_JOB_ID, else 'pretrainer')")
    group.add_argument("--rdzv-timeout", type=int_at_least(1), metavar="S",
                       help="seconds the machines wait for each other at the rendezvous (default "
                            f"{DEFAULT_RDZV_TIMEOUT_S})")
    group.add_argument("--max-restarts", type=int_at_least(0), metavar="K",
                       help="start this machine's workers again, up to K times, when one fails (default 0; a "
                            "fault-tolerant run's replica group rejoins the others)")
    group.add_argument("--shutdown-timeout", type=int_at_least(1), metavar="S",
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
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT_S
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def launch_plan(ns) -> LaunchPlan | None:
    """The launch the command line asks for, or None: run as this one process. Launcher flags without --nproc-per-node
    are refused (they would do nothing), as is a launch from a launcher's worker (each would start its own)."""
    if not getattr(ns, "nproc_per_node", None):
        given = [name for name in LAUNCHER_DEFAULTS if getattr(ns, name, None) is not None]
        if given:
            flag = f"--{given[0].replace('_', '-')}"
            raise ConfigError(f"{flag} {getattr(ns, given[0])}: only used with --nproc-per-node N, which starts the "
                              f"workers; add it, or drop {flag} (under torchrun, give torchrun its own flags)")
        return None
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # set by torch's agent (torchrun, or this launcher) for its workers
        raise ConfigError(f"--nproc-per-node {ns.nproc_per_node}: this process is already a worker that a launcher "
                          "started (TORCHELASTIC_RUN_ID is set); drop --nproc-per-node, or run the command outside "
                          "torchrun")
    flags = {name: LAUNCHER_DEFAULTS[name] if getattr(ns, name) is None else getattr(ns, name)
             for name in LAUNCHER_DEFAULTS}
    nnodes, node_rank, endpoint = flags["nnodes"], flags["node_rank"], flags["rdzv_endpoint"]
    if node_rank >= nnodes:
        raise ConfigError(f"--node-rank {node_rank}: machines are numbered 0..{nnodes - 1} (--nnodes {nnodes})")
    if nnodes > 1 and not endpoint:
        raise ConfigError(f"--nnodes {nnodes}: give --rdzv-endpoint HOST:PORT (node 0's address and a free "
                          "port), the same on every machine")
    if endpoint and not re.fullmatch(r"[^\s:]+:\d{1,5}", endpoint):
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, e.g. node0:29500")
    run_id = flags["rdzv_id"] or os.environ.get("SLURM_JOB_ID") or "pretrainer"
    return LaunchPlan(ns.nproc_per_node, nnodes, node_rank, endpoint, run_id, flags["shutdown_timeout"],
                      flags["rdzv_timeout"], flags["max_restarts"])


def worker_argv(argv: list[str]) -> list[str]:
    """The command line without the launcher's flags, in each spelling the parser takes (`--flag V`, `--flag=V`;
    it takes no abbreviation): what each worker runs."""
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
    """What a worker would refuse before allocating anything, decided here for the planned world (docs/commands.md,
    'Launching')."""
    from ..parallel.world import planned_world
    from ..plan.memory_check import check_memory_before_build
    from ..run import resolve_run
    from ..run.device import resolve_device

    if (args.plugin_args or {}).get("custom_model_provider_function"):
        return
    world = planned_world(world_size, local_size, resolve_device(args.device))
    check_memory_before_build(args, resolve_run(args, world, warn=False), world)


def launch(plan: LaunchPlan, argv: list[str], python_args: tuple[str, ...] = ("-m", "pretrainer.cli")) -> int:
    """Run `python PYTHON_ARGS ARGV` as this machine's share of `plan.world_size` workers; returns the exit code."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the outcome is told below
    deadline = time.monotonic() + plan.rdzv_timeout
    announce_rendezvous(plan)
    wait_for_node_zero(plan, deadline)
    single = plan.nnodes == 1 and plan.endpoint is None
    config = LaunchConfig(
        min_nodes=plan.nnodes, max_nodes=plan.nnodes, nproc_per_node=plan.nproc_per_node, run_id=plan.run_id,
        # One machine: the store binds a free port itself (torchrun --standalone). Several: node 0 hosts it at the
        # endpoint and each machine says its index (torchrun's static rendezvous; its store waits `timeout` s for them).
        rdzv_backend="c10d" if single else "static", rdzv_endpoint="localhost:0" if single else plan.endpoint,
        rdzv_configs={"join_timeout": plan.rdzv_timeout} if single else
        {"rank": plan.node_rank, "timeout": max(1, round(deadline - time.monotonic()))},
        max_restarts=plan.max_restarts, shutdown_timeout=plan.shutdown_timeout)
    with tempfile.TemporaryDirectory(prefix="pretrainer-workers-") as status:
        os.environ[WORKER_STATUS_ENV] = status
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc_per_node)))
        failures, failed_at, signalled = {}, {}, None
        try:
            launch_agent(config, sys.executable, [*python_args, *argv])
        except ChildFailedError as exc:
            failures = {rank: failure.exitcode for rank, failure in exc.failures.items()}
            failed_at = {rank: failure.timestamp for rank, failure in exc.failures.items()}
        except SignalException as exc:
            signalled = exc.sigval
        except DistError as exc:  # the machines did not meet within the timeout
            raise rendezvous_timeout(plan, str(exc)) from None
        finally:
            os.environ.pop(WORKER_STATUS_ENV, None)
        statuses = last_attempt(Path(status))
    if signalled is not None and len(statuses) < plan.nproc_per_node:
        print(f"pretrainer: error: stopped by {signalled.name}; {plan.nproc_per_node - len(statuses)} worker(s) "
              f"did not finish within --shutdown-timeout {plan.shutdown_timeout} s", file=sys.stderr)
        return 128 + int(signalled)
    return outcome(statuses, failures, failed_at)


def last_attempt(folder: Path) -> dict[int, dict]:
    """The statuses the workers of the launch's last attempt left, by rank."""
    found = [(int(attempt), int(rank), path) for path in folder.glob("rank*.attempt*.json")
             for rank, attempt in [path.name[len("rank"):-len(".json")].split(".attempt")]]
    last = max((attempt for attempt, _, _ in found), default=0)
    return {rank: json.loads(path.read_text()) for attempt, rank, path in found if attempt == last}


def announce_rendezvous(plan: LaunchPlan) -> None:
    """Several machines: say at once what this one waits for and how long (the store waits in silence)."""
    if plan.nnodes == 1:
        return
    joiners = "node 1" if plan.nnodes == 2 else f"nodes 1..{plan.nnodes - 1}"
    others = "" if plan.nnodes == 2 else f" and the other {plan.nnodes - 2} machine(s)"
    waits_for = (f"{joiners} to join the rendezvous this machine hosts at {plan.endpoint}" if plan.node_rank == 0
                 else f"node 0 at {plan.endpoint}{others}")
    print(f"pretrainer: node {plan.node_rank} of {plan.nnodes}: waiting up to {plan.rdzv_timeout} s (--rdzv-timeout) "
          f"for {waits_for}", file=sys.stderr, flush=True)


def wait_for_node_zero(plan: LaunchPlan, deadline: float) -> None:
    """On a machine other than node 0: wait until node 0's store takes connections. torch's store client would
    wait too, but it ends with C++ log lines and a stack of native frames rather than one line."""
    if plan.node_rank == 0 or plan.endpoint is None:
        return
    host, port = plan.endpoint.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise rendezvous_timeout(plan, f"node 0 did not answer at {plan.endpoint} ({exc})") from None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def rendezvous_timeout(plan: LaunchPlan, cause: str) -> CollectiveFailure:
    """The one line a rendezvous that timed out ends with (exit 5, as for a rank that never answers)."""
    why = (cause.splitlines() or ["timed out"])[0].rstrip(".")
    return CollectiveFailure(
        f"node {plan.node_rank} of {plan.nnodes}: the machines did not all meet at {plan.endpoint} within "
        f"--rdzv-timeout {plan.rdzv_timeout} s ({why}). Start the same command on every machine (each with its "
        "--node-rank, the same --nnodes, --rdzv-endpoint and --rdzv-id), or give them longer with --rdzv-timeout")


def outcome(statuses: dict[int, dict], failures: dict[int, int], failed_at: dict[int, float] | None = None) -> int:
    """Print what went wrong and return the launch's exit code (docs/commands.md, 'Launching'). `statuses`: what
    workers that ended on their own said; `failures`: failed ranks' exit codes; `failed_at`: when torch saw each."""
    errors = {rank: status for rank, status in statuses.items() if status.get("message")}
    causes = [rank for rank in sorted(errors) if not errors[rank].get("consequence")]
    consequences = [rank for rank in sorted(errors) if errors[rank].get("consequence")]
    crashed, stopped = crashes(statuses, failures, failed_at or {})
    print_error_lines(errors, causes)
    by_code: dict[int, list[int]] = {}  # the crashed ranks by exit code, in the order of the first to end so
    for rank in crashed:
        by_code.setdefault(failures[rank], []).append(rank)
    for code, ranks in by_code.items():
        one = len(ranks) == 1
        who = f"rank {ranks[0]}" if one else f"ranks {', '.join(map(str, ranks))}"
        how = f"{'was' if one else 'were'} killed by signal {-code}" if code < 0 else f"exited with code {code}"
        print(f"pretrainer: error: {who} {how} ({'its' if one else 'their'} output is above)"
              + ("; the other ranks were stopped" if stopped else ""), file=sys.stderr)
    print_error_lines(errors, consequences)
    if causes:
        return errors[causes[0]]["code"]
    if crashed:
        code = failures[crashed[0]]
        return 128 - code if code < 0 else code or EXIT_WORKER_CRASHED
    if consequences:
        return errors[consequences[0]]["code"]
    return max((status["code"] for status in statuses.values()), default=0)


def crashes(statuses: dict[int, dict], failures: dict[int, int], failed_at: dict[int, float]) \
        -> tuple[list[int], bool]:
    """The ranks that ended without a word, first to fail first, and whether any others were stopped: a rank that
    died of torch's SIGTERM, beside one that failed otherwise (or said why), is a consequence, not a cause."""
    silent = sorted((rank for rank in failures if rank not in statuses),
                    key=lambda rank: (failed_at.get(rank, 0), rank))
    by_agent = [rank for rank in silent if failures[rank] == -signal.SIGTERM]
    failed_otherwise = len(by_agent) < len(silent) or any(
        status.get("message") and not status.get("consequence") for status in statuses.values())
    if not failed_otherwise:  # every rank that failed died of SIGTERM: someone else's, and they are the causes
        return silent, False
    return [rank for rank in silent if rank not in by_agent], bool(by_agent)


def print_error_lines(errors: dict[int, dict], ranks: list[int]) -> None:
    """Each distinct line once; with the ranks that gave it when the ranks' lines differ."""
    lines: dict[str, list[int]] = {}
    for rank in ranks:
        lines.setdefault(errors[rank]["message"], []).append(rank)
    several = len({status["message"] for status in errors.values()}) > 1
    for message, same in lines.items():
        who = f"rank {', '.join(map(str, same))}: " if several else ""
        print(f"pretrainer: error: {who}{message}", file=sys.stderr)


def record_worker_status(code: int, message: str | None = None, consequence: bool = False) -> bool:
    """In a worker this launcher started: leave its exit code (and error line) for the parent; True if it did
    (then the parent prints the line). `consequence`: the error follows from another rank's failure."""
    folder = os.environ.get(WORKER_STATUS_ENV)
    if not folder:
        return False
    # each attempt of a launch with --max-restarts its own file: only the last attempt's say how the launch ended
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    path = Path(folder, f"rank{os.environ.get('RANK', '0')}.attempt{attempt}.json")
    if not path.exists():  # the first word stands: an error's line, then the exit code the process ends with
        path.write_text(json.dumps({"code": code, "message": message, "consequence": consequence}))
    return True
