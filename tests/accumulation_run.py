"""What a micro-batch that is not its step's last leaves behind on 2 ranks, per engine (tests/test_engines.py):

    torchrun --nproc_per_node 2 tests/accumulation_run.py CONFIG.json OUT.json

For each case, one forward and backward under the engine's `no_sync`, then one outside it: which parameters hold a
gradient after each (a reduced gradient lands in `param.grad`; one held back for the step's last micro-batch does
not). Then a model each rank built from its own seed, passed in: the sum of its weights on rank 0 before, and on
each rank once the engine has wrapped it (whole tensors)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.batch import batch_targets, loss_sum, to_device
from pretrainer.parallel.world import destroy_process_group

CASES = {"ddp": {"engine": "ddp"}, "fsdp-unsharded": {"engine": "fsdp", "accumulate_gradients": "unsharded"},
         "fsdp-sharded": {"engine": "fsdp", "accumulate_gradients": "sharded"}}


def holding(model) -> list[bool]:
    return [p.grad is not None for p in model.parameters()]


def weight_sum(model) -> float:
    return float(sum((p.full_tensor() if isinstance(p, DTensor) else p).double().sum() for p in model.parameters()))


def main(config_path: str, out_path: str) -> None:
    base = json.loads(open(config_path).read())
    seen = {}
    for name, keys in CASES.items():
        trainer = PreTrainer(PreTrainingArguments(**{**base, **keys}))
        engine, model = trainer.engine, trainer.model
        batch = to_device(next(trainer.train_stream), engine.device)
        with engine.no_sync(model):
            loss_sum(engine.forward(model, batch), batch_targets(batch)).backward()
        held_back = holding(model)
        loss_sum(engine.forward(model, batch), batch_targets(batch)).backward()
        seen[name] = {"after_no_sync": held_back, "after_last": holding(model)}
        engine.release()
    for name in ("ddp", "fsdp-unsharded"):
        torch.manual_seed(100 + dist.get_rank())
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base["model_path"]))
        before = weight_sum(model)
        trainer = PreTrainer(PreTrainingArguments(**{**base, **CASES[name]}), model=model)
        seen[f"{name}-own-seeds"] = {"rank0_before": trainer.engine.broadcast_object(before),
                                     "after": trainer.engine.all_gather_object(weight_sum(trainer.model))}
        trainer.engine.release()
    if trainer.engine.is_main:
        open(out_path, "w").write(json.dumps(seen))
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
