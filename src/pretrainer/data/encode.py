"""Tokenizing documents in worker processes, straight into an indexed token store.

Workers load only the `tokenizers` library (no torch, no transformers) from the tokenizer's serialized JSON, and hand
back two arrays per batch (nearly free to pickle); the parent writes them in record order. Two policies:

- `prepare` (`pretrainer prepare`, as Megatron-LM's preprocess_data.py, without doubling a BOS or EOS the text has);
- `pack` (`train_data`): BOS in front (only a BOS distinct from the EOS) and EOS at the end unless the text already has
  them; an empty text stays an empty document, so document indices match the records.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from itertools import chain, islice
from typing import Iterable

import numpy as np
from tqdm import tqdm

BATCH = 256
_worker: dict = {}


@dataclass(frozen=True)
class EncodeSettings:
    tokenizer_json: str          # the tokenizer serialized (Tokenizer.to_str()), for the workers
    bos: int | None              # the BOS id the policy may add (None: never)
    eos: int | None              # the EOS id the policy may add (None: never)
    dtype: type                  # the store's token dtype
    policy: str = "pack"


def _init_worker(settings: EncodeSettings) -> None:
    from tokenizers import Tokenizer

    _worker.update(tokenizer=Tokenizer.from_str(settings.tokenizer_json), settings=settings)


def _encode(texts: list[str]) -> tuple[bytes, np.ndarray]:
    """A batch's tokens back to back (in the store's dtype) and each document's length."""
    tokenizer, settings = _worker["tokenizer"], _worker["settings"]
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    pieces = [apply_policy(encoding.ids, settings)
              for encoding in encode(texts, add_special_tokens=settings.policy == "prepare")]
    lengths = np.fromiter(map(len, pieces), dtype=np.int32, count=len(pieces))
    tokens = np.fromiter(chain.from_iterable(pieces), dtype=settings.dtype, count=int(lengths.sum()))
    return tokens.tobytes(), lengths


def apply_policy(ids: list[int], settings: EncodeSettings) -> list[int]:
    bos, eos = settings.bos, settings.eos
    if settings.policy == "prepare":
        if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            del ids[0]  # the text began with the BOS itself
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids
    if not ids:
        return ids
    if bos is not None and ids[0] != bos:
        ids = [bos, *ids]
    if eos is not None and ids[-1] != eos:
        ids.append(eos)
    return ids


def _batches(iterator, size: int):
    while batch := list(islice(iterator, size)):
        yield batch


def encode_in_process(writer, texts: Iterable[str], settings: EncodeSettings) -> tuple[int, int]:
    """As encode_into, in this process: for a process that may not start children (a pool's or a cluster's
    worker)."""
    _init_worker(settings)
    documents = tokens = 0
    for data, lengths in map(_encode, _batches(iter(texts), BATCH)):
        writer.add_documents(data, lengths)
        documents, tokens = documents + len(lengths), tokens + int(lengths.sum())
    return documents, tokens


def encode_into(writer, texts: Iterable[str], settings: EncodeSettings, workers: int = 1,
                progress: bool = False, description: str = "tokenizing", meter=None) -> tuple[int, int]:
    """Encode `texts` in order into `writer`; returns (documents, tokens). A progress bar on a terminal shows
    documents/s and tokens/s, and with `meter` (the readers' BytesRead) the input bytes read and an ETA."""
    # fork: workers start at once and import only `tokenizers`; the parent has run no torch op on this path.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    documents = tokens = 0
    start = time.perf_counter()
    units = ({"total": meter.total, "unit": "B", "unit_scale": True, "unit_divisor": 1024} if meter is not None
             else {"unit": "doc"})
    bar = tqdm(disable=not progress, desc=description, **units)
    try:
        with context.Pool(max(1, workers), initializer=_init_worker, initargs=(settings,)) as pool:
            for data, lengths in pool.imap(_encode, _batches(iter(texts), BATCH)):
                writer.add_documents(data, lengths)
                documents += len(lengths)
                tokens += int(lengths.sum())
                bar.update(meter.done - bar.n if meter is not None else len(lengths))
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(docs_per_s=f"{documents / elapsed:,.0f}", tokens_per_s=f"{tokens / elapsed:,.0f}",
                                refresh=False)
    finally:
        bar.close()
    return documents, tokens
