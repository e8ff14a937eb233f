"""Corpus preparation speed and memory: `pretrainer prepare` next to a minimal tokenizers loop and the
HF `datasets.map` flow of the seeds (when `datasets` is installed), on a generated jsonl corpus.

    .venv/bin/python bench/prepare.py [--megabytes 50] [--workers 2] [--megatron-lm DIR]

Prints tokens/s (wall clock, start-up included), the peak resident memory of each process tree and the
size of what each flow leaves on disk. With `--megatron-lm DIR` (a Megatron-LM source tree; its
`tools/preprocess_data.py` is run with this environment's python, DIR first on PYTHONPATH) Megatron's own
tool runs too and its `.bin/.idx` are compared byte for byte with ours.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import sys
import tempfile
import textwrap
from pathlib import Path

from common import REPO, measure

TOKENIZER = REPO / "examples" / "models" / "tiny-llama"
BIN = Path(sys.executable).parent

SIMPLE_LOOP = textwrap.dedent("""
    import json, sys, multiprocessing as mp
    from tokenizers import Tokenizer
    def init(path):
        global tok
        tok = Tokenizer.from_file(path)
    def encode(lines):
        return sum(len(e.ids) for e in tok.encode_batch_fast([json.loads(l)["text"] for l in lines]))
    def chunks(f, n=256):
        batch = []
        for line in f:
            batch.append(line)
            if len(batch) == n:
                yield batch
                batch = []
        if batch:
            yield batch
    if __name__ == "__main__":
        corpus, tokenizer, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
        with open(corpus) as f, mp.Pool(workers, init, (tokenizer,)) as pool:
            print(sum(pool.imap(encode, chunks(f))))
""")

DATASETS_MAP = textwrap.dedent("""
    import sys
    from datasets import load_dataset
    from transformers import AutoTokenizer
    corpus, tokenizer, workers, block = sys.argv[1], sys.argv[2], int(sys.argv[3]), 256
    tok = AutoTokenizer.from_pretrained(tokenizer)
    ds = load_dataset("json", data_files=corpus, split="train", cache_dir=sys.argv[4])
    ds = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=workers, remove_columns=["text"])
    def group(b):
        ids = [t for row in b["input_ids"] for t in row]
        n = len(ids) // block * block
        return {"input_ids": [ids[i:i + block] for i in range(0, n, block)]}
    ds = ds.map(group, batched=True, num_proc=workers, remove_columns=ds.column_names)
    print(len(ds) * block)
""")


def make_corpus(path: Path, megabytes: int) -> None:
    docs = [json.loads(line)["text"] for line in (REPO / "examples/data/python_docs.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 2**20:
            text = " ".join(rng.sample(docs, 3))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--megabytes", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--megatron-lm", type=Path, help="Megatron-LM source tree, to run its preprocess_data.py")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        make_corpus(corpus, ns.megabytes)
        (tmp / "loop.py").write_text(SIMPLE_LOOP)
        rows = []
        wall, rss, out = measure([str(BIN / "pretrainer"), "prepare", "--input", str(corpus), "--tokenizer",
                                  str(TOKENIZER), "--output-prefix", str(tmp / "out"), "--workers", str(ns.workers)])
        tokens = json.loads((tmp / "out_summary.json").read_text())["tokens"]
        rows.append(("pretrainer prepare", tokens, wall, rss, disk_mb(tmp, "out_text_document.*")))
        wall, rss, out = measure([sys.executable, str(tmp / "loop.py"), str(corpus), str(TOKENIZER / "tokenizer.json"),
                                  str(ns.workers)])
        rows.append(("tokenizers Pool loop (no output)", int(out.strip()), wall, rss, 0.0))
        try:
            import datasets  # noqa: F401
        except ImportError:
            print("(datasets is not installed: the HF datasets.map + group_texts flow is skipped)")
        else:
            (tmp / "hf.py").write_text(DATASETS_MAP)
            wall, rss, out = measure([sys.executable, str(tmp / "hf.py"), str(corpus), str(TOKENIZER),
                                      str(ns.workers), str(tmp / "hf-cache")])
            rows.append(("datasets.map + group_texts", int(out.strip()), wall, rss, disk_mb(tmp, "hf-cache/**/*")))
        identical = None
        if ns.megatron_lm:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ns.megatron_lm.resolve()),
                                                                os.environ.get("PYTHONPATH", "")])}
            wall, rss, _ = measure([sys.executable, "tools/preprocess_data.py", "--input", str(corpus),
                                    "--output-prefix", str(tmp / "megatron"), "--tokenizer-type",
                                    "HuggingFaceTokenizer", "--tokenizer-model", str(TOKENIZER), "--workers",
                                    str(ns.workers)], env=env, cwd=ns.megatron_lm)
            rows.append(("Megatron-LM preprocess_data.py", tokens, wall, rss, disk_mb(tmp, "megatron_text_document.*")))
            identical = all(filecmp.cmp(tmp / f"out_text_document{s}", tmp / f"megatron_text_document{s}",
                                        shallow=False) for s in (".bin", ".idx"))
    print(f"corpus: {ns.megabytes} MB jsonl, {ns.workers} workers, tokenizer {TOKENIZER.name} (4,096 BPE)")
    print(f"{'flow':34} {'tokens':>12} {'wall s':>8} {'tokens/s':>11} {'peak RSS MB':>12} {'on disk MB':>11}")
    for name, tokens, wall, rss, disk in rows:
        print(f"{name:34} {tokens:12,} {wall:8.1f} {tokens / wall:11,.0f} {rss:12.0f} {disk:11.0f}")
    if identical is not None:
        print(f"pretrainer prepare output byte-identical to Megatron-LM's: {'yes' if identical else 'NO'}")


def disk_mb(folder: Path, pattern: str) -> float:
    return sum(p.stat().st_size for p in folder.glob(pattern) if p.is_file()) / 2**20


if __name__ == "__main__":
    main()
