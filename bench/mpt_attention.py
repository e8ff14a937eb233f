"""MPT's attention through the fused kernel (models/mpt_attention.py) against transformers' own, on this CPU.

A random-init MPT (fp32) trains forward and backward on the same batch with each attention, in one process,
alternating rounds; prints the median step time of each, the tensor bytes autograd saves for backward in one
forward (counted through saved-tensor hooks), and the largest logit difference.

    .venv/bin/python bench/mpt_attention.py [--d-model 512] [--layers 4] [--seq 1024] [--batch 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from pretrainer.models import mpt_attention  # noqa: E402


def saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for backward after one forward (each storage once; parameters excluded)."""
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in owned:
            saved[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.float().mean()
    return sum(saved.values())


def step_seconds(model, ids) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    ns = parser.parse_args()
    from transformers import AutoModelForCausalLM, MptConfig

    torch.manual_seed(0)
    config = MptConfig(d_model=ns.d_model, n_heads=ns.heads, n_layers=ns.layers, expansion_ratio=4,
                       max_seq_len=ns.seq, vocab_size=8192, no_bias=True)
    theirs = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ours = copy.deepcopy(theirs)
    mpt_attention.install(ours)
    ids = torch.randint(0, config.vocab_size, (ns.batch, ns.seq))
    with torch.no_grad():
        difference = (ours(input_ids=ids, use_cache=False).logits - theirs(input_ids=ids, use_cache=False).logits)
    times = {"transformers": [], "fused": []}
    for model in (theirs, ours):  # one untimed step each: first-call allocations
        step_seconds(model, ids)
    for _ in range(ns.rounds):
        times["transformers"].append(step_seconds(theirs, ids))
        times["fused"].append(step_seconds(ours, ids))
    print(f"MPT d_model {ns.d_model}, {ns.heads} heads, {ns.layers} layers, {ns.batch} x {ns.seq} tokens, fp32, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'attention':<14}{'step s (median)':>16}{'saved for backward MiB':>24}")
    for name, model in (("transformers", theirs), ("fused", ours)):
        print(f"{name:<14}{statistics.median(times[name]):>16.3f}{saved_bytes(model, ids) / 2**20:>24,.1f}")
    print(f"largest logit difference {difference.abs().max().item():.2e}")


if __name__ == "__main__":
    main()
