"""The `pretrainer tokenizer {train,extend,inspect}` command lines."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from ..config import check_writable_folder
from ..config.loading import int_at_least
from ..data import DataError


def add_tokenizer_commands(commands) -> None:
    tokenizer = commands.add_parser("tokenizer", help="train, extend or compare tokenizers")
    actions = tokenizer.add_subparsers(dest="action", required=True)

    def corpus_options(parser, required: bool = True):
        parser.add_argument("--input", nargs="+", required=required,
                            help="files, globs or folders (json, jsonl, csv, txt, parquet; .gz/.zst too)")
        parser.add_argument("--text-key", default="text", help="the field holding the text (json, csv, parquet)")
        parser.add_argument("--txt-mode", choices=["line", "file"], default="line",
                            help=".txt: a document per line/file")

    train = actions.add_parser("train", help="train a tokenizer on a corpus; writes an HF tokenizer folder")
    corpus_options(train)
    train.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary")
    train.add_argument("--output", required=True, help="folder to write (AutoTokenizer loads it)")
    train.add_argument("--type", choices=["bpe", "unigram"], default="bpe", dest="kind",
                       help="bpe: byte-level BPE (Llama-3 style) unless --byte-fallback; unigram: SentencePiece")
    train.add_argument("--byte-fallback", action="store_true",
                       help="a SentencePiece model with byte fallback, as Llama-2's (writes tokenizer.model too)")
    train.add_argument("--workers", type=int_at_least(1), default=1, help="threads for SentencePiece training")

    extend = actions.add_parser("extend", help="add tokens to a tokenizer; every old token keeps its id")
    extend.add_argument("--tokenizer", required=True, help="the base tokenizer folder (tokenizer.model or .json)")
    corpus_options(extend, required=False)
    extend.add_argument("--from", dest="source", help="take the new tokens from this tokenizer instead of "
                        "learning them from --input")
    extend.add_argument("--add", type=int, required=True, help="at most this many new tokens")
    extend.add_argument("--scripts", nargs="+", help="the scripts to add tokens for (e.g. CJK); default: those "
                        "the base covers poorly in the corpus")
    extend.add_argument("--output", required=True, help="folder to write")
    extend.add_argument("--workers", type=int_at_least(1), default=1, help="threads for SentencePiece training")

    inspect = actions.add_parser("inspect", help="compare tokenizers on the same documents")
    inspect.add_argument("tokenizers", nargs="+", help="tokenizer folders; the first is the base")
    corpus_options(inspect)
    inspect.add_argument("--max-bytes", type=int_at_least(1), help="read at most this many bytes of input")
    inspect.add_argument("--json", action="store_true", help="print the figures as JSON")


def tokenizer_command(ns) -> int:
    from .corpus import Corpus

    corpus = Corpus(ns.input, ns.text_key, ns.txt_mode) if ns.input else None
    if ns.action in ("train", "extend"):  # before minutes of training, not after
        check_writable_folder(ns.output, "--output")
    if ns.action == "train":
        from .train import train_tokenizer

        with written_whole(Path(ns.output)) as folder:
            trained = train_tokenizer(corpus, ns.vocab_size, folder, ns.kind, ns.byte_fallback, ns.workers)
        print(f"wrote {trained.kind} tokenizer, {trained.vocab_size:,} tokens: {ns.output}")
    elif ns.action == "extend":
        from .extend import extend_tokenizer, refuse_base_as_output

        source = Path(ns.source) if ns.source else None
        refuse_base_as_output(Path(ns.tokenizer), Path(ns.output))  # before the files are written beside it
        with written_whole(Path(ns.output)) as folder:
            extension = extend_tokenizer(Path(ns.tokenizer), folder, ns.add, corpus, source, ns.scripts, ns.workers)
        targets = ", ".join(f"{script} ({share:.0%} uncovered)" for script, share in extension.targets.items())
        print(f"target scripts: {targets}")
        print(f"added {len(extension.added):,} tokens to the {extension.kind} tokenizer: {extension.base_size:,} -> "
              f"{extension.size:,} (ids {extension.base_size:,} and up)")
        if len(extension.added) < ns.add:
            print(f"only {len(extension.added):,} of --add {ns.add:,}: {'--from' if source else 'the corpus'} offered "
                  "no more tokens of the target scripts")
        print(f"wrote {ns.output}")
    else:
        from .inspect import inspect_tokenizers, stats_table

        stats = inspect_tokenizers(ns.tokenizers, corpus, ns.max_bytes)
        print(json.dumps({"tokenizers": [asdict(s) for s in stats]}, indent=2) if ns.json else stats_table(stats))
    return 0


@contextmanager
def written_whole(output: Path):
    """A staging folder beside `output`, its files moved into `output` once all are written: a failed write (a full
    disk) leaves `output` as it was, not a truncated tokenizer.json a later run cannot parse, and is one line."""
    staging = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) or "(os error" in str(exc):  # tokenizers' and safetensors' I/O errors
            raise DataError(f"--output {output}: writing the tokenizer failed ({exc}); nothing in {output} was "
                            "changed: free space there, or give another --output") from None
        raise
    for written in staging.iterdir():
        os.replace(written, output / written.name)
    staging.rmdir()
