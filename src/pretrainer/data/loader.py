"""Build the train/eval data; iterate a user's DataLoader as a resumable stream of micro-batches.

Packed datasets are drawn by `sampling.SampleStream`. A user's DataLoader goes
through `BatchStream`, which runs as many epochs as the run needs and knows its
exact position (epoch, micro-batches consumed in that epoch) counted on the
consumer side, so a checkpoint restores the position even when DataLoader
workers prefetch ahead.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch

from .packing import PackedDataset, tokenize_documents
from .readers import DataError, Document, expand_paths, read_documents

logger = logging.getLogger(__name__)


@dataclass
class BuiltData:
    train: PackedDataset
    eval: PackedDataset | None


def build_datasets(args, tokenizer, seq_length: int) -> BuiltData:
    """Read, tokenize and pack the configured files; hold out an eval split when no eval files are given."""
    train_files = expand_paths(args.resolved_train_data, "train_data")
    documents = list(read_documents(train_files, args.text_key, args.txt_mode))
    if not documents:
        raise DataError(f"train_data: {', '.join(map(str, train_files))} holds no documents")
    eval_documents: list[Document] = []
    if args.resolved_eval_data:
        eval_files = expand_paths(args.resolved_eval_data, "eval_data")
        eval_documents = list(read_documents(eval_files, args.text_key, args.txt_mode))
    elif args.eval_split:
        documents, eval_documents = split_documents(documents, args.eval_split, args.seed)
    train_stream, skipped = tokenize_documents(documents, tokenizer)
    if skipped:
        logger.warning("skipped %d empty document(s) in the training data", skipped)
    train = PackedDataset(train_stream, seq_length)
    if len(train) == 0:
        raise DataError("the training data tokenizes to fewer than 2 tokens; nothing to train on")
    evaluation = None
    if eval_documents:
        eval_stream, _ = tokenize_documents(eval_documents, tokenizer)
        evaluation = PackedDataset(eval_stream, seq_length) if len(eval_stream) > 1 else None
    logger.info("data: %d train documents -> %d tokens in %d windows of %d; %d eval documents -> %s",
                len(documents), train.num_target_tokens + 1, len(train), seq_length, len(eval_documents),
                f"{len(evaluation)} windows" if evaluation else "no eval windows")
    return BuiltData(train, evaluation)


def build_indexed_datasets(args, seq_length: int) -> BuiltData:
    """Train/valid streams from a prepared `.bin/.idx` prefix, split by Megatron's contiguous document ranges."""
    from .indexed import IndexedDataset

    config = args.get_dataloader_config()
    prefixes = args.data_path if args.data_path is not None else config.get("data_path")
    if prefixes is None:
        raise DataError("megatron_dataset_flag is true but no data_path (or dataloader_config.data_path) names a "
                        ".bin/.idx prefix")
    if isinstance(prefixes, str):
        prefixes = prefixes.split()  # Megatron's "weight prefix weight prefix ..." string form too
    if any(_is_number(p) for p in prefixes) or len(prefixes) != 1:
        raise DataError(f"data_path {prefixes}: blending several prefixes (with weights) is not supported yet; "
                        "give one prefix")
    megatron = (args.plugin_args or {}).get("other_megatron_args") or {}
    split = str(config.get("split") or megatron.get("split") or "969,30,1")
    dataset = IndexedDataset(prefixes[0])
    ranges = split_ranges(split, dataset.num_documents)
    streams = [dataset.tokens[slice(*dataset.document_token_range(*r))] for r in ranges[:2]]
    train = PackedDataset(streams[0], seq_length)
    if len(train) == 0:
        raise DataError(f"data_path {prefixes[0]}: split {split!r} leaves no training documents out of "
                        f"{dataset.num_documents}")
    evaluation = PackedDataset(streams[1], seq_length) if len(streams[1]) > 1 else None
    logger.info("data: %s, %d documents, split %s -> %d train windows of %d, %s", prefixes[0],
                dataset.num_documents, split, len(train), seq_length,
                f"{len(evaluation)} eval windows" if evaluation else "no eval split")
    return BuiltData(train, evaluation)


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's split string ("969,30,1", "100,0,0") as contiguous [begin, end) document ranges."""
    parts = [float(x) for x in re.findall(r"[0-9]*\.?[0-9]+", split)]
    if not 1 <= len(parts) <= 3 or sum(parts) <= 0:
        raise DataError(f"split {split!r}: give up to three non-negative weights for train,valid,test, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    bounds = [0.0]
    for part in parts:
        bounds.append(bounds[-1] + part / total)
    return [(int(round(lo * num_documents)), int(round(hi * num_documents))) for lo, hi in zip(bounds, bounds[1:])]


def _is_number(text) -> bool:
    try:
        float(text)
        return True
    except (TypeError, ValueError):
        return False


def split_documents(documents: list[Document], eval_split: float | int, seed: int):
    """Hold out a seeded random set of documents: a fraction (< 1) or a count; always leaves >= 1 for training."""
    n = len(documents)
    if n < 2:
        logger.warning("only %d document: no eval split is taken from the training data", n)
        return documents, []
    count = int(eval_split) if isinstance(eval_split, int) else max(1, int(round(eval_split * n)))
    count = min(count, n - 1)
    order = np.random.default_rng(seed).permutation(n)
    held_out = set(order[:count].tolist())
    train = [d for i, d in enumerate(documents) if i not in held_out]
    evaluation = [d for i, d in enumerate(documents) if i in held_out]
    return train, evaluation


class BatchStream:
    """Endless iterator of micro-batches over a DataLoader, epoch after epoch, with a resumable position.

    Each epoch's order is reseeded from (seed, epoch) when the loader shuffles with a RandomSampler, so
    epoch k is the same permutation whether the run started at epoch 0 or resumed mid-way.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, seed: int):
        self.loader = loader
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # micro-batches handed out in the current epoch
        self._iterator = None
        sampler = getattr(loader, "sampler", None)
        # Reseed only a RandomSampler the user left unseeded; a user's own generator is theirs to manage.
        self._reseed = isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None
        try:
            self.batches_per_epoch = len(loader)
        except TypeError:
            self.batches_per_epoch = None
        if self.batches_per_epoch == 0:
            raise DataError("the training DataLoader is empty")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._iterator = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._iterator is None:
            self._iterator = self._start_epoch()
        try:
            batch = next(self._iterator)
        except StopIteration:
            if self.offset == 0:
                raise DataError("the training DataLoader yielded no batch in a whole epoch") from None
            self.epoch, self.offset = self.epoch + 1, 0
            self._iterator = self._start_epoch()
            batch = next(self._iterator)
        self.offset += 1
        return batch

    def _start_epoch(self):
        sampler = getattr(self.loader, "sampler", None)
        if self._reseed:
            sampler.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        iterator = iter(self.loader)
        if self.offset:
            logger.info("resuming data at epoch %d, skipping %d micro-batches", self.epoch, self.offset)
            for _ in range(self.offset):
                next(iterator)
        return iterator
