"""A fault-tolerant run of replica groups on this machine: the lighthouse, then each group as `pretrainer train CONFIG
--nproc-per-node N --replica-group I --max-restarts 1`; optionally SIGKILL one group's worker once its rows reach a
step (its launcher starts it again, and it rejoins). Run inside a network namespace of its own (`unshare --net`,
this script brings `lo` up), so every address is 127.0.0.1.

    python tests/replica_run.py CONFIG --groups R --port P --out DIR --save-dir SAVE_DIR [--nproc N]
        [--kill-group G --kill-step K] [--heartbeat-timeout-ms MS] [--group-ids I,J,...] [--no-lighthouse]
        [key=value ...]

Writes DIR/summary.json: {"killed_at": the step of the kill row seen, "kill_time": when, "returncodes": [...]}; each
group's output in DIR/group<I>.log and the lighthouse's in DIR/lighthouse.log.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent


def rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_of(launcher: subprocess.Popen) -> psutil.Process | None:
    """The launcher's training worker (the python process that runs pretrainer.cli)."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "pretrainer.cli" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--kill-group", type=int)
    parser.add_argument("--kill-step", type=int)
    parser.add_argument("--save-dir", type=Path, required=True)
    parser.add_argument("--heartbeat-timeout-ms", default="3000")  # a loaded machine may delay a heartbeat 1 s
    parser.add_argument("--group-ids", help="the --replica-group of each launch, comma-separated (default 0..R-1)")
    parser.add_argument("--no-lighthouse", action="store_true")
    ns = parser.parse_intermixed_args()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [str(BIN / "pretrainer"), "lighthouse", "--bind", f"127.0.0.1:{ns.port}", "--min-replicas", "1",
               "--join-timeout-ms", "10000", "--heartbeat-timeout-ms", ns.heartbeat_timeout_ms]
    lighthouse = None if ns.no_lighthouse else subprocess.Popen(
        command, stdout=open(ns.out / "lighthouse.log", "w"), stderr=subprocess.STDOUT, env=env)
    time.sleep(1.0)
    ids = [int(i) for i in ns.group_ids.split(",")] if ns.group_ids else list(range(ns.groups))
    groups = [subprocess.Popen([str(BIN / "pretrainer"), "train", ns.config, *ns.overrides, "--nproc-per-node",
                                str(ns.nproc), "--replica-group", str(group), "--max-restarts", "1"],
                               stdout=open(ns.out / f"group{index}.log", "w"), stderr=subprocess.STDOUT, env=env)
              for index, group in enumerate(ids)]
    summary: dict = {"killed_at": None}
    deadline = time.monotonic() + 500
    if ns.kill_group is not None:
        metrics = ns.save_dir / f"replica-{ns.kill_group}" / "metrics.jsonl"
        while time.monotonic() < deadline and groups[ns.kill_group].poll() is None:
            steps = [row["step"] for row in rows(metrics) if "loss" in row]
            if steps and steps[-1] >= ns.kill_step:
                worker = worker_of(groups[ns.kill_group])
                if worker is not None:
                    worker.send_signal(signal.SIGKILL)
                    summary.update(killed_at=steps[-1], kill_time=time.time())
                    break
            time.sleep(0.02)
    summary["returncodes"] = [group.wait(timeout=max(1, deadline - time.monotonic())) for group in groups]
    if lighthouse is not None:
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=30)
    (ns.out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
