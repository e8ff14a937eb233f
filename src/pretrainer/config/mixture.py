"""A training mixture, read once from the config: named sources weighted in tokens (`train_data` as a list of
`{name, path, weight[, max_epochs]}`), and weights that change at token boundaries (`mixture_schedule`).

The keys and how a stage's weights apply: docs/data.md, 'Mixtures'. The blend itself is data/mixture.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import key_error

SOURCE_KEYS = ("name", "path", "weight", "max_epochs", "eval_path")


@dataclass(frozen=True)
class Source:
    name: str
    paths: tuple[str, ...]           # files, globs or folders, as `train_data` takes them
    weight: float                    # before normalisation
    max_epochs: float | None = None  # refuse a plan that repeats this source more often
    eval_paths: tuple[str, ...] = ()  # its own held-out files (instead of its eval_split)


@dataclass(frozen=True)
class MixtureStage:
    until_tokens: float | None       # the stage ends when this many tokens have been trained (None: at the end)
    weights: tuple[float, ...]       # per source, in the sources' order, normalised to sum 1


@dataclass(frozen=True)
class Mixture:
    sources: tuple[Source, ...]
    stages: tuple[MixtureStage, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(source.name for source in self.sources)

    def describe(self) -> str:
        return "; ".join(
            (f"until {_tokens(stage.until_tokens)} tokens: " if stage.until_tokens is not None else "")
            + ", ".join(f"{n} {w:.3g}" for n, w in zip(self.names, stage.weights)) for stage in self.stages)


def _tokens(count: float) -> str:
    """A token count as people read it: 8,000,000,000, or 1e+300 where digits would fill the line."""
    return f"{count:,.0f}" if count < 1e15 else f"{count:.3g}"


def is_mixture(train_data) -> bool:
    return isinstance(train_data, list) and any(isinstance(item, dict) for item in train_data)


def read_mixture(train_data, schedule, key: str = "train_data") -> Mixture | None:
    """The mixture `train_data` (or, `key` data_path, prepared prefixes) and `mixture_schedule` describe; None
    for plain files (one source)."""
    if not is_mixture(train_data):
        if schedule is not None:
            raise key_error("mixture_schedule", "mixture_schedule needs named sources: give train_data (or, "
                            "prepared, data_path) as a list of {name, path, weight}")
        return None
    sources = tuple(_source(index, item, key) for index, item in enumerate(train_data))
    names = [s.name for s in sources]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise key_error("train_data", f"source name(s) {', '.join(duplicates)} appear more than once; give each "
                        "source its own name")
    if schedule is None:
        return Mixture(sources, (MixtureStage(None, _normalised({s.name: s.weight for s in sources}, names,
                                                                key, key)),))
    weighted = [item["name"] for item in train_data if "weight" in item]
    if weighted:  # a key that would be ignored
        raise key_error("train_data", f"source(s) {', '.join(weighted)} give a weight, but mixture_schedule's "
                        "stages set the weights; remove weight from the sources or drop mixture_schedule")
    return Mixture(sources, _stages(schedule, names))


def _source(index: int, item, key: str) -> Source:
    where = f"{key}[{index}]"
    if not isinstance(item, dict):
        raise key_error(key, f"{where} is {item!r}: in a mixture every source is a mapping "
                        "{name: web, path: data/web.jsonl, weight: 0.6}")
    unknown = sorted(set(item) - set(SOURCE_KEYS))
    if unknown:
        raise key_error(key, f"{where} has unknown key(s) {', '.join(unknown)}; a source takes "
                        f"{', '.join(SOURCE_KEYS)}")
    name, path, weight = item.get("name"), item.get("path"), item.get("weight", 1.0)
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise key_error(key, f"{where}: name {name!r} must be a non-empty string without '/' (it names "
                        "the source in metrics such as source_tokens/<name>)")
    paths = [path] if isinstance(path, str) else path
    if not (isinstance(paths, list) and paths and all(isinstance(p, str) and p.strip() for p in paths)):
        raise key_error(key, f"{where} ({name}): path must be a file, glob or folder, or a list of them; "
                        f"got {path!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
        raise key_error(key, f"{where} ({name}): weight must be a number >= 0, got {weight!r}")
    max_epochs = item.get("max_epochs")
    if max_epochs is not None and (isinstance(max_epochs, bool) or not isinstance(max_epochs, (int, float))
                                   or max_epochs <= 0):
        raise key_error(key, f"{where} ({name}): max_epochs must be a number > 0, got {max_epochs!r}")
    eval_paths = item.get("eval_path", ())
    eval_paths = [eval_paths] if isinstance(eval_paths, str) else eval_paths
    if not (isinstance(eval_paths, (list, tuple)) and all(isinstance(p, str) and p.strip() for p in eval_paths)):
        raise key_error(key, f"{where} ({name}): eval_path must be a file, glob or folder, or a list of them; got "
                        f"{item.get('eval_path')!r}")
    return Source(name, tuple(paths), float(weight), float(max_epochs) if max_epochs is not None else None,
                  tuple(eval_paths))


def _stages(schedule, names: list[str]) -> tuple[MixtureStage, ...]:
    if not (isinstance(schedule, list) and schedule and all(isinstance(s, dict) for s in schedule)):
        raise key_error("mixture_schedule", "mixture_schedule is a list of {until_tokens: N, weights: {name: w}}, "
                        f"the last without until_tokens; got {schedule!r}")
    stages, previous = [], 0.0
    for index, stage in enumerate(schedule):
        where = f"mixture_schedule[{index}]"
        unknown = sorted(set(stage) - {"until_tokens", "weights"})
        if unknown:
            raise key_error("mixture_schedule", f"{where} has unknown key(s) {', '.join(unknown)}; a stage takes "
                            "until_tokens and weights")
        until = stage.get("until_tokens")
        last = index == len(schedule) - 1
        if last and until is not None:
            raise key_error("mixture_schedule", f"{where}: the last stage runs to the end; remove its until_tokens")
        if not last and (isinstance(until, bool) or not isinstance(until, (int, float)) or until <= previous):
            raise key_error("mixture_schedule", f"{where}: until_tokens must increase from stage to stage "
                            f"(after {previous:g}), got {until!r}")
        weights = stage.get("weights")
        if not isinstance(weights, dict) or not weights:
            raise key_error("mixture_schedule", f"{where}: weights is a mapping {{source name: weight}}, got "
                            f"{weights!r}")
        stages.append(MixtureStage(float(until) if until is not None else None,
                                   _normalised(weights, names, where, "mixture_schedule")))
        previous = float(until) if until is not None else previous
    return tuple(stages)


def _normalised(weights: dict, names: list[str], where: str, key: str) -> tuple[float, ...]:
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise key_error(key, f"{where} names unknown source(s) {', '.join(map(str, unknown))}; the sources are "
                        f"{', '.join(names)}")
    values = [weights.get(name, 0.0) for name in names]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in values) or sum(values) <= 0:
        raise key_error(key, f"{where}: weights must be numbers >= 0 with a positive sum, got "
                        f"{dict(zip(names, values))}")
    if not math.isfinite(float(sum(values))):  # weights near the float limit: scaled to at most 1 first
        values = [v / max(values) for v in values]
    total = float(sum(values))
    return tuple(v / total for v in values)
