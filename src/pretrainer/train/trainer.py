"""`PreTrainer`: the training loop, readable in one sitting.

Construction resolves everything the run needs, cheapest checks first: the launch (`run.launch_world`),
the resolved run (`run.resolve_run`: the engine's settings and dimensions, the dtype, the model config and
tokenizer, the sizes, the loss chunk; every derived value, once), the engine built from its part, the data
(`data.assemble_data`), then the model, optimizer and schedule. `train()` resumes from the latest
checkpoint and runs optimizer steps of `gradient_accumulation_steps` micro-batches; what happens after a
step is delegated: the checkpointer says when to save, the validator when to evaluate, the stop rules
when to leave. At the end it evaluates, saves, exports an HF folder and writes the report.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import random
import resource
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from ..batch import count_inputs, count_targets, to_device
from ..config import ConfigError, PreTrainingArguments, check_writable_folder
from ..data import DataPlacement, assemble_data
from ..models import (
    LoadStats,
    MoeRouting,
    build_model,
    count_parameters,
    idle_expert_parameters,
    install_chunked_loss,
    pending_checkpoint,
    select_trainable,
)
from ..optim import build_optimizer, build_scheduler
from ..parallel import create_engine
from ..perf import IntervalMeter, StepPhases, device_peak, flops_per_token
from ..perf.host_memory import reuse_freed_host_memory
from ..perf.peak import processor_name
from ..plan import check_memory_before_build
from ..run import launch_world, resolve_run
from . import checkpoint as ckpt
from .downstream import DownstreamEvaluator, format_scores
from .errors import CollectiveFailure, TrainingDiverged, is_collective_failure
from .evaluate import Validator
from .export import export_hf
from .hooks import Hooks
from .metrics import MetricsLog, Progress, format_eval_line, format_train_line, setup_logging
from .signals import StopRequests, TrainingInterrupted
from .spikes import LossSpikeGuard
from .trackers import open_trackers
from .trackers import requested as requested_trackers
from .watchdog import open_watchdog

logger = logging.getLogger("pretrainer")


class PreTrainer:
    def __init__(self, pretrain_args: PreTrainingArguments, accelerator=None, model=None, optimizer=None,
                 lr_scheduler=None, train_dataloader=None, eval_dataloader=None):
        setup_logging()
        if not faulthandler.is_enabled():  # a rank killed by a native fault (SIGABRT, SIGSEGV) says where it was
            faulthandler.enable(all_threads=True)
        self.pretrain_args = args = pretrain_args
        self.accelerator = accelerator
        _check_inputs(args, accelerator, model, optimizer, lr_scheduler)
        self.world = world = launch_world(args)
        self._closed = False
        self._started = time.perf_counter()
        atexit.register(_close_at_exit, weakref.ref(self))  # before the interpreter tears down (see close)
        if args.host_malloc_reuse and world.device.type == "cpu":
            reuse_freed_host_memory()  # before the model and data allocate
        if not world.is_main:  # one copy of the info lines; warnings still come from every rank
            logging.getLogger("pretrainer").setLevel(logging.WARNING)
        self.resume_from = self._resolve_resume()
        seed_everything(args.seed)

        self.hooks = Hooks(args.plugin_args)
        if model is None and self.hooks.model_provider is not None:
            model = self.hooks.build_model()
        self.resolved = run = resolve_run(args, world, model_config=model.config if model is not None else None,
                                          check_model=model is None or train_dataloader is None)
        logger.info("run: %s", run.describe())
        self.engine = engine = create_engine(run.engine, run.options, world)
        self.tokenizer = run.tokenizer
        # Before the data and the model take any memory; a model passed in is already allocated.
        self.predicted_memory = check_memory_before_build(args, run, world) if model is None else None
        placement = DataPlacement(engine.data_rank, engine.data_world_size, engine.is_main, engine.barrier,
                                  engine.all_gather_object, int(os.environ.get("LOCAL_RANK", "0")))
        data = assemble_data(args, run.sizes, self.tokenizer, placement,
                             datasets_provider=self.hooks.datasets_provider, train_dataloader=train_dataloader,
                             eval_dataloader=eval_dataloader)
        self.train_dataloader, self.train_stream, self.eval_dataloader = train_dataloader, data.train, data.eval
        self._setup_model(model, optimizer, lr_scheduler)

        self.completed_steps = 0
        self.tokens_seen = 0
        self.skipped_updates = 0
        self.skipped_in_a_row = 0
        self.stop_requests = StopRequests()
        self.spike_guard = LossSpikeGuard(args.loss_spike_factor) if args.loss_spike_factor else None
        if self.spike_guard is not None and engine.applies_every_update:
            raise ConfigError(f"loss_spike_factor is not available with engine {engine.name} ({engine.name} applies "
                              "every update it is given); remove it or use engine fsdp")
        self._pending_rows: list[dict] = []  # rows produced inside a step, written after it
        self.log_history: list[dict] = []  # every row written to metrics.jsonl, also kept in memory
        self.validator = Validator(self.eval_dataloader, engine, args.eval_interval, args.eval_iters)
        self.downstream = DownstreamEvaluator(args.downstream_tasks, self.tokenizer, engine, run.sizes,
                                              args.eval_interval)
        self.checkpointer = ckpt.Checkpointer(args.save_dir, engine, args.async_checkpoint,
                                              keep_last=args.keep_last_checkpoints,
                                              keep_every=args.keep_checkpoints_every,
                                              checksums=args.checkpoint_checksums,
                                              interval=args.save_interval) if args.save_dir else None

    # ------------------------------------------------------------ assembly
    def _resolve_resume(self):
        """The checkpoint to resume from, chosen (and verified against its manifest) by the main rank only."""
        outcome = None
        if self.world.is_main:
            try:
                outcome = ("path", ckpt.resolve_resume(self.pretrain_args.resume, self.pretrain_args.save_dir))
            except ConfigError as exc:
                outcome = ("error", str(exc))
        kind, value = self.world.broadcast_object(outcome)
        if kind == "error":
            raise ConfigError(value)
        return value

    def _setup_model(self, model, optimizer, lr_scheduler) -> None:
        args, engine, run = self.pretrain_args, self.engine, self.resolved
        if model is None:
            model = build_model(args, run.model, read_slices=engine.reads_slices)
        else:
            model.config.use_cache = False
        if optimizer is not None and engine.shards_parameters:
            raise ConfigError(f"engine {engine.name} shards the model's parameters, so an optimizer made "
                              "before sharding cannot be used; leave optimizer= unset (configure it with lr, "
                              "adam_*, weight_decay)")
        self.num_parameters = count_parameters(model)
        checkpoint = pending_checkpoint(model)  # read by the engine as it lays the model out
        self.trainable_parameters = select_trainable(model, args.trainable_parameters)
        self._chunk_loss(model)
        # what the run trains, read off the model before an engine shards it (the start row records both)
        self.vocab_rows = model.get_input_embeddings().weight.shape[0]
        self.loss_chunk_size = getattr(model.get_output_embeddings(), "loss_chunk_size", 0)
        self.moe = MoeRouting(model, run.moe) if run.moe is not None else None  # hooks its routers
        self.flops = flops_per_token(model, run.sizes.seq_length,
                                     idle_expert_parameters(model, run.moe.shape) if run.moe is not None else 0)
        self.optimizer_given = optimizer is not None
        self.model, self.optimizer, self.lr_scheduler = engine.setup(
            model, optimizer, lr_scheduler,
            build_optimizer=lambda m: build_optimizer(engine.trained_module(m), run.optimizer, engine.device),
            build_scheduler=lambda o: build_scheduler(o, run.schedule))
        if self.moe is not None:  # each micro-batch starts where the engine runs it; tokens split as it splits them
            self.moe.watch_forwards(engine.forward_modules(self.model))
            self.moe.split_sequences(engine.routing_group)
            if engine.balancing_losses_on_activations:
                self.moe.attach_losses()
        self.model_memory = self._report_model_memory(checkpoint.stats if checkpoint is not None else None)

    def _report_model_memory(self, stats: LoadStats | None) -> dict:
        """Each rank's peak RSS once the engine is set up (before the first step) and, when the checkpoint was
        read in slices, what that took (logged per rank); returns the start row's fields."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ranks = self.engine.all_gather_object((peak, stats.bytes_read, stats.seconds, stats.peak_rss_bytes) if stats
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

    def _chunk_loss(self, model) -> None:
        """`loss_chunk_size`: the output head computes the loss in chunks (see models/chunked_loss.py)."""
        chunk = self.resolved.loss_chunk
        if chunk.reason:
            logger.info("chunked loss not used: %s", chunk.reason)
        if chunk.size:
            install_chunked_loss(model, chunk.size, chunk.explicit)

    # ----------------------------------------------------------------- loop
    def train(self) -> dict:
        """Train to `num_training_steps` (resuming first). SIGTERM/SIGINT end it after a checkpoint by raising
        `TrainingInterrupted` (a SystemExit with code 75). A run that fails leaves an asynchronous checkpoint
        being written incomplete: it is never resumed from."""
        self.stop_requests.install()
        try:
            return self._train()
        except RuntimeError as exc:
            self._abandon_checkpoint()
            if self.engine.world_size == 1 or not is_collective_failure(exc):
                raise
            message = (f"rank {self.engine.rank}: a collective failed at step {self.completed_steps + 1} (after "
                       f"{self.pretrain_args.distributed_timeout_minutes:g} min at most, distributed_timeout_minutes)"
                       f"; another rank died or hangs. Rerun the same command to resume from the last checkpoint. "
                       f"Cause: {str(exc).splitlines()[0][:300]}")
            logger.error(message)
            raise CollectiveFailure(message) from exc
        except BaseException as exc:
            if not isinstance(exc, TrainingInterrupted):  # a stop request's checkpoint is complete
                self._abandon_checkpoint()
            raise
        finally:
            self.stop_requests.uninstall()

    def _abandon_checkpoint(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.abandon()

    def close(self, barrier: bool = True) -> None:
        """End the run's use of the processes: drop the model, optimizer and schedule, release the engine and
        destroy the process group (once, last; with `barrier`, when every rank has got here). Called by
        `pretrainer train` at its end, by `with PreTrainer(...) as trainer:`, and otherwise at interpreter
        exit (without the barrier: a peer may have failed)."""
        if self._closed:
            return
        self._closed = True
        checkpointer, engine = getattr(self, "checkpointer", None), getattr(self, "engine", None)
        if checkpointer is not None:
            checkpointer.abandon()  # a clean end has completed it already
        self.model = self.optimizer = self.lr_scheduler = None
        self.train_stream = self.eval_dataloader = self.validator = None
        if engine is not None:
            engine.close(barrier)
        else:  # it failed before the engine was built
            self.world.close(barrier)

    def __enter__(self) -> "PreTrainer":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.close(barrier=kind is None)

    def _train(self) -> dict:
        args, engine = self.pretrain_args, self.engine
        self._maybe_resume()
        metrics, meter = self._open_metrics()
        if self.completed_steps >= args.num_training_steps:
            return self._already_complete(metrics)
        self._print_banner(meter)
        progress = Progress(args.num_training_steps, self.completed_steps, enabled=engine.is_main)
        watchdog = open_watchdog(engine.rank, engine.world_size, 60 * args.distributed_timeout_minutes)
        try:
            stop = self._steps(metrics, meter, progress, watchdog)
        finally:  # on every way out: the watchdog thread is stopped and joined, the bar closed
            progress.close()
            watchdog.close()
        self._count_tokens(meter)
        if stop is None:
            self._finish(metrics, meter)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        metrics.close()
        engine.barrier()
        if stop == "interrupted":
            name = self.stop_requests.name or "a stop request on another rank"
            logger.warning("stopped after step %d on %s%s; rerun the same command to continue", self.completed_steps,
                           name, " (checkpoint saved)" if args.save_dir else " (no save_dir: nothing was saved)")
            raise TrainingInterrupted(self.completed_steps, name)
        return {"exited_early": stop == "exit_interval", "step": self.completed_steps, "tokens": self.tokens_seen}

    def _steps(self, metrics: MetricsLog, meter: IntervalMeter, progress: Progress, watchdog) -> str | None:
        """The step loop; returns why it left early: "interrupted", "exit_interval" or None (the last step)."""
        args = self.pretrain_args
        self.model.train()
        step_start = time.perf_counter()
        while self.completed_steps < args.num_training_steps:
            with watchdog.watching(self.completed_steps + 1):
                step_loss, counts, grad_norm, lr = self._train_step(meter.phases)
            self.completed_steps = step = self.completed_steps + 1
            meter.add(step_loss, counts, time.perf_counter() - step_start)
            self._write_pending_rows(metrics)
            if step % args.log_interval == 0 or step == args.num_training_steps:
                self._log_step(metrics, meter, progress, lr, grad_norm)
            progress.update(step)
            if self.checkpointer is not None and self.checkpointer.is_due(step):
                self._save_checkpoint(meter)
            if self.validator.is_due(step):
                self._evaluate(metrics)
            if tasks := self.downstream.due(step):
                self._score_downstream(metrics, meter, tasks)
            stop = self._stop_reason(step)
            if stop is not None:
                if self.checkpointer is not None:
                    self._save_checkpoint(meter)
                return stop
            step_start = time.perf_counter()  # save/eval time is not part of the next step
        return None

    def _train_step(self, phases: StepPhases):
        """One optimizer step over `gradient_accumulation_steps` micro-batches, averaged over all their tokens.

        Returns this rank's loss sum, the global [targets, useful tokens] (device tensors: nothing here waits
        for the device), the gradient norm and the learning rate used.
        """
        args, engine = self.pretrain_args, self.engine
        with phases.host("data"):
            host_batches = [engine.shard_batch(self.hooks.next_batch(self.train_stream))
                            for _ in range(args.gradient_accumulation_steps)]
            local_counts = torch.tensor([sum(int(count_targets(b)) for b in host_batches),
                                         sum(count_inputs(b) for b in host_batches),
                                         sum(len(b["input_ids"]) for b in host_batches)], dtype=torch.int64)
            micro_batches = [to_device(b, engine.device) for b in host_batches]
        # Token-weighted mean over the whole window: the loss of one big batch, whatever the split. The counts
        # are taken on the host batches and summed over ranks on the device, so no step waits for the device.
        with phases.host("comm"):
            counts = engine.reduce_counts(local_counts)
        # Engines average gradients over ranks; scaling by their number makes the result the gradient of
        # (sum of token losses on all ranks) / (tokens on all ranks).
        scale = engine.gradient_average_size / counts[0].clamp(min=1)
        if self.moe is not None:
            self.moe.begin_step(self._moe_unit_weight(counts[2]))
        with phases.device("compute"):
            local_loss = engine.forward_backward(self.model, micro_batches, self.hooks.loss, scale,
                                                 self.moe.take_losses if self.moe is not None else None)
        spike = False
        if self.spike_guard is not None:  # reads the loss each step: one sync, only with the rule on
            step_loss = engine.reduce_sum(local_loss).item() / max(float(counts[0].item()), 1.0)
            spike = self.spike_guard.is_spike(step_loss)
        lr = self.optimizer.param_groups[0]["lr"]
        with phases.device("optimizer"):
            grad_norm, applied = engine.step(self.model, self.optimizer, args.clip_grad,
                                             skip_nonfinite=args.max_skipped_updates > 0, skip=spike)
            if applied:
                engine.finish_step(self.optimizer, self.lr_scheduler)
            else:
                self.optimizer.zero_grad(set_to_none=True)  # the schedule stays where it was, as in Megatron
            if self.moe is not None:
                self.moe.end_step(self._routing_sum, applied)
        self._count_skipped_update(applied, grad_norm, "loss spike" if spike else "non-finite gradient norm")
        return local_loss, counts[:2], grad_norm, lr

    def _routing_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Routing counts and sums over every rank: each rank counts the tokens it routed itself."""
        value = value.clone()
        self.engine.sum_over_ranks(value)
        return value

    def _moe_unit_weight(self, global_rows: torch.Tensor):
        """The factor of one unit's balancing losses: their gradient is that of the mean over the global batch's
        units (sequences, or micro-batches), after the engine's average over gradient_average_size ranks."""
        engine = self.engine
        if self.resolved.moe.aux_loss_type == "seq":
            return engine.gradient_average_size / global_rows.clamp(min=1).double()
        return engine.gradient_average_size / (self.resolved.sizes.gradient_accumulation_steps * engine.data_world_size)

    def _stop_reason(self, step: int) -> str | None:
        """Whether to leave the loop after `step` before the end: a signal on any rank, or exit_interval."""
        args = self.pretrain_args
        if step >= args.num_training_steps:
            return None
        if self.engine.any_rank(self.stop_requests.received is not None):
            return "interrupted"
        if args.exit_interval and step % args.exit_interval == 0:
            logger.info("exit_interval: stopping after step %d; rerun the same command to continue", step)
            return "exit_interval"
        return None

    def _count_skipped_update(self, applied: bool, grad_norm, reason: str) -> None:
        """Skipped updates are counted and logged; too many in a row stop the run."""
        if applied:
            self.skipped_in_a_row = 0
            return
        self.skipped_updates += 1
        self.skipped_in_a_row += 1
        step, limit = self.completed_steps + 1, self.pretrain_args.max_skipped_updates
        logger.warning("step %d: %s (gradient norm %s), update skipped (%d in a row, %d in the run)", step, reason,
                       float(grad_norm), self.skipped_in_a_row, self.skipped_updates)
        self._pending_rows.append({"step": step, "skipped_update": True, "reason": reason,
                                   "grad_norm": float(grad_norm), "skipped_in_a_row": self.skipped_in_a_row})
        if limit and self.skipped_in_a_row >= limit:
            raise TrainingDiverged(f"{self.skipped_in_a_row} updates in a row were skipped (last at step {step}: "
                                   f"{reason}); the run stops without saving this state. Resume from the last "
                                   "checkpoint with a lower lr, more warmup or clip_grad, or raise "
                                   "max_skipped_updates")

    # ------------------------------------------------------------- metrics
    def _open_metrics(self) -> tuple[MetricsLog, IntervalMeter]:
        """The metrics log (with its trackers) and the throughput meter; writes the run's start row."""
        args, engine = self.pretrain_args, self.engine
        trackers = open_trackers(args.report_to, args.save_dir, args.project_name, args.to_dict()) \
            if engine.is_main else []
        metrics = MetricsLog(args.save_dir, enabled=engine.is_main, trackers=trackers)
        meter = IntervalMeter(engine, self.flops, device_peak(engine.device, engine.precision.compute_dtype,
                                                              args.peak_tflops), self.resolved.recompute.mode)
        metrics.write({"event": "resume" if self.completed_steps else "start", "step": self.completed_steps,
                       "config_hash": args.config_hash(), "engine": engine.name, "world_size": engine.world_size,
                       "device": str(engine.device), "dtype": self.resolved.dtype,
                       "hardware": f"{processor_name(engine.device)}, {torch.get_num_threads()} thread(s) per process",
                       "parameters": self.num_parameters, "vocab_size": self.vocab_rows,
                       "loss_chunk_size": self.loss_chunk_size, "flops_per_token": self.flops.per_token,
                       **({"moe": self.resolved.moe.describe(), "experts_implementation":
                           self.moe.experts_implementation} if self.moe is not None else {}),
                       "peak": meter.peak.describe(),
                       **(self.predicted_memory.row() if self.predicted_memory is not None else {}),
                       **self.model_memory})
        return metrics, meter

    def _count_tokens(self, meter: IntervalMeter) -> None:
        """Move the meter's target count into tokens_seen (a device read: only at log, save and end)."""
        self.tokens_seen += meter.take_targets()

    def _log_step(self, metrics: MetricsLog, meter: IntervalMeter, progress: Progress, lr: float, grad_norm) -> None:
        self._count_tokens(meter)
        step = self.completed_steps
        row = {"step": step, **meter.row(), "lr": lr, "grad_norm": float(grad_norm), "tokens": self.tokens_seen,
               "epoch": self.train_stream.epoch,
               **(self.moe.interval_row(self._routing_sum) if self.moe is not None else {})}
        self._record(metrics, row)
        if self.engine.is_main:
            progress.log(format_train_line(row, progress.eta(step)))

    def _write_pending_rows(self, metrics: MetricsLog) -> None:
        for pending in self._pending_rows:
            self._record(metrics, pending)
        self._pending_rows.clear()

    def _record(self, metrics: MetricsLog, row: dict) -> None:
        metrics.write(row)
        self.log_history.append(row)

    def _score_downstream(self, metrics: MetricsLog, meter: IntervalMeter, tasks) -> None:
        self._count_tokens(meter)
        row, scores = self.downstream.run(self.model, self.completed_steps, tasks)
        self._record(metrics, {**row, "tokens": self.tokens_seen})
        if self.engine.is_main:
            logger.info("downstream step %d (%.1f s): %s", self.completed_steps, row["downstream_seconds"],
                        format_scores(scores))
        self.model.train()

    def _evaluate(self, metrics: MetricsLog) -> dict:
        row = self.validator.run(self.model, self.completed_steps)
        self._record(metrics, row)
        if self.engine.is_main:
            logger.info(format_eval_line(row))
        self.model.train()
        return row

    # --------------------------------------------------------- checkpoints
    def _save_checkpoint(self, meter: IntervalMeter | None = None) -> Path | None:
        """Save after the current step (once: a step already saved is not written again)."""
        if self.checkpointer.saved(self.completed_steps):
            return None
        if meter is not None:
            self._count_tokens(meter)
        args = self.pretrain_args
        return self.checkpointer.save(
            self.completed_steps, model=self.model, optimizer=self.optimizer,
            scheduler_state=self.lr_scheduler.state_dict(),
            trainer_state={"tokens": self.tokens_seen, "data": self.train_stream.state_dict(),
                           "loss_history": self.spike_guard.state_dict() if self.spike_guard else [],
                           "skipped_updates": self.skipped_updates, "config_hash": args.config_hash()},
            config_yaml=args.to_yaml())

    def _maybe_resume(self) -> None:
        args, path = self.pretrain_args, self.resume_from
        if path is None:
            return
        trainer_state = ckpt.read_trainer_state(path)
        ckpt.check_resumable(path, trainer_state, self.engine)
        extra = ckpt.load_checkpoint(path, engine=self.engine, model=self.model, optimizer=self.optimizer)
        if trainer_state.get("config_hash") != args.config_hash():
            logger.warning("resuming from %s, whose config differs from this run's (see its config.yaml)", path)
        self.lr_scheduler.load_state_dict(extra["scheduler"])
        self.engine.precision.load_state_dict(extra["scaler"])
        self.train_stream.load_state_dict(trainer_state["data"])
        self.completed_steps = int(trainer_state["step"])
        self.tokens_seen = int(trainer_state.get("tokens", 0))
        self.skipped_updates = int(trainer_state.get("skipped_updates", 0))
        if self.spike_guard is not None:
            self.spike_guard.load_state_dict(trainer_state.get("loss_history", []))
        ckpt.set_rng_state(extra["rng"])
        logger.info("resumed from %s at step %d", path, self.completed_steps)

    # ------------------------------------------------------------- the end
    def _already_complete(self, metrics: MetricsLog) -> dict:
        args = self.pretrain_args
        logger.info("the run is already complete at step %d (num_training_steps=%d); nothing to train",
                    self.completed_steps, args.num_training_steps)
        if args.save_dir and args.export_hf:
            self.export(Path(args.save_dir) / "hf")
        metrics.close()
        return {"exited_early": False, "step": self.completed_steps, "tokens": self.tokens_seen}

    def _finish(self, metrics: MetricsLog, meter: IntervalMeter) -> None:
        args = self.pretrain_args
        if self.validator.is_due_at_end(self.completed_steps):
            self._evaluate(metrics)
        if tasks := self.downstream.due_at_end(self.completed_steps):
            self._score_downstream(metrics, meter, tasks)
        if self.downstream.tasks and self.engine.is_main:
            elapsed = time.perf_counter() - self._started
            logger.info("downstream evaluation took %.1f s in all, %.1f%% of the run's %.1f s so far (kept out of "
                        "step times and tokens/s)", self.downstream.seconds, 100 * self.downstream.seconds / elapsed,
                        elapsed)
        if self.checkpointer is not None:
            self._save_checkpoint(meter)
        if args.save_dir and args.export_hf:
            self.export(Path(args.save_dir) / "hf")
        if args.save_dir and args.write_report and self.engine.is_main:
            self._write_report()

    def _write_report(self) -> None:
        from .report import ReportError, write_report

        try:
            logger.info("run report: %s", write_report(self.pretrain_args.save_dir))
        except ReportError as exc:
            logger.info("no run report: %s", exc)

    def export(self, out_dir: str | Path) -> Path | None:
        """Write an HF folder (weights streamed from the engine's shards, tokenizer included); the main rank's
        path, None on the others."""
        args = self.pretrain_args
        out = export_hf(self.engine, self.model, self.tokenizer, out_dir, args.export_dtype or self.resolved.dtype,
                        args.export_max_shard_size)
        self.engine.barrier()
        return out

    def _print_banner(self, meter: IntervalMeter) -> None:
        engine, run = self.engine, self.resolved
        sizes = run.sizes
        if not engine.is_main:
            return
        for line in ("***** Running training *****",
                     f"  Num examples = {sizes.train_samples}",
                     f"  Instantaneous batch size per device = {sizes.micro_batch_size}",
                     f"  Total train batch size (w. parallel, distributed & accumulation) = {sizes.global_batch_size}",
                     f"  Gradient Accumulation steps = {sizes.gradient_accumulation_steps}",
                     f"  Total steps = {sizes.num_training_steps}",
                     f"  {engine.describe()}",
                     f"  Model parameters = {self.num_parameters:,} (trainable {self.trainable_parameters:,})"
                     + (f"; Mixture-of-Experts: {run.moe.describe()}; experts computed by "
                        f"{self.moe.experts_implementation}" if self.moe is not None else ""),
                     f"  Optimizer = {type(self.optimizer).__name__} (given)" if self.optimizer_given else
                     f"  Optimizer = {run.optimizer.describe()}",
                     f"  LR = {run.schedule.describe()}, weight decay {run.optimizer.weight_decay:g}, clip "
                     f"{run.optimizer.clip_grad}",
                     f"  MFU = useful tokens/s per device x model FLOPs/token / peak; {meter.flops.describe()}; "
                     f"{meter.peak.describe()}"):
            logger.info(line)
        logger.info("[before the start of training step] datetime: %s", time.strftime("%Y-%m-%d %H:%M:%S"))


def _check_inputs(args, accelerator, model, optimizer, lr_scheduler) -> None:
    """What the constructor is given, checked before any heavy work."""
    if accelerator is not None:
        logger.info("an accelerator object was passed; pretrainer places and wraps the model itself, "
                    "the accelerator is kept only as an attribute")
    if optimizer is not None and model is None:
        raise ConfigError("an optimizer was passed without its model; pass model= as well")
    if lr_scheduler is not None and optimizer is None:
        raise ConfigError("an lr_scheduler was passed without its optimizer; pass optimizer= as well")
    requested_trackers(args.report_to)  # an unknown name fails here
    for key in ("save_dir", "data_cache_path"):
        if getattr(args, key):
            check_writable_folder(getattr(args, key), f"key {key!r}")


def _close_at_exit(trainer: "weakref.ref[PreTrainer]") -> None:
    live = trainer()
    if live is not None:
        live.close(barrier=False)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
