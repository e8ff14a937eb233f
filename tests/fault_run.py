"""Train with an injected fault on one rank and record, per rank, the samples each step trains on.

    torchrun ... tests/fault_run.py CONFIG [key=value ...] --record DIR [--fault kill|hang --rank R --step S]

A forward pre-hook (training forwards only) writes `{"step", "sample"}` rows (a hash of the input ids) to
DIR/rank<R>.jsonl, after a `{"start": true}` row per launch. At the fault's step the chosen rank SIGKILLs
itself in the step's first forward, or hangs while fetching the step's data.
"""

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

from pretrainer import PreTrainer, PreTrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("config")
parser.add_argument("overrides", nargs="*")
parser.add_argument("--record", required=True, type=Path)
parser.add_argument("--fault", choices=["kill", "hang"])
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--step", type=int, default=3)
ns = parser.parse_args()

trainer = PreTrainer(PreTrainingArguments.from_yaml(ns.config, ns.overrides))
rank = trainer.engine.rank
ns.record.mkdir(parents=True, exist_ok=True)
record = open(ns.record / f"rank{rank}.jsonl", "a")
record.write(json.dumps({"start": True}) + "\n")
record.flush()
model = trainer.engine.unwrap(trainer.model)


def fault_now() -> bool:
    # Only in a job's first launch: a worker group torchrun restarts (--max-restarts) runs clean.
    first_launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    return bool(ns.fault) and first_launch and rank == ns.rank and trainer.completed_steps + 1 == ns.step


def hook(module, args, kwargs):
    """SIGKILL mid-step: in the forward of the step's first micro-batch."""
    if not module.training:
        return
    if ns.fault == "kill" and fault_now():
        os.kill(os.getpid(), signal.SIGKILL)
    step = trainer.completed_steps + 1
    ids = kwargs["input_ids"].cpu().numpy().tobytes()
    record.write(json.dumps({"step": step, "sample": hashlib.sha1(ids).hexdigest()}) + "\n")
    record.flush()


model.register_forward_pre_hook(hook, with_kwargs=True)
batches = trainer.train_stream


class HangingStream:
    """A hang while fetching the step's data: the rank never reaches the step's collectives."""

    def __getattr__(self, name):
        return getattr(batches, name)

    def __next__(self):
        if ns.fault == "hang" and fault_now():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # hung, but torchrun's SIGTERM ends it at once
            time.sleep(3600)
        return next(batches)


trainer.train_stream = HangingStream()
trainer.train()
