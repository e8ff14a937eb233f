"""Launching the real commands from tests: `pretrainer`, `torchrun`, `accelerate`, `deepspeed` and scripts.

One place for how a test starts a process: from the repository root, with OMP_NUM_THREADS set (1 by default:
two ranks on two cores), a timeout, and output captured. `run_ok` fails with the command and the tail of
its output, so a failing launch says what it ran and how it ended.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the environment's console scripts: pretrainer, torchrun, accelerate, ...


def environment(threads: int | None = 1, **extra: str) -> dict:
    """This process's environment with OMP_NUM_THREADS set (`None`: torch's default) and `extra` added."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


def cores_per_worker() -> int:
    """The cores one pytest worker may keep busy: all of them in a plain pytest run, a share under pytest-xdist.
    A process of more threads than that waits on its own threads whenever the other worker runs (OpenMP's
    threads spin at each barrier for a thread that has no core), which made a 2-thread run 5x slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


def listening_port() -> int:
    """A free port for a rendezvous that several processes are told of: below the kernel's ephemeral range, so no
    process of the other pytest worker gets it for an outgoing connection or a bind to port 0 between this check
    and the launcher's bind; and away from the launchers' default 29500."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = [p for p in range(20000, min(ephemeral_low, 32768)) if abs(p - 29500) > 100]
    for port in random.Random(os.getpid()).sample(candidates, min(50, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-{min(ephemeral_low, 32768) - 1} (below the ephemeral range "
                       "/proc/sys/net/ipv4/ip_local_port_range starts)")


def pretrainer(*args) -> list:
    return [BIN / "pretrainer", *args]


def torchrun(nproc: int, *args, restarts: int | None = None) -> list:
    """`torchrun --standalone --nproc_per_node N ARGS` (with `--max-restarts` when given)."""
    extra = ["--max-restarts", restarts] if restarts is not None else []
    return [BIN / "torchrun", "--standalone", "--nproc_per_node", nproc, *extra, *args]


def run(command: list, *, timeout: float = 300, threads: int | None = 1, env: dict | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run to completion with output captured (text)."""
    return subprocess.run([str(c) for c in command], cwd=cwd, env=env or environment(threads), capture_output=True,
                          text=True, timeout=timeout)


def run_ok(command: list, **options) -> subprocess.CompletedProcess:
    """`run`, asserting exit code 0 (the message holds the command and the tail of its output)."""
    done = run(command, **options)
    assert done.returncode == 0, describe(done)
    return done


FATAL_MARKS = ("terminate called", "Fatal Python error", "SIGABRT(6), PID", "SIGSEGV(11), PID", "exitcode  : -")


def describe(done: subprocess.CompletedProcess, chars: int = 6000) -> str:
    """The command, its exit code, the tails of stdout and stderr, then the lines around any native fault: last,
    so that they end a log that is read from its tail (another rank's long traceback would push them out of
    stderr's tail)."""
    command = " ".join(str(c) for c in done.args)
    lines = (done.stderr or "").splitlines()
    firsts = sorted({next(i for i, line in enumerate(lines) if mark in line) for mark in FATAL_MARKS
                     if any(mark in line for line in lines)})  # the first of each kind (every thread prints one)
    faults = "\n".join("\n".join(lines[max(i - 3, 0):i + 40]) for i in firsts)
    return (f"`{command}` exited with {done.returncode}"
            f"\n--- stdout (tail) ---\n{(done.stdout or '')[-chars // 2:]}"
            f"\n--- stderr (tail) ---\n{(done.stderr or '')[-chars:]}"
            f"\n--- native faults ---\n{faults or 'none'}")


def start(command: list, log: Path, *, threads: int | None = 1, env: dict | None = None) -> subprocess.Popen:
    """Start in the background in its own session (so a test can signal the whole group), output to `log`."""
    return subprocess.Popen([str(c) for c in command], cwd=REPO, env=env or environment(threads),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def cli_in_process(capsys, *args) -> tuple[int, str]:
    """`pretrainer ARGS` run by its `main` in this process (no interpreter start-up): the exit code and what it
    wrote to stderr. For usage errors; the console entry itself is tested through processes (test_cli.py)."""
    from pretrainer.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capsys.readouterr().err
