"""Shared by the benchmarks: run a command and watch its whole process tree's memory; run `pretrainer` and
read a run's metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def pretrainer(*args) -> str:
    """`pretrainer ARGS` from the repository root; its stdout. Exits with the stderr tail on failure."""
    done = subprocess.run([str(BIN / "pretrainer"), *map(str, args)], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        sys.exit(f"pretrainer {' '.join(map(str, args[:3]))} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def metrics(save_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(save_dir) / "metrics.jsonl").read_text().splitlines()]


def measure(command: list, env: dict | None = None, cwd: Path = REPO) -> tuple[float, float, str]:
    """Wall seconds, peak RSS of the whole process tree (MB), stdout. Exits with the stderr tail on failure."""
    start = time.perf_counter()
    process = subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=cwd, env=env)
    peak = [0.0]

    def watch():
        root = psutil.Process(process.pid)
        while process.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree if p.is_running()) / 2**20)
            except psutil.Error:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = process.communicate()
    watcher.join()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command[:4]))} failed:\n{err[-3000:]}")
    return time.perf_counter() - start, peak[0], out
