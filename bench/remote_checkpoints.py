"""Checkpoints to object storage against checkpoints to local disk, on the quickstart model.

Starts a local S3-compatible server (moto's server mode, on 127.0.0.1) and trains `examples/quickstart.yaml`
for --steps steps with a checkpoint every --every steps (model and AdamW state: about 60 MB each), five ways:
no checkpoints; to a local save_dir, synchronously and with async_checkpoint; to `s3://bench/run`,
uploaded at once and in the background (async_checkpoint). Each variant runs in a process of its own; the time
is `PreTrainer.train()` (the loop, every save, and the wait for the last upload; not the start-up), best of
--repeats. Prints seconds per step with checkpoints and each variant's ratio to the local synchronous one.

    .venv/bin/python bench/remote_checkpoints.py [--steps 120] [--every 10] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BIN, REPO

VARIANTS = {
    "no checkpoints": {"save_interval": 0},
    "local disk": {},
    "local disk, async_checkpoint": {"async_checkpoint": True},
    "s3, upload at once": {"save_dir": "s3://bench"},
    "s3, background upload": {"save_dir": "s3://bench", "async_checkpoint": True},
}
QUIET = {"downstream_evals": None, "export_hf": False, "write_report": False, "eval_interval": 0,
         "log_interval": 1000}


def one(variant: str, steps: int, every: int, work: Path) -> float:
    """Train one variant in this process; the seconds `train()` took."""
    from pretrainer import PreTrainer, PreTrainingArguments

    args = PreTrainingArguments.from_yaml(REPO / "examples" / "quickstart.yaml")
    settings = {**QUIET, "num_training_steps": steps, "save_interval": every, "save_dir": str(work / "run"),
                "resume": "none", **VARIANTS[variant]}
    if settings["save_dir"].startswith("s3://"):  # each run its own folder in the bucket
        settings["save_dir"] += f"/{work.name}"
        settings["staging_dir"] = str(work / "staging")
    args = PreTrainingArguments.from_dict({**args.to_dict(), **settings})
    with PreTrainer(args) as trainer:
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start


def start_server(env: dict) -> subprocess.Popen:
    import s3fs

    server = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", env["PORT"]],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(env)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    for _ in range(100):
        try:
            fs.mkdir("bench")
            return server
        except Exception:
            time.sleep(0.1)
    server.kill()
    sys.exit("moto_server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.one:
        print(json.dumps(one(ns.one, ns.steps, ns.every, Path(ns.work))))
        return
    port = "29731"
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1", "PORT": port}
    server = start_server(env)
    seconds = {}
    try:
        for _ in range(ns.repeats):  # interleaved, so that drift on a shared machine hits every variant alike
            for variant in VARIANTS:
                work = Path(tempfile.mkdtemp(prefix="remote-ckpt-bench-"))
                done = subprocess.run([sys.executable, __file__, "--one", variant, "--steps", str(ns.steps),
                                       "--every", str(ns.every), "--work", str(work)], capture_output=True,
                                      text=True, cwd=REPO, env={**os.environ, **env})
                shutil.rmtree(work, ignore_errors=True)
                if done.returncode:
                    sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
                value = json.loads(done.stdout.strip().splitlines()[-1])
                seconds[variant] = min(seconds.get(variant, value), value)
    finally:
        server.terminate()
    saves = ns.steps // ns.every
    base = seconds["local disk"]
    print(f"quickstart model, {ns.steps} steps, a checkpoint every {ns.every} ({saves} saves), best of "
          f"{ns.repeats}, {os.cpu_count()} cores")
    print(f"{'variant':32} {'s/step':>8} {'vs local disk':>14}")
    for variant, value in seconds.items():
        print(f"{variant:32} {value / ns.steps:8.3f} {value / base:13.2f}x")


if __name__ == "__main__":
    main()
