"""Mixing named sources by token weight (`config.mixture`): which source, and which of its windows, every global sample
position reads, and the dataset that reads through that index.

The apportionment (Webster's, within one window of each share) and the per-source epochs: docs/data.md, 'Mixtures'.
Stages start at token boundaries counted as the batch ramp counts them (sequences x seq_length). The index depends
only on the config and the data, so a run resumes at the same sample on any number of ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from .readers import DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourcePlan:
    """What the run draws from one source."""
    name: str
    windows: int            # available (its train part)
    tokens: int             # its train part's target tokens
    weight: float           # over the run: drawn / all samples
    drawn: int              # windows the run reads
    max_epochs: float | None

    @property
    def epochs(self) -> float:
        return self.drawn / self.windows if self.windows else 0.0


def blend_index(stage_weights: list[tuple[int, np.ndarray]], num_samples: int) -> np.ndarray:
    """The source of each of `num_samples` sample positions; `stage_weights`: (first sample, weights) per stage."""
    out = np.empty(num_samples, dtype=np.int16)
    bounds = [start for start, _ in stage_weights] + [num_samples]
    for (start, weights), end in zip(stage_weights, bounds[1:]):
        start, end = min(start, num_samples), min(end, num_samples)
        if end > start:
            out[start:end] = _apportion(weights, end - start)
    return out


def _apportion(weights: np.ndarray, n: int) -> np.ndarray:
    """`n` source ids in order, each source's k-th at time (k + 1/2) / w (ties: the lower source id)."""
    live = [(source, weight, int(np.ceil(n * weight)) + 1) for source, weight in enumerate(weights) if weight > 0]
    times = np.concatenate([(np.arange(count) + 0.5) / weight for _, weight, count in live])
    ids = np.concatenate([np.full(count, source, dtype=np.int16) for source, _, count in live])
    order = np.lexsort((ids, times))[:n]
    return ids[order]


def draw_numbers(source_of: np.ndarray, num_sources: int) -> np.ndarray:
    """For each position, how many earlier positions read the same source (its draw number)."""
    draws = np.empty(len(source_of), dtype=np.int64)
    for source in range(num_sources):
        where = np.flatnonzero(source_of == source)
        draws[where] = np.arange(len(where))
    return draws


def source_permutation(seed: int, source: int, epoch: int, windows: int) -> np.ndarray:
    """The order in which `source` reads its windows in `epoch`."""
    return np.random.default_rng([seed, source, epoch]).permutation(windows)


class MixtureDataset(torch.utils.data.Dataset):
    """The run's train samples in blend order: position `i` reads draw `draw_of[i]` of source `source_of[i]`,
    window `perm(source, epoch)[draw % windows]`."""

    def __init__(self, names: list[str], sources: list, source_of: np.ndarray, seed: int):
        self.names, self.sources, self.source_of, self.seed = names, sources, source_of, seed
        self.draw_of = draw_numbers(source_of, len(sources))
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._targets = self._window_targets()
        self._counted = (0, np.zeros(len(names)))  # (position, target tokens per source before it)

    def __len__(self) -> int:
        return len(self.source_of)

    def permutation(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) >= 4 * len(self.sources):  # a batch spans at most two epochs of a source
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = source_permutation(self.seed, source, epoch, len(self.sources[source]))
        return self._perms[key]

    def window(self, index: int) -> tuple[int, int]:
        source, draw = int(self.source_of[index]), int(self.draw_of[index])
        epoch, offset = divmod(draw, len(self.sources[source]))
        return source, int(self.permutation(source, epoch)[offset])

    def __getitem__(self, index: int) -> dict:
        source, window = self.window(index)
        return {**self.sources[source][window], "source": source}

    def _window_targets(self) -> np.ndarray:
        """The targets each position trains: seq_length, less where it reads a source's short last window."""
        targets = np.empty(len(self.source_of), dtype=np.int64)
        for source, dataset in enumerate(self.sources):
            positions = np.flatnonzero(self.source_of == source)
            windows, full = len(dataset), dataset.seq_length
            last = dataset.num_target_tokens - (windows - 1) * full
            drawn = np.empty(len(positions), dtype=np.int64)
            for epoch in range(-(-len(positions) // windows)):
                part = slice(epoch * windows, min((epoch + 1) * windows, len(positions)))
                drawn[part] = source_permutation(self.seed, source, epoch, windows)[:part.stop - part.start]
            targets[positions] = np.where(drawn == windows - 1, last, full)
        return targets

    def trained_tokens(self, position: int) -> dict[str, int]:
        """Target tokens of each source in the first `position` samples (counted on from the last call, so a
        log costs the samples since the previous one, not the whole run so far)."""
        position = min(position, len(self.source_of))
        start, counts = self._counted
        if position < start:  # a resume to an earlier position: count again
            start, counts = 0, np.zeros(len(self.names))
        counts = counts + np.bincount(self.source_of[start:position], weights=self._targets[start:position],
                                      minlength=len(self.names))
        self._counted = (position, counts)
        return {name: int(count) for name, count in zip(self.names, counts)}


class InterleavedEval(torch.utils.data.Dataset):
    """Evaluation windows of several sources taken in turn, so the first batches cover every source."""

    def __init__(self, sources: list):
        self.order = [(s, offset) for offset in range(max(len(d) for d in sources))
                      for s, d in enumerate(sources) if offset < len(d)]
        self.sources = sources

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict:
        source, window = self.order[index]
        return self.sources[source][window]


def plan_sources(names: list[str], datasets: list, source_of: np.ndarray, max_epochs: list) -> list[SourcePlan]:
    """Per source: available windows and tokens, the share of the run, the windows drawn."""
    drawn = np.bincount(source_of, minlength=len(names))
    return [SourcePlan(name, len(d), d.num_target_tokens, int(n) / max(len(source_of), 1), int(n), limit)
            for name, d, n, limit in zip(names, datasets, drawn, max_epochs)]


def check_repeats(plans: list[SourcePlan]) -> None:
    """Refuse a source the run would repeat beyond its max_epochs."""
    for plan in plans:
        if plan.max_epochs is not None and plan.epochs > plan.max_epochs:
            raise DataError(f"train_data source {plan.name}: the run would read it {plan.epochs:.2f} times "
                            f"({plan.drawn:,} of its {plan.windows:,} windows drawn), more than its max_epochs "
                            f"{plan.max_epochs:g}; lower its weight, add data to it, train fewer steps or raise "
                            "max_epochs")


def describe_plan(plans: list[SourcePlan], seq_length: int) -> str:
    lines = [f"{'source':<16}{'tokens available':>18}{'share':>8}{'tokens to draw':>16}{'epochs':>8}"]
    for p in plans:
        lines.append(f"{p.name:<16}{p.tokens:>18,}{p.weight:>8.1%}{p.drawn * seq_length:>16,}{p.epochs:>8.2f}")
    return "\n".join(lines)
