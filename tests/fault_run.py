"""Train with an injected fault on one rank and record, per rank, the samples each step trains on.

    torchrun ... tests/fault_run.py CONFIG [key=value ...] --record DIR [--fault kill|hang --rank R --step S
                                                                       --at step|save|teardown]

A forward pre-hook (training forwards only) writes `{"step", "sample"}` rows (a hash of the input ids) to
DIR/rank<R>.jsonl, after a `{"start": true}` row per launch. At the fault's step the chosen rank SIGKILLs
itself in the step's first forward (`--at step`: its peer waits in the step's collectives), or hangs while
fetching the step's data; `--at save` kills it as soon as the step's checkpoint has started (an asynchronous
write under way), `--at teardown` once training has returned (its peer tearing down). A run that fails exits
with the code `pretrainer train` documents for the error.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.cli import exit_code

parser = argparse.ArgumentParser()
parser.add_argument("config")
parser.add_argument("overrides", nargs="*")
parser.add_argument("--record", required=True, type=Path)
parser.add_argument("--fault", choices=["kill", "hang"])
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--step", type=int, default=3)
parser.add_argument("--at", choices=["step", "save", "teardown"], default="step")
ns = parser.parse_intermixed_args()  # overrides may follow the options

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
    return bool(ns.fault) and first_launch and rank == ns.rank and trainer.train_state.step + 1 == ns.step


def kill_now(at: str) -> None:
    if ns.fault == "kill" and ns.at == at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" \
            and rank == ns.rank:
        os.kill(os.getpid(), signal.SIGKILL)


def hook(module, args, kwargs):
    """SIGKILL mid-step: in the forward of the step's first micro-batch."""
    if not module.training:
        return
    if ns.at == "step" and fault_now():
        kill_now("step")
    step = trainer.train_state.step + 1
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
if trainer.checkpointer is not None:
    save = trainer.checkpointer.save

    def save_then_fault(step, **kwargs):
        saved = save(step, **kwargs)
        if step == ns.step:
            kill_now("save")  # the write goes on in the background (async_checkpoint)
        return saved

    trainer.checkpointer.save = save_then_fault
try:
    trainer.train()
except Exception as exc:
    code = exit_code(exc)
    if code is None:
        raise
    print(f"fault_run: rank {rank} exits with {code}: {exc}", file=sys.stderr, flush=True)
    sys.exit(code)
kill_now("teardown")
