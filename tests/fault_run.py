"""Train with an injected fault on one rank and record, per rank, the samples each step trains on.

    torchrun ... tests/fault_run.py CONFIG [key=value ...] --record DIR [--fault kill|hang --rank R --step S]

A forward pre-hook (training forwards only) writes `{"step", "sample"}` rows (a hash of the input ids) to
DIR/rank<R>.jsonl, after a `{"start": true}` row per launch; at the fault's step the chosen rank SIGKILLs
itself or hangs instead.
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


def hook(module, args, kwargs):
    if not module.training:
        return
    step = trainer.completed_steps + 1
    if ns.fault and rank == ns.rank and step == ns.step:
        if ns.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # hung, but torchrun's SIGTERM ends it without a grace wait
        time.sleep(3600)
    ids = kwargs["input_ids"].cpu().numpy().tobytes()
    record.write(json.dumps({"step": step, "sample": hashlib.sha1(ids).hexdigest()}) + "\n")
    record.flush()


model.register_forward_pre_hook(hook, with_kwargs=True)
trainer.train()
