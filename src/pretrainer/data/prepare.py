"""`pretrainer prepare`: tokenize a corpus once into Megatron-compatible `PREFIX_{key}_document.bin/.idx`.

Worker processes load only the `tokenizers` library (no torch, no transformers) and encode batches of
documents; the parent reads records, keeps their order, and streams tokens to the writer. Each document
is encoded as the model's tokenizer encodes a text (its special tokens, e.g. a Llama BOS, included), with
the EOS appended when `append_eod` is set, as Megatron-LM's preprocess_data.py does.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from .indexed import IndexedDatasetWriter, optimal_dtype
from .readers import DataError, expand_paths, read_documents

logger = logging.getLogger(__name__)

BATCH = 256
_worker_tokenizer = None


@dataclass
class PrepareSummary:
    outputs: list[str] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    skipped_empty: int = 0
    seconds: float = 0.0

    def lines(self) -> list[str]:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        return [f"documents: {self.documents:,}", f"tokens: {self.tokens:,} ({rate:,.0f} tokens/s)",
                f"skipped: {self.skipped_empty:,} empty document(s)", *[f"wrote {o}.bin/.idx" for o in self.outputs]]


def tokenizer_file(path: str | Path) -> Path:
    path = Path(path)
    candidate = path if path.is_file() else path / "tokenizer.json"
    if not candidate.is_file():
        raise DataError(f"--tokenizer {path}: no tokenizer.json (a fast Hugging Face tokenizer) found")
    return candidate


def eod_token_id(tokenizer_json: Path) -> int:
    """The EOS id, from the tokenizer folder's tokenizer_config.json / special_tokens_map.json."""
    from tokenizers import Tokenizer

    folder = tokenizer_json.parent
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            token_id = Tokenizer.from_file(str(tokenizer_json)).token_to_id(eos) if eos else None
            if token_id is not None:
                return token_id
    raise DataError(f"--tokenizer {folder}: no eos_token in tokenizer_config.json or special_tokens_map.json, so "
                    "--append-eod has nothing to append")


def _init_worker(tokenizer_json: str) -> None:
    global _worker_tokenizer
    from tokenizers import Tokenizer

    _worker_tokenizer = Tokenizer.from_file(tokenizer_json)


def _encode(texts: list[str]) -> list[list[int]]:
    encode = getattr(_worker_tokenizer, "encode_batch_fast", _worker_tokenizer.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=True)]


def _batches(iterator, size: int):
    while batch := list(islice(iterator, size)):
        yield batch


def prepare(inputs: list[str], tokenizer: str, output_prefix: str, json_keys: list[str], append_eod: bool = False,
            workers: int = 1, txt_mode: str = "line", progress: bool = True) -> PrepareSummary:
    files = expand_paths(inputs, "--input")
    tokenizer_json = tokenizer_file(tokenizer)
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    dtype = optimal_dtype(vocab_size)
    eod = eod_token_id(tokenizer_json) if append_eod else None
    summary = PrepareSummary()
    start = time.perf_counter()
    # fork: workers start at once and load only the `tokenizers` library; the parent has run no torch op.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with context.Pool(max(1, workers), initializer=_init_worker, initargs=(str(tokenizer_json),)) as pool:
        for key in json_keys:
            prefix = f"{output_prefix}_{key}_document"
            writer = IndexedDatasetWriter(prefix, dtype)
            bar = tqdm(unit="doc", disable=not progress, desc=key)
            try:
                texts = (doc.text for doc in read_documents(files, text_key=key, txt_mode=txt_mode))
                for encoded in pool.imap(_encode, _batches(texts, BATCH)):
                    for ids in encoded:
                        if not ids:
                            summary.skipped_empty += 1
                            continue
                        if eod is not None:
                            ids.append(eod)
                        writer.add_document(ids)
                        summary.documents += 1
                        summary.tokens += len(ids)
                    bar.update(len(encoded))
                    elapsed = time.perf_counter() - start
                    bar.set_postfix(tokens_per_s=f"{summary.tokens / max(elapsed, 1e-9):,.0f}")
                writer.finalize()
            except BaseException:
                writer.abort()  # no .bin/.idx pair that looks complete
                raise
            finally:
                bar.close()
            summary.outputs.append(prefix)
    summary.seconds = time.perf_counter() - start
    return summary


def write_summary(summary: PrepareSummary, output_prefix: str) -> Path:
    path = Path(f"{output_prefix}_summary.json")
    path.write_text(json.dumps(summary.__dict__, indent=2))
    return path
