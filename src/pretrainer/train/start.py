"""What a run checks and says as it starts: the constructor's inputs, the memory each rank took to get its model
ready, the start row of metrics.jsonl, and the banner (the HF Trainer's lines, which the seeds' users read, with
the run's own)."""

from __future__ import annotations

import faulthandler
import logging
import resource
import time

import torch

from ..config import ConfigError, check_writable_folder
from ..perf.peak import processor_name
from ..run.callbacks import Callback
from .trackers import requested as requested_trackers

logger = logging.getLogger("pretrainer")


def model_ready_row(engine, stats) -> dict:
    """Each rank's peak RSS once the engine is set up (before the first step) and, when the checkpoint was read in
    slices (`stats`), what that took (logged per rank); the start row's fields."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ranks = engine.all_gather_object((peak, stats.bytes_read, stats.seconds, stats.peak_rss_bytes) if stats
                                     else (peak, 0, 0.0, 0))
    row = {"model_ready_peak_rss_mb": max(r[0] for r in ranks) / 2**20}
    if stats is None:
        return row
    logger.info("weights read: %s", "; ".join(
        f"rank {rank} {read / 2**20:,.0f} MB in {seconds:.1f} s, peak RSS {loaded / 2**20:,.0f} MB"
        for rank, (_, read, seconds, loaded) in enumerate(ranks)))
    if stats.unused:
        logger.warning("%d tensor(s) in the checkpoint belong to no parameter and were not read: %s",
                       len(stats.unused), ", ".join(stats.unused[:5]) + (" ..." if len(stats.unused) > 5 else ""))
    return {**row, "weights_read_bytes": [r[1] for r in ranks],
            "weights_loaded_peak_rss_mb": max(r[3] for r in ranks) / 2**20}


def start_row(trainer, meter, resumed: bool) -> dict:
    """The first row a run (or a resumed run) writes: what runs, where, and what it was measured against."""
    args, engine, facts = trainer.pretrain_args, trainer.engine, trainer.facts
    row = {"event": "resume" if resumed else "start", "step": trainer.train_state.step,
           "config_hash": args.config_hash(), "engine": engine.name, "world_size": engine.world_size,
           "device": str(engine.device), "dtype": trainer.resolved.dtype,
           "hardware": f"{processor_name(engine.device)}, {torch.get_num_threads()} thread(s) per process",
           "parameters": facts.parameters, "vocab_size": facts.vocab_rows, "loss_chunk_size": facts.loss_chunk_size,
           "flops_per_token": facts.flops.per_token}
    for callback in trainer.callbacks:
        row.update(callback.start_row())
    if trainer.branch is not None:  # a cooldown branch: its lineage, for the reports
        row["branch_of"] = trainer.branch.lineage
    row["peak"] = meter.peak.describe()
    if trainer.predicted_memory is not None:
        row.update(trainer.predicted_memory.row())
    if trainer.host_heap is not None:  # what the CPU heap does with freed blocks (host_malloc_reuse)
        row["host_heap"] = trainer.host_heap
    return {**row, **trainer.model_memory}


def check_stage_inputs(args, train_dataloader, eval_dataloader) -> None:
    """Sequence-length stages cut the run's own packed windows: batches that keep their own length are refused."""
    given = [what for what, value in (("a train_dataloader", train_dataloader), ("an eval_dataloader", eval_dataloader),
                                      ("custom_get_batch_function", (args.plugin_args or {}).get(
                                          "custom_get_batch_function"))) if value is not None]
    if given:
        raise ConfigError(f"key 'seq_length_schedule': {given[0]} was given, whose batches keep their own length; "
                          "the stages cut the run's own packed windows (train_data or data_path), so remove it or "
                          "remove seq_length_schedule")


def args_sets_sequences(sizes) -> bool:
    return any(stage.sequences is not None for stage in sizes.stages.stages)


def print_banner(trainer, meter) -> None:
    engine, run, facts = trainer.engine, trainer.resolved, trainer.facts
    if not engine.is_main:
        return
    sizes = run.sizes
    features = "".join(f"; {e.describe()}" for e in trainer.callbacks if e.describe())
    optimizer = f"{type(trainer.optimizer).__name__} (given)" if trainer.optimizer_given else run.optimizer.describe()
    for line in ("***** Running training *****",
                 f"  Num examples = {sizes.train_samples}",
                 f"  Instantaneous batch size per device = {sizes.micro_batch_size}",
                 f"  Total train batch size (w. parallel, distributed & accumulation) = {sizes.global_batch_size}",
                 f"  Gradient Accumulation steps = {sizes.gradient_accumulation_steps}"
                 + (f" (batch_size_schedule: {sizes.ramp.describe()} sequences)" if sizes.ramp else ""),
                 *([f"  Sequence-length stages = {sizes.stages.describe()} (seq_length_schedule); each update "
                    f"trains {sizes.tokens_per_step():,} tokens at every length (windows cut from the "
                    f"{sizes.seq_length}-token sequences)" + (", a stage's sequences set by its ramp" if sizes.ramp
                                                                and args_sets_sequences(sizes) else "")]
                   if sizes.stages is not None else []),
                 f"  Total steps = {sizes.num_training_steps}",
                 f"  {engine.describe()}",
                 f"  Model parameters = {facts.parameters:,} (trainable {facts.trainable:,}){features}",
                 f"  Optimizer = {optimizer}",
                 *([f"  Parametrization = {run.options.parametrization.describe()}"]
                   if run.options.parametrization.kind != "sp" else []),
                 f"  LR = {run.schedule.describe()}, weight decay {run.optimizer.weight_decay:g}, clip "
                 f"{run.optimizer.clip_grad}",
                 f"  MFU = useful tokens/s per device x model FLOPs/token / peak; {meter.flops.describe()}; "
                 f"{meter.peak.describe()}"):
        logger.info(line)
    logger.info("[before the start of training step] datetime: %s", time.strftime("%Y-%m-%d %H:%M:%S"))


def prepare_process(world) -> None:
    """This process, before the run allocates anything: native faults say where they struck, and only the main
    rank logs info lines (warnings still come from every rank)."""
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
    if not world.is_main:
        logger.setLevel(logging.WARNING)


def check_inputs(args, accelerator, model, optimizer, lr_scheduler, callbacks=(), train_dataloader=None,
                 eval_dataloader=None) -> None:
    """What the constructor is given, checked before any heavy work."""
    if args.seq_length_schedule is not None:
        check_stage_inputs(args, train_dataloader, eval_dataloader)
    if not isinstance(callbacks, (list, tuple)):
        raise ConfigError(f"callbacks= takes a list of pretrainer.Callback objects, got {type(callbacks).__name__}")
    for index, callback in enumerate(callbacks):
        if not isinstance(callback, Callback):
            raise ConfigError(f"callbacks[{index}] is a {type(callback).__name__}, not a pretrainer.Callback; "
                              "subclass pretrainer.Callback and override the events it needs")
    if accelerator is not None:
        logger.info("an accelerator object was passed; pretrainer places and wraps the model itself, "
                    "the accelerator is kept only as an attribute")
    if optimizer is not None and model is None:
        raise ConfigError("an optimizer was passed without its model; pass model= as well")
    if lr_scheduler is not None and optimizer is None:
        raise ConfigError("an lr_scheduler was passed without its optimizer; pass optimizer= as well")
    requested_trackers(args.report_to)  # an unknown name fails here
    if args.save_dir:  # for a URL, the local staging folder its files are written in first
        check_writable_folder(args.run_dir, "key 'staging_dir'" if args.remote_save_dir else "key 'save_dir'")
    if args.data_cache_path:
        check_writable_folder(args.data_cache_path, "key 'data_cache_path'")
