"""GPT-style samples over prepared `.bin/.idx` documents, and weighted blends of several such datasets.

A sample is `seq_length + 1` consecutive tokens of a stream made by concatenating the documents of a split, epoch after
epoch, each epoch in its own seeded document order; consecutive samples share one token (the last target of one is the
first input of the next), so samples cross document boundaries and nothing is padded. Samples whose first token lies in
epoch `e` form epoch `e`'s block and are shuffled within it, again seeded by `e`. Epoch `e`'s documents and samples
therefore depend only on (seed, e): asking for more samples later (a longer run) keeps every earlier sample in place.

The three index arrays (document order, sample start, sample order) are built with vectorized numpy (`searchsorted` over
cumulative lengths; no Python loop per document or sample), written once to a cache folder under a name keyed by every
parameter, and memory-mapped by every rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .indexed import IndexedDataset
from .readers import DataError

logger = logging.getLogger(__name__)

INDEX_VERSION = 1  # bump when the index layout or algorithm changes, so old caches are not reused


class IndexCache:
    """Where index arrays live: built by one rank, then memory-mapped by all. A rank that still finds a file missing
    afterwards (a cache folder not shared between nodes) builds it itself: the arrays are deterministic."""

    def __init__(self, folder: Path, build_on_this_rank: bool = True, barrier: Callable[[], None] = lambda: None):
        self.folder = Path(folder)
        self.build_on_this_rank = build_on_this_rank
        self.barrier = barrier

    def arrays(self, kind: str, description: dict, names: tuple[str, ...],
               build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
        paths = {name: self.folder / f"{key}-{kind}-{name}.npy" for name in names}
        if self.build_on_this_rank and not all(p.is_file() for p in paths.values()):
            self._write(paths, description, key, kind, build())
        self.barrier()
        if not all(p.is_file() for p in paths.values()):
            self._write(paths, description, key, kind, build())
        return {name: np.load(path, mmap_mode="r") for name, path in paths.items()}

    def _write(self, paths: dict[str, Path], description: dict, key: str, kind: str, arrays: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, path in paths.items():
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                np.save(f, arrays[name])
            os.replace(tmp, path)  # complete files only, even with several writers
        (self.folder / f"{key}-{kind}-description.json").write_text(json.dumps(description, indent=2))


class GPTSamples(torch.utils.data.Dataset):
    """`num_samples` samples of `seq_length + 1` tokens from documents [first, last) of an indexed dataset."""

    def __init__(self, dataset: IndexedDataset, documents: tuple[int, int], seq_length: int, num_samples: int,
                 seed: int, cache: IndexCache, name: str = "train"):
        first, last = documents
        self.dataset, self.seq_length, self.num_samples = dataset, seq_length, num_samples
        itemsize = np.dtype(dataset.dtype).itemsize
        self.doc_starts = dataset.sequence_pointers[dataset.document_indices[first:last]] // itemsize
        self.doc_lengths = lengths = _document_lengths(dataset, first, last)
        tokens_per_epoch = int(lengths.sum())
        where = f"{dataset.bin_path.with_suffix('')} ({name} split, documents {first}..{last})"
        if tokens_per_epoch < 2:
            raise DataError(f"{where}: the split holds {tokens_per_epoch} token(s); it cannot give any sample. "
                            "Change `split` so this part gets documents, or prepare more data.")
        if num_samples < 1:
            raise DataError(f"{where}: asked for {num_samples} samples")
        # Epoch e's block = samples starting in [e*T, (e+1)*T); enough blocks for num_samples.
        self.num_epochs = (num_samples - 1) * seq_length // tokens_per_epoch + 1
        description = {"version": INDEX_VERSION, "class": "GPTSamples", **dataset.describe(),
                       "documents": [first, last], "seq_length": seq_length, "seed": seed,
                       "num_epochs": self.num_epochs}
        arrays = cache.arrays(name, description, ("document_order", "sample_starts", "sample_order"),
                              lambda: build_sample_index(lengths, seq_length, self.num_epochs, seed))
        self.document_order, self.sample_starts = arrays["document_order"], arrays["sample_starts"]
        self.sample_order = arrays["sample_order"]
        if len(self.sample_order) < num_samples:
            raise DataError(f"{where}: the index holds {len(self.sample_order)} samples, fewer than the "
                            f"{num_samples} asked for; delete {cache.folder} to rebuild it")
        logger.info("%s: %d tokens per epoch, %d samples of %d over %d epoch(s)", where, tokens_per_epoch,
                    num_samples, seq_length + 1, self.num_epochs)

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_target_tokens(self) -> int:
        """Every sample holds `seq_length` targets (samples run on into the next document and epoch)."""
        return self.num_samples * self.seq_length

    def tokens(self, index: int) -> np.ndarray:
        """The sample's `seq_length + 1` tokens, read across as many documents as it spans."""
        sample = int(self.sample_order[index])
        position, offset = (int(v) for v in self.sample_starts[sample])
        need, pieces = self.seq_length + 1, []
        while need > 0:
            doc = int(self.document_order[position])
            start = int(self.doc_starts[doc]) + offset
            piece = self.dataset.tokens[start:start + min(int(self.doc_lengths[doc]) - offset, need)]
            pieces.append(piece)
            need -= len(piece)
            position, offset = position + 1, 0
        return np.concatenate(pieces)

    def __getitem__(self, index: int) -> dict:
        window = torch.from_numpy(self.tokens(index).astype(np.int64))
        return {"input_ids": window[:-1], "shift_labels": window[1:]}


def _document_lengths(dataset: IndexedDataset, first: int, last: int) -> np.ndarray:
    """Tokens per document (a document may hold several sequences in Megatron's files)."""
    cumulative = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])
    bounds = dataset.document_indices[first:last + 1]
    return np.diff(cumulative[bounds]).astype(np.int64)


def build_sample_index(lengths: np.ndarray, seq_length: int, num_epochs: int, seed: int) -> dict[str, np.ndarray]:
    """document_order (position -> document), sample_starts ([n, 2]: position, offset), sample_order."""
    num_docs, tokens_per_epoch = len(lengths), int(lengths.sum())
    # The last sample of the last block reaches seq_length + 1 tokens past its start: add whole epochs for it.
    doc_epochs = num_epochs + -(-(seq_length + 1) // tokens_per_epoch)
    document_order = np.concatenate([np.random.default_rng([seed, epoch]).permutation(num_docs)
                                     for epoch in range(doc_epochs)]).astype(np.int32 if num_docs < 2**31 else np.int64)
    ends = np.cumsum(lengths[document_order], dtype=np.int64)  # stream offset after each position
    num_samples = -(-num_epochs * tokens_per_epoch // seq_length)
    starts = np.arange(num_samples, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, starts, side="right")  # first position whose end lies past the start
    offsets = starts - (ends[positions] - lengths[document_order[positions]])
    sample_starts = np.stack([positions, offsets], axis=1)
    blocks = [-(-epoch * tokens_per_epoch // seq_length) for epoch in range(num_epochs + 1)]
    sample_order = np.concatenate([lo + np.random.default_rng([seed, epoch, 1]).permutation(hi - lo)
                                   for epoch, (lo, hi) in enumerate(zip(blocks, blocks[1:]))]).astype(np.int64)
    return {"document_order": document_order, "sample_starts": sample_starts, "sample_order": sample_order}


class BlendedSamples(torch.utils.data.Dataset):
    """Samples drawn from several datasets in proportion to their weights, deterministically interleaved: dataset
    d's j-th sample gets the key (j + 0.5) / w_d and the blend is the first `num_samples` keys in order, which keeps
    Megatron's greedy "largest sampling error" property (within one sample of n * w_d) with one sort."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int, cache: IndexCache, name: str,
                 description: dict):
        self.datasets, self.num_samples = datasets, num_samples
        self.weights = normalized = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        arrays = cache.arrays(f"{name}-blend", {**description, "weights": normalized.tolist(),
                                                "num_samples": num_samples, "version": INDEX_VERSION},
                              ("dataset_index", "dataset_sample_index"),
                              lambda: build_blend_index(normalized, num_samples))
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        for d, dataset in enumerate(datasets):
            needed = int(self.dataset_sample_index[self.dataset_index == d].max(initial=-1)) + 1
            if needed > len(dataset):
                raise DataError(f"blend {name}: dataset {d} gives {len(dataset)} samples, the blend needs {needed}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        return self.datasets[int(self.dataset_index[index])][int(self.dataset_sample_index[index])]


def samples_per_dataset(weights: np.ndarray, num_samples: int) -> list[int]:
    """How many samples each blended dataset must be able to give (a bound on what the blend draws)."""
    return [int(np.ceil(num_samples * w + len(weights) / 2 + 1)) for w in weights]


def build_blend_index(weights: np.ndarray, num_samples: int) -> dict[str, np.ndarray]:
    counts = samples_per_dataset(weights, num_samples)
    keys = np.concatenate([(np.arange(n) + 0.5) / w for n, w in zip(counts, weights) if w > 0])
    owners = np.concatenate([np.full(n, d, dtype=np.int16) for d, (n, w) in enumerate(zip(counts, weights)) if w > 0])
    locals_ = np.concatenate([np.arange(n, dtype=np.int64) for n, w in zip(counts, weights) if w > 0])
    order = np.argsort(keys, kind="stable")[:num_samples]
    return {"dataset_index": owners[order], "dataset_sample_index": locals_[order]}
