"""The one entry point from config to batches: this rank's train stream and eval batches.

Four sources, one result: files named by `train_data` (tokenized and packed), prepared `.bin/.idx`
prefixes (`megatron_dataset_flag: true`), datasets from the seed's datasets-provider hook, or a user's
own DataLoaders. The loop only consumes what `assemble_data` returns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from ..config import ConfigError
from .builders import BuiltData, build_datasets, build_indexed_datasets, build_mixture
from .mixture import MixtureDataset
from .packing import DocumentMasking
from .provided import provided_datasets
from .streams import BatchStream, EvalBatches, SampleStream

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataPlacement:
    """Where this process reads: its replica among the data-parallel ones, and who builds shared caches."""

    rank: int                  # this replica's index (which part of each global batch it reads)
    replicas: int              # data-parallel replicas
    is_main: bool              # builds shared caches while the other ranks wait
    barrier: Callable[[], None]
    gather: Callable[[object], list] = lambda value: [value]  # every rank's value, on every rank
    local_rank: int = 0        # this process's index on its machine (builds node-local caches)
    eval_replicas: int = 0     # replicas that share the eval batches, where fewer than `replicas` (replica groups)


@dataclass
class RunData:
    train: Iterator[dict]         # endless, resumable (state_dict/load_state_dict), with an `epoch`
    eval: Iterable[dict] | None   # re-iterable eval micro-batches, or None
    mixture: MixtureDataset | None = None  # named sources: which source each train sample position reads
    eval_sources: dict = field(default_factory=dict)  # named sources: each one's eval micro-batches


def assemble_data(args, sizes, tokenizer, placement: DataPlacement, *, datasets_provider=None,
                  train_dataloader=None, eval_dataloader=None) -> RunData:
    """This rank's train stream and eval batches for a run of these `sizes`."""
    if train_dataloader is not None:
        if placement.replicas > 1:
            logger.info("a user DataLoader is iterated as given on each rank: give each rank its own part "
                        "(e.g. a DistributedSampler)")
        return RunData(BatchStream(train_dataloader, args.seed), eval_dataloader)
    built = _build_datasets(args, sizes, tokenizer, placement, datasets_provider)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    masking = None
    if args.reset_position_ids or args.reset_attention_mask:
        masking = DocumentMasking(tokenizer.eos_token_id, attention=args.reset_attention_mask)
        logger.info("document masking: positions restart after each EOS%s", "; attention stays within each "
                    "document" if args.reset_attention_mask else "")
    shard = {"rank": placement.rank, "world_size": placement.replicas, "masking": masking}
    # every replica group evaluates the same held-out batches (its own data-parallel share of them)
    eval_shard = {**shard, "rank": placement.rank % placement.eval_replicas, "world_size": placement.eval_replicas} \
        if placement.eval_replicas else shard
    train = SampleStream(built.train, sizes.micro_batch_size, pad_id, seed=args.seed, num_workers=args.num_workers,
                         shuffle=not built.shuffled, **shard)
    if eval_dataloader is None and built.eval is not None:
        eval_dataloader = EvalBatches(built.eval, sizes.micro_batch_size, pad_id, **eval_shard)
    sources = {name: EvalBatches(data, sizes.micro_batch_size, pad_id, **eval_shard)
               for name, data in built.eval_sources.items()}
    return RunData(train, eval_dataloader, built.mixture, sources)


def _build_datasets(args, sizes, tokenizer, placement: DataPlacement, datasets_provider) -> BuiltData:
    if args.megatron_dataset_flag and datasets_provider is not None:
        return provided_datasets(datasets_provider, sizes)
    if args.megatron_dataset_flag:
        return build_indexed_datasets(args, sizes, placement.is_main, placement.barrier, tokenizer)
    if not args.resolved_train_data:
        raise ConfigError("no training data: set `train_data` (files, globs or folders of json/jsonl/csv/txt/parquet), "
                          "or data_path with megatron_dataset_flag: true for prepared .bin/.idx data, or pass "
                          "train_dataloader=")
    if args.dataloader_config:
        logger.info("dataloader_config is for user DataLoaders (get_dataloader_config()); the built-in pipeline "
                    "packs sequences without padding and does not use it")
    if args.mixture is not None:
        return build_mixture(args, tokenizer, sizes, placement)
    return build_datasets(args, tokenizer, sizes.seq_length, placement)
