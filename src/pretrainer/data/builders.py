"""Dataset builders: packed windows from text files, GPT samples from prepared `.bin/.idx` prefixes.

Each builder returns the train and eval datasets (samples of `seq_length + 1` tokens); `assemble` turns
them into this rank's streams of micro-batches.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .cache_roots import default_cache_root
from .mixture import InterleavedEval, MixtureDataset, blend_index, check_repeats, describe_plan, plan_sources
from .packing import PackedDataset
from .readers import DataError, expand_paths
from .remote import with_local_prefixes
from .token_store import cached_store, open_store, store_spec

logger = logging.getLogger(__name__)


@dataclass
class BuiltData:
    train: torch.utils.data.Dataset
    eval: torch.utils.data.Dataset | None
    shuffled: bool = False  # the samples are already in a seeded random order (prepared data, a mixture)
    mixture: MixtureDataset | None = None  # named sources: the train samples' blend, for the accounting
    eval_sources: dict = field(default_factory=dict)  # named sources: each one's held-out windows


def _stores(args, tokenizer, placement, build: bool = True):
    """`store(what, patterns)`: the cached token store of some files (tokenized on first use; with `build`
    False, None where it is not built yet), and the files."""
    root = Path(args.data_cache_path) / "tokenized" if args.data_cache_path else default_cache_root()
    workers = args.tokenize_workers or os.cpu_count() or 1

    def store(what: str, patterns: list[str]):
        files = expand_paths(patterns, what)
        spec = store_spec(files, tokenizer, args.text_key, args.txt_mode, args.on_error)
        if not build:
            return cached_store(spec, root), files
        return open_store(spec, root, what, tokenizer, placement, workers), files

    return store


def build_datasets(args, tokenizer, seq_length: int, placement) -> BuiltData:
    """Packed windows from the configured files, through their cached token stores (tokenized on first use);
    an eval split of whole documents is held out when no eval files are given."""
    store = _stores(args, tokenizer, placement)
    train_store, train_files = store("train_data", args.resolved_train_data)
    if train_store.num_documents == 0:
        raise DataError(f"train_data: {', '.join(map(str, train_files))} holds no documents")
    train_ids = np.arange(train_store.num_documents)
    eval_store, eval_ids = None, np.zeros(0, dtype=np.int64)
    if args.resolved_eval_data:
        eval_store, _ = store("eval_data", args.resolved_eval_data)
        eval_ids = np.arange(eval_store.num_documents)
    elif args.eval_split:
        eval_store = train_store
        train_ids, eval_ids = split_indices(train_store.num_documents, args.eval_split, args.seed)
    empty = int(np.count_nonzero(train_store.sequence_lengths[train_ids] == 0))
    if empty:
        logger.warning("skipped %d empty document(s) in the training data", empty)
    train = _windows(train_store, train_ids, seq_length)
    if len(train) == 0:
        raise DataError("the training data tokenizes to fewer than 2 tokens; nothing to train on")
    evaluation = None
    if len(eval_ids):
        evaluation = _windows(eval_store, eval_ids, seq_length)
        evaluation = evaluation if len(evaluation) else None
    logger.info("data: %d train documents -> %d tokens in %d windows of %d; %d eval documents -> %s",
                len(train_ids), train.num_tokens, len(train), seq_length, len(eval_ids),
                f"{len(evaluation)} windows" if evaluation else "no eval windows")
    return BuiltData(train, evaluation)


def build_mixture(args, tokenizer, sizes, placement) -> BuiltData:
    """Named sources blended by token weight (data/mixture.py): each source tokenized into its own store and
    packed on its own, its eval split held out per source; the plan of draws is logged and checked."""
    store = _stores(args, tokenizer, placement)
    trains, evals = _source_windows(args, sizes.seq_length, store)
    evaluation = InterleavedEval(list(evals.values())) if evals else None
    if args.resolved_eval_data:
        eval_store, _ = store("eval_data", args.resolved_eval_data)
        evals, evaluation = {}, _windows(eval_store, np.arange(eval_store.num_documents), sizes.seq_length)
    return _blended(args, sizes, trains, evaluation, evals)


def _source_windows(args, seq_length: int, store) -> tuple[list, dict]:
    """Each raw source's train windows (in the sources' order) and its held-out windows by name; a source whose
    store `store` does not have is None."""
    trains, evals = [], {}
    for source in args.mixture.sources:
        source_store, files = store(f"train_data source {source.name}", list(source.paths))
        if source_store is None:
            trains.append(None)
            continue
        train_ids, eval_ids = np.arange(source_store.num_documents), np.zeros(0, dtype=np.int64)
        if args.eval_split and not args.resolved_eval_data and not source.eval_paths:
            train_ids, eval_ids = split_indices(source_store.num_documents, args.eval_split, args.seed)
        train = _windows(source_store, train_ids, seq_length)
        if len(train) == 0:
            raise DataError(f"train_data source {source.name}: {', '.join(map(str, files))} holds no tokens to "
                            "train on")
        trains.append(train)
        held_store = source_store
        if source.eval_paths and not args.resolved_eval_data:  # its own held-out files
            held_store, _ = store(f"eval_path of source {source.name}", list(source.eval_paths))
            eval_ids = np.arange(held_store.num_documents) if held_store is not None else eval_ids
        if len(eval_ids):
            held = _windows(held_store, eval_ids, seq_length)
            if len(held):
                evals[source.name] = held
    return trains, evals


def mixture_plan(args, tokenizer, sizes) -> str | None:
    """The plan of draws `train` will print, for `pretrainer plan`, where the sources are tokenized already
    (nothing is tokenized here); a line naming those that are not; None without a mixture."""
    mixture = args.mixture
    if mixture is None:
        return None
    if args.megatron_dataset_flag:
        args = with_local_prefixes(args)
        mixture = args.mixture
        trains = [_prepared_windows(args, source, sizes.seq_length, tokenizer) for source in mixture.sources]
    else:
        trains, _ = _source_windows(args, sizes.seq_length, _stores(args, tokenizer, None, build=False))
    missing = [source.name for source, train in zip(mixture.sources, trains) if train is None]
    if missing:
        return (f"not tokenized yet: {', '.join(missing)} (train tokenizes them into the cache and prints the plan "
                "of draws first)")
    plans = plan_sources(list(mixture.names), trains, _blend_index(mixture, sizes),
                         [s.max_epochs for s in mixture.sources])
    over = [p.name for p in plans if p.max_epochs is not None and p.epochs > p.max_epochs]
    note = f"\nrepeated past max_epochs (train refuses it): {', '.join(over)}" if over else ""
    return describe_plan(plans, sizes.seq_length) + note


def _blended(args, sizes, trains: list, evaluation, evals: dict) -> BuiltData:
    """The mixture's train samples over `trains` (the sources' windows, in their order); logs and checks the plan."""
    mixture, seq_length = args.mixture, sizes.seq_length
    source_of = _blend_index(mixture, sizes)
    plans = plan_sources(list(mixture.names), trains, source_of, [s.max_epochs for s in mixture.sources])
    logger.info("train data: a mixture of %d sources (%s)\n%s", len(trains), mixture.describe(),
                describe_plan(plans, seq_length))
    check_repeats(plans)
    blend = MixtureDataset(list(mixture.names), trains, source_of, args.seed)
    return BuiltData(blend, evaluation if evaluation is None or len(evaluation) else None, shuffled=True,
                     mixture=blend, eval_sources=evals)


@dataclass(frozen=True)
class _Counted:
    """A prepared source's train part as the plan counts it: its windows (one epoch of GPT samples)."""
    windows: int
    seq_length: int

    def __len__(self) -> int:
        return self.windows

    @property
    def num_target_tokens(self) -> int:
        return self.windows * self.seq_length


def _prepared_windows(args, source, seq_length: int, tokenizer=None, dataset=None) -> _Counted:
    """One epoch of GPT samples of a prepared source's train part, counted without building its index."""
    from .token_formats import open_prepared

    dataset = dataset if dataset is not None else open_prepared(source.paths[0], tokenizer)
    tokens = _split_tokens(dataset, split_ranges(args.data_split, dataset.num_documents)[0])
    return _Counted(max(1, (tokens - 1) // seq_length), seq_length)


def _blend_index(mixture, sizes) -> np.ndarray:
    """The source of each train sample position; stages start at tokens counted as samples x seq_length."""
    starts = [0] + [-(-int(stage.until_tokens) // sizes.seq_length) for stage in mixture.stages[:-1]]
    return blend_index([(start, np.asarray(stage.weights)) for start, stage in zip(starts, mixture.stages)],
                       sizes.train_samples)


def build_prepared_mixture(args, sizes, cache, tokenizer=None) -> BuiltData:
    """Named sources from prepared `.bin/.idx` prefixes (`data_path` as a list of {name, path, weight}): each
    prefix's train part (Megatron's `split`) gives one epoch of GPT samples, blended as raw sources are."""
    from .gpt_samples import GPTSamples
    from .token_formats import open_prepared

    trains, evals = [], {}
    for source in args.mixture.sources:
        if len(source.paths) != 1:
            raise DataError(f"data_path source {source.name}: give one prepared prefix, got {list(source.paths)}")
        dataset = open_prepared(source.paths[0], tokenizer)
        train_range, valid_range, _ = split_ranges(args.data_split, dataset.num_documents)
        if _split_tokens(dataset, train_range) < 2:
            raise DataError(f"data_path source {source.name}: split {args.data_split!r} leaves it no training "
                            "tokens; give the first (train) part a non-zero share")
        epoch = _prepared_windows(args, source, sizes.seq_length, dataset=dataset).windows
        trains.append(GPTSamples(dataset, train_range, sizes.seq_length, epoch, args.seed, cache,
                                 f"train-{source.name}"))
        if _split_tokens(dataset, valid_range) > sizes.seq_length:
            evals[source.name] = GPTSamples(dataset, valid_range, sizes.seq_length, sizes.eval_samples, args.seed,
                                            cache, f"valid-{source.name}")
    return _blended(args, sizes, trains, InterleavedEval(list(evals.values())) if evals else None, evals)


def _windows(store, ids: np.ndarray, seq_length: int) -> PackedDataset:
    """Packed windows over documents `ids` of an indexed store (one sequence per document)."""
    itemsize = np.dtype(store.dtype).itemsize
    return PackedDataset(store.tokens, seq_length, (store.sequence_pointers[ids] // itemsize,
                                                    store.sequence_lengths[ids]))


def build_indexed_datasets(args, sizes, is_main: bool = True, barrier=lambda: None, tokenizer=None) -> BuiltData:
    """GPT-style train/valid samples from prepared `.bin/.idx` prefixes (docs/data.md, 'Prepared data'); the main
    rank builds the index caches while the others wait at `barrier`. `tokenizer` checks the ids of corpora
    tokenized elsewhere (token_formats.py)."""
    from .gpt_samples import BlendedSamples, GPTSamples, IndexCache, samples_per_dataset
    from .token_formats import open_prepared

    args = with_local_prefixes(args)  # prefixes in object storage: copied to local disk on first use
    if args.mixture is not None:  # named prefixes: the cache goes next to the first
        prefixes, weights = [source.paths[0] for source in args.mixture.sources], None
    else:
        raw = args.data_path if args.data_path is not None else args.get_dataloader_config().get("data_path")
        prefixes, weights = parse_data_path(raw)
    split = args.data_split
    seq_length = sizes.seq_length
    cache_folder = Path(args.data_cache_path) if args.data_cache_path else _writable(
        Path(prefixes[0]).resolve().parent / "cache" / "pretrainer_indices", args)
    cache = IndexCache(cache_folder, build_on_this_rank=is_main, barrier=barrier)
    if args.mixture is not None:
        return build_prepared_mixture(args, sizes, cache, tokenizer)
    datasets = [open_prepared(p, tokenizer) for p in prefixes]
    ranges = [split_ranges(split, d.num_documents) for d in datasets]

    def build(part: int, name: str, num_samples: int):
        # the prefixes that have documents in this part (and, in a weighted blend, a weight above 0)
        usable = [i for i, r in enumerate(ranges) if r[part][1] > r[part][0] and (not weights or weights[i] > 0)]
        if not usable:
            return None
        if len(prefixes) == 1:
            return GPTSamples(datasets[0], ranges[0][part], seq_length, num_samples, args.seed, cache, name)
        blend_weights = [weights[i] if weights else _split_tokens(datasets[i], ranges[i][part]) for i in usable]
        norm = np.asarray(blend_weights, dtype=np.float64) / float(np.sum(blend_weights))
        parts = [GPTSamples(datasets[i], ranges[i][part], seq_length, n, args.seed, cache, name)
                 for i, n in zip(usable, samples_per_dataset(norm, num_samples))]
        description = {"prefixes": [str(Path(prefixes[i]).resolve()) for i in usable], "split": split,
                       "part": name, "seq_length": seq_length, "seed": args.seed}
        return BlendedSamples(parts, blend_weights, num_samples, cache, name, description)

    for i, r in enumerate(ranges):
        if r[0][1] <= r[0][0]:
            raise DataError(f"data_path {prefixes[i]}: split {split!r} leaves no training documents out of "
                            f"{datasets[i].num_documents}; give the first (train) part a non-zero share")
    train = build(0, "train", sizes.train_samples)
    evaluation = build(1, "valid", sizes.eval_samples)
    logger.info("data: %s, split %s -> %d train samples of %d tokens, %s", " + ".join(prefixes), split,
                len(train), seq_length + 1, f"{len(evaluation)} eval samples" if evaluation else "no eval split")
    return BuiltData(train, evaluation, shuffled=True)


def parse_data_path(raw) -> tuple[list[str], list[float] | None]:
    """One prefix, a list of prefixes, or Megatron's weighted form `w1 p1 w2 p2 ...` (string or list)."""
    if raw is None:
        raise DataError("megatron_dataset_flag is true but no data_path (or dataloader_config.data_path) names a "
                        ".bin/.idx prefix (written by `pretrainer prepare`)")
    items = raw.split() if isinstance(raw, str) else [str(x) for x in raw]
    if not items:
        raise DataError("data_path is empty: give a prefix, or `weight prefix weight prefix ...`")
    numeric = [_is_number(x) for x in items]
    if not any(numeric):
        return items, None
    if len(items) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise DataError(f"data_path {items}: a weighted list alternates weight and prefix (`0.7 web 0.3 code`); "
                        f"got {len(items)} item(s) in another shape")
    weights = [float(w) for w in items[0::2]]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"data_path {items}: weights must be non-negative with a positive sum")
    return items[1::2], weights


def _split_tokens(dataset, document_range: tuple[int, int]) -> int:
    start, end = dataset.document_token_range(*document_range)
    return end - start


def _writable(folder: Path, args) -> Path:
    """The cache folder next to the data, or under save_dir when the data's folder is read-only."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if os.access(probe, os.W_OK):
        return folder
    fallback = (args.run_dir or Path(".")) / "data_cache"
    logger.info("%s is not writable; sample indices are cached in %s (set data_cache_path to choose)", folder,
                fallback)
    return fallback


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Megatron's split string ("969,30,1", "100,0,0") as contiguous [begin, end) document ranges."""
    parts = [float(x) for x in re.findall(r"[0-9]*\.?[0-9]+", split)]
    if not 1 <= len(parts) <= 3 or sum(parts) <= 0:
        raise DataError(f"split {split!r}: give up to three non-negative weights for train,valid,test, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    bounds = list(itertools.accumulate((part / sum(parts) for part in parts), initial=0.0))
    return [(int(round(lo * num_documents)), int(round(hi * num_documents))) for lo, hi in zip(bounds, bounds[1:])]


def _is_number(text) -> bool:
    try:
        float(text)
        return True
    except (TypeError, ValueError):
        return False


def split_indices(count: int, eval_split: float | int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out a seeded random set of documents: a fraction (< 1) or a count; always leaves >= 1 for
    training. Returns the train and eval document indices, each in order."""
    if count < 2:
        logger.warning("only %d document: no eval split is taken from the training data", count)
        return np.arange(count), np.zeros(0, dtype=np.int64)
    held = int(eval_split) if isinstance(eval_split, int) else max(1, int(round(eval_split * count)))
    held = min(held, count - 1)
    held_out = np.zeros(count, dtype=bool)
    held_out[np.random.default_rng(seed).permutation(count)[:held]] = True
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)
