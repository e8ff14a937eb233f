"""Time the GPT sample index and blend index builds at corpus scale (no data files needed).

    .venv/bin/python bench/gpt_index.py [--documents 5000000] [--seq-length 2048] [--epochs 2]

Document lengths are drawn from a log-normal (median ~400 tokens, like web text); the build is the same
code `GPTSamples` runs on first use of a prepared prefix.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pretrainer.data.gpt_samples import build_blend_index, build_sample_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=5_000_000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--blend-samples", type=int, default=10_000_000)
    ns = parser.parse_args()
    lengths = np.random.default_rng(0).lognormal(6.0, 1.0, ns.documents).astype(np.int64) + 1
    start = time.perf_counter()
    index = build_sample_index(lengths, ns.seq_length, ns.epochs, seed=1234)
    seconds = time.perf_counter() - start
    print(f"sample index: {ns.documents:,} documents, {int(lengths.sum()):,} tokens/epoch, {ns.epochs} epoch(s), "
          f"{len(index['sample_order']):,} samples of {ns.seq_length + 1}: {seconds:.2f} s, "
          f"{sum(a.nbytes for a in index.values()) / 2**20:,.0f} MB of index")
    start = time.perf_counter()
    blend = build_blend_index(np.array([0.5, 0.3, 0.15, 0.05]), ns.blend_samples)
    print(f"blend index: 4 datasets, {len(blend['dataset_index']):,} samples: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
