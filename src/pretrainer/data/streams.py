"""Streams of micro-batches: this rank's slice of a global sample order, and a user's DataLoader.

Packed samples (`SampleStream`, `EvalBatches`) follow one global sample order shared by all ranks. Training draws from
one endless sequence of sample positions: position `p` is window `perm_e[p % N]` of epoch `e = p // N`, with `perm_e` a
permutation seeded by (seed, e). Micro-step `k` takes positions `[k*G, (k+1)*G)` with `G = micro_batch_size * dp`, and
rank `r` takes its `micro_batch_size` positions from that range. The only state is the number of positions consumed, so
a run resumes at exactly the next sample on any dp size, and a dp=2 run sees the same global batches as a single process
with twice the micro-batch.

A user's DataLoader goes through `BatchStream`, which runs as many epochs as the run needs and counts its exact position
(epoch, micro-batches consumed in that epoch) on the consumer side, so a checkpoint restores the position even when
DataLoader workers prefetch ahead.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import numpy as np
import torch

from .packing import DocumentMasking, collate_packed
from .readers import DataError

logger = logging.getLogger(__name__)


class _PositionBatches:
    """Batch sampler: index lists for one rank, from a global position onward, forever."""

    def __init__(self, num_samples: int, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 start: int, shuffle: bool = True):
        self.num_samples, self.mbs, self.rank, self.world = num_samples, micro_batch_size, rank, world_size
        self.seed, self.start, self.shuffle = seed, start, shuffle
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs
                del self._perms[min(self._perms)]
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._perms[epoch]

    def indices(self, position: int) -> list[int]:
        first = position + self.rank * self.mbs
        places = [divmod(p, self.num_samples) for p in range(first, first + self.mbs)]
        return [int(self.permutation(epoch)[offset]) if self.shuffle else offset for epoch, offset in places]

    def __iter__(self):
        position = self.start
        while True:
            yield self.indices(position)
            position += self.mbs * self.world


class SampleStream:
    """This rank's micro-batches of a packed dataset, prefetched by DataLoader workers, resumable exactly.
    `shuffle=False` takes the dataset's own order (prepared data whose sample index is already shuffled)."""

    def __init__(self, dataset, micro_batch_size: int, pad_token_id: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, num_workers: int = 0, shuffle: bool = True, masking: DocumentMasking | None = None):
        self.dataset = dataset
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.seed, self.num_workers, self.shuffle = seed, num_workers, shuffle
        self.collate = functools.partial(collate_packed, pad_token_id=pad_token_id, masking=masking)
        self.position = 0  # global samples consumed (all ranks)
        self._iterator = None

    @property
    def epoch(self) -> int:
        return self.position // len(self.dataset)

    def state_dict(self) -> dict:
        return {"samples": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["samples"])
        self._iterator = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._iterator is None:
            sampler = _PositionBatches(len(self.dataset), self.micro_batch_size, self.rank, self.world_size,
                                       self.seed, self.position, self.shuffle)
            loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, collate_fn=self.collate,
                                                 num_workers=self.num_workers)
            self._iterator = iter(loader)
        batch = next(self._iterator)
        self.position += self.micro_batch_size * self.world_size
        return batch


class EvalBatches:
    """The global eval batches in order (the validator takes the first `eval_iters`), sliced per rank. Every rank
    yields the same number of batches (sharded engines run collectives in forward); a rank whose slice runs past the
    end gets a stand-in window with every target ignored."""

    def __init__(self, dataset, micro_batch_size: int, pad_token_id: int, *, rank: int = 0, world_size: int = 1,
                 masking: DocumentMasking | None = None):
        self.dataset = dataset
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.collate = functools.partial(collate_packed, pad_token_id=pad_token_id, masking=masking)

    def __iter__(self):
        n, global_batch = len(self.dataset), self.micro_batch_size * self.world_size
        for start in range(0, n, global_batch):
            first = start + self.rank * self.micro_batch_size
            samples = [self.dataset[i] for i in range(first, min(first + self.micro_batch_size, n))]
            if not samples:
                stand_in = self.dataset[0]
                samples = [{"input_ids": stand_in["input_ids"],
                            "shift_labels": torch.full_like(stand_in["shift_labels"], -100)}]
            yield self.collate(samples)


class BatchStream:
    """Endless iterator of micro-batches over a DataLoader, epoch after epoch, with a resumable position. Each
    epoch's order is reseeded from (seed, epoch) when the loader shuffles with a RandomSampler, so epoch k is the
    same permutation whether the run started at epoch 0 or resumed mid-way."""

    def __init__(self, loader: torch.utils.data.DataLoader, seed: int):
        self.loader = loader
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # micro-batches handed out in the current epoch
        self._iterator = None
        sampler = getattr(loader, "sampler", None)
        # Reseed only a RandomSampler the user left unseeded; a user's own generator is theirs to manage.
        self._reseed = isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None
        with contextlib.suppress(TypeError):  # a loader over an iterable dataset may have no length
            if len(loader) == 0:
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
