"""Raw training files tokenized once into a cached token store that every run and rank memory-maps (where it lives,
when it is rebuilt, who builds it: docs/data.md, 'The token cache').

The store's folder is named by a hash of everything that changes the tokens, and `manifest.json`, written last, marks
it complete, so an interrupted build leaves nothing that looks finished. One document per record, in order (an empty
text is an empty document), so document indices match the records.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .encode import EncodeSettings, apply_policy, encode_into
from .indexed import NO_ROOM, IndexedDataset, IndexedDatasetWriter, optimal_dtype, remove_stale_partial_files
from .readers import BytesRead, DataError, SpecialTokens, read_documents

logger = logging.getLogger(__name__)

STORE_FORMAT = 1  # raise when the way tokens are produced changes: older stores are then not reused
MANIFEST = "manifest.json"
PREFIX = "tokens"


@dataclass(frozen=True)
class StoreSpec:
    """What a store is made of; its hash names the store's folder."""

    files: tuple[Path, ...]
    text_key: str
    txt_mode: str
    special: SpecialTokens
    encode: EncodeSettings
    tokenizer_fingerprint: str      # what identifies the tokenizer's encoding (its serialized form or vocabulary)
    skip_bad_records: bool = False  # on_error: skip

    def key(self) -> str:
        description = {
            "format": STORE_FORMAT,
            "files": [_identity(p) for p in self.files],
            "tokenizer": hashlib.sha256(self.tokenizer_fingerprint.encode()).hexdigest(),
            "bos": self.encode.bos, "eos": self.encode.eos, "policy": self.encode.policy,
            "dtype": str(self.encode.dtype.__name__), "text_key": self.text_key, "txt_mode": self.txt_mode,
            "special": [self.special.bos, self.special.eos], "skip_bad_records": self.skip_bad_records,
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:20]


def _identity(file) -> list:
    """What names a file's contents: a local file's path, size and modification time; an object's URL, size and
    version (data/remote.py)."""
    if hasattr(file, "identity"):
        return file.identity()
    return [str(file.resolve()), file.stat().st_size, file.stat().st_mtime_ns]


def pack_settings(tokenizer) -> EncodeSettings:
    """The training pipeline's encoding for an HF tokenizer: BOS (if distinct from EOS) and EOS around each document."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token, which separates packed documents; use a tokenizer that "
                        "defines eos_token")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id not in (None, eos) else None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    serialized = backend.to_str() if backend is not None else ""
    return EncodeSettings(serialized, bos, eos, optimal_dtype(len(tokenizer)), policy="pack")


def store_spec(files: list[Path], tokenizer, text_key: str, txt_mode: str, on_error: str = "fail") -> StoreSpec:
    special = SpecialTokens(tokenizer.bos_token or "", tokenizer.eos_token or "")
    settings = pack_settings(tokenizer)
    # A tokenizer without a serializable fast backend is told apart by its class and vocabulary.
    fingerprint = settings.tokenizer_json or json.dumps([type(tokenizer).__name__,
                                                         sorted(tokenizer.get_vocab().items())])
    return StoreSpec(tuple(files), text_key, txt_mode, special, settings, fingerprint, on_error == "skip")


def open_store(spec: StoreSpec, root: Path, what: str, tokenizer, placement, workers: int = 1) -> IndexedDataset:
    """The store of `spec` under `root`, built where it is missing by the ranks whose turn it is (docs/data.md,
    'The token cache'); every rank returns the memory-mapped store."""
    folder = root / spec.key()
    store = None
    phases = ((placement.is_main, "rank 0"),
              (placement.local_rank == 0 and not placement.is_main, "local rank 0 of each machine"))
    for builds, builder in phases:
        outcome = None
        if builds:
            try:
                store = _ensure(folder, spec, what, tokenizer, workers)
            except DataError as exc:
                outcome = str(exc)
            except OSError as exc:  # a full or failing disk: no traceback, what to do instead
                outcome = (f"{what}: tokenizing into {folder} failed ({exc})" + ("; free space there, or set "
                           "data_cache_path to a folder on a larger disk" if exc.errno in NO_ROOM else ""))
            except Exception as exc:  # the other ranks wait for this one: tell them, then fail everywhere
                logger.exception("%s: tokenizing into %s failed", what, folder)
                outcome = f"{what}: tokenizing into {folder} failed ({type(exc).__name__}: {exc})"
        try:
            errors = [error for error in placement.gather(outcome) if error]
        except RuntimeError as exc:  # a rank waited longer than the collective timeout, or one died
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise DataError(f"{what}: waiting for {builder} to tokenize into {folder} failed ({first_line}); "
                            "a corpus of many GB can take longer than distributed_timeout_minutes: raise it, or "
                            "tokenize beforehand with `pretrainer prepare` and train on its output "
                            "(megatron_dataset_flag: true)") from None
        if errors:
            raise DataError(errors[0])
    return store if store is not None else IndexedDataset(folder / PREFIX)


def cached_store(spec: StoreSpec, root: Path) -> IndexedDataset | None:
    """The store of `spec` under `root` if it is already built (nothing is tokenized); None otherwise."""
    folder = root / spec.key()
    try:
        return IndexedDataset(folder / PREFIX) if (folder / MANIFEST).is_file() else None
    except DataError:
        return None


def _ensure(folder: Path, spec: StoreSpec, what: str, tokenizer, workers: int) -> IndexedDataset:
    if (folder / MANIFEST).is_file():
        try:
            store = IndexedDataset(folder / PREFIX)
            logger.info("%s: reusing the tokenized store %s", what, folder)
            return store
        except DataError as exc:
            logger.warning("%s: the tokenized store %s is damaged (%s); tokenizing again", what, folder, exc)
            (folder / MANIFEST).unlink(missing_ok=True)
    _build(folder, spec, what, tokenizer, workers)
    return IndexedDataset(folder / PREFIX)


def _build(folder: Path, spec: StoreSpec, what: str, tokenizer, workers: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if remove_stale_partial_files(folder):
        logger.info("%s: removed the partial files of an interrupted build in %s", what, folder)
    start = time.perf_counter()
    logger.info("%s: tokenizing %d file(s) into %s with %d worker(s); other ranks wait for it (at most "
                "distributed_timeout_minutes)", what, len(spec.files), folder, workers)
    writer = IndexedDatasetWriter(folder / PREFIX, spec.encode.dtype)
    skipped: list[DataError] = []
    on_bad = skipped.append if spec.skip_bad_records else None
    meter = BytesRead(list(spec.files))
    texts = (document.text for document in read_documents(list(spec.files), spec.text_key, spec.txt_mode,
                                                          on_bad=on_bad, special=spec.special, meter=meter))
    try:
        if spec.encode.tokenizer_json:
            documents, tokens = encode_into(writer, texts, spec.encode, workers, progress=sys.stderr.isatty(),
                                            description=f"tokenizing {what}", meter=meter)
        else:  # a tokenizer without a serializable fast backend: encoded here, one process
            documents, tokens = _encode_here(writer, texts, spec.encode, tokenizer)
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - start
    if skipped:
        reasons = Counter(exc.reason for exc in skipped)
        logger.warning("%s: skipped %d bad record(s) (on_error: skip; %s), e.g. %s", what, len(skipped),
                       ", ".join(f"{reason}: {count}" for reason, count in reasons.most_common()),
                       "; ".join(str(exc) for exc in skipped[:3]))
    manifest = {"format": STORE_FORMAT, "what": what, "files": [str(p) for p in spec.files], "documents": documents,
                "tokens": tokens, "seconds": round(seconds, 3), "skipped": len(skipped),
                "skipped_examples": [str(exc) for exc in skipped[:10]],
                "built_by": {"host": socket.gethostname(), "rank": int(os.environ.get("RANK", "0")),
                             "pid": os.getpid()}}
    tmp = folder / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, folder / MANIFEST)  # last: the store is complete
    logger.info("%s: tokenized %d documents (%d tokens) in %.1f s into %s", what, documents, tokens, seconds, folder)


def _encode_here(writer, texts, settings: EncodeSettings, tokenizer) -> tuple[int, int]:
    documents = tokens = 0
    for text in texts:
        ids = apply_policy(list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]), settings)
        writer.add_document(np.asarray(ids, dtype=settings.dtype))
        documents += 1
        tokens += len(ids)
    return documents, tokens
