"""`PreTrainer`: the training loop, readable in one sitting.

Construction resolves everything the run needs, cheapest checks first:
engine and world size, model config and tokenizer (preflight), data, then the
model, optimizer and schedule. `train()` resumes from the latest checkpoint,
runs accumulation windows of `gradient_accumulation_steps` micro-batches, logs,
evaluates, checkpoints, and exports an HF folder at the end.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, PreTrainingArguments
from ..data import BatchStream, EvalBatches, SampleStream, build_datasets, build_indexed_datasets
from ..data.loader import BuiltData
from ..data.packing import DocumentMasking
from ..models import build_model, count_parameters, load_tokenizer, preflight
from ..parallel import create_engine
from ..perf import IntervalMeter, StepPhases, device_peak, flops_per_token
from ..perf.host_memory import reuse_freed_host_memory
from ..perf.peak import processor_name
from . import checkpoint as ckpt
from .evaluate import evaluate
from .export import export_hf
from .hooks import Hooks, ProvidedSamples
from .loss import count_inputs, count_targets, to_device
from .metrics import MetricsLog, Progress, format_eval_line, format_train_line, setup_logging
from .optim import build_optimizer, build_scheduler
from .errors import CollectiveFailure, TrainingDiverged, is_collective_failure
from .signals import StopRequests, TrainingInterrupted
from .spikes import LossSpikeGuard
from .trackers import open_trackers
from .watchdog import StepWatchdog
from .trackers import requested as requested_trackers

logger = logging.getLogger("pretrainer")


class PreTrainer:
    def __init__(self, pretrain_args: PreTrainingArguments, accelerator=None, model=None, optimizer=None,
                 lr_scheduler=None, train_dataloader=None, eval_dataloader=None, *args, **kwargs):
        setup_logging()
        self.pretrain_args = args_ = pretrain_args
        self.accelerator = accelerator
        if accelerator is not None:
            logger.info("an accelerator object was passed; pretrainer places and wraps the model itself, "
                        "the accelerator is kept only as an attribute")
        if optimizer is not None and model is None:
            raise ConfigError("an optimizer was passed without its model; pass model= as well")
        if lr_scheduler is not None and optimizer is None:
            raise ConfigError("an lr_scheduler was passed without its optimizer; pass optimizer= as well")
        requested_trackers(args_.report_to)  # an unknown name fails before any heavy work
        self.completed_steps = 0
        self.engine = create_engine(args_)
        if args_.host_malloc_reuse and self.engine.device.type == "cpu":
            reuse_freed_host_memory()  # before the model and data allocate
        if not self.engine.is_main:  # one copy of the info lines; warnings still come from every rank
            logging.getLogger("pretrainer").setLevel(logging.WARNING)
        self.resume_from = self._resolve_resume()
        seed_everything(args_.seed)

        self.hooks = Hooks(args_.plugin_args)
        if model is None and self.hooks.model_provider is not None:
            model = self.hooks.build_model()
        self.tokenizer, spec = None, None
        if model is None or train_dataloader is None:
            spec = preflight(args_, config=model.config if model is not None else None)
            self.tokenizer = spec.tokenizer
        elif args_.resolved_tokenizer_path:
            self.tokenizer = load_tokenizer(args_.resolved_tokenizer_path, Path(args_.resolved_tokenizer_path))

        if train_dataloader is None:
            self.train_stream, built_eval = self._built_in_data(spec)
            eval_dataloader = eval_dataloader if eval_dataloader is not None else built_eval
        else:
            if self.engine.data_world_size > 1:
                logger.info("a user DataLoader is iterated as given on each rank: give each rank its own part "
                            "(e.g. a DistributedSampler)")
            self.train_stream = BatchStream(train_dataloader, args_.seed)
        self.train_dataloader = train_dataloader
        self.eval_dataloader = eval_dataloader

        if model is None:
            model = build_model(args_, spec)
        else:
            model.config.use_cache = False
        if optimizer is not None and self.engine.name in ("fsdp", "deepspeed"):
            raise ConfigError(f"engine {self.engine.name} shards the model's parameters, so an optimizer made "
                              "before sharding cannot be used; leave optimizer= unset (configure it with lr, "
                              "adam_*, weight_decay)")
        self.num_parameters = count_parameters(model)
        seq_length = spec.seq_length if spec is not None else (args_.seq_length or model.config.max_position_embeddings)
        self.flops = flops_per_token(model, seq_length)  # counted before an engine shards the model
        self.model, self.optimizer, self.lr_scheduler = self.engine.setup(
            model, optimizer, lr_scheduler,
            build_optimizer=lambda m: build_optimizer(m, args_, self.engine.device),
            build_scheduler=lambda o: build_scheduler(o, args_))
        self.tokens_seen = 0
        self.skipped_updates = 0
        self.stop_requests = StopRequests()
        self.skipped_in_a_row = 0
        self.spike_guard = LossSpikeGuard(args_.loss_spike_factor) if args_.loss_spike_factor else None
        if self.spike_guard is not None and self.engine.name == "deepspeed":
            raise ConfigError("loss_spike_factor is not available with engine deepspeed (DeepSpeed applies every "
                              "update it is given); remove it or use engine fsdp")
        self._pending_rows: list[dict] = []  # rows produced inside a step, written after it
        self.log_history: list[dict] = []  # every row written to metrics.jsonl, also kept in memory
        self.checkpointer = ckpt.Checkpointer(args_.save_dir, self.engine, args_.async_checkpoint,
                                              keep_last=args_.keep_last_checkpoints,
                                              keep_every=args_.keep_checkpoints_every,
                                              checksums=args_.checkpoint_checksums) if args_.save_dir else None

    def _resolve_resume(self):
        """The checkpoint to resume from, chosen (and verified against its manifest) by the main rank only."""
        outcome = None
        if self.engine.is_main:
            try:
                outcome = ("path", ckpt.resolve_resume(self.pretrain_args.resume, self.pretrain_args.save_dir))
            except ConfigError as exc:
                outcome = ("error", str(exc))
        kind, value = self.engine.broadcast_object(outcome)
        if kind == "error":
            raise ConfigError(value)
        return value

    def _built_in_data(self, spec):
        """This rank's train stream and eval batches from the configured files or prepared prefix."""
        args = self.pretrain_args
        engine = self.engine
        if args.megatron_dataset_flag and self.hooks.datasets_provider is not None:
            data = self._provided_data(spec.seq_length)
        elif args.megatron_dataset_flag:
            data = build_indexed_datasets(args, spec.seq_length, engine.data_world_size, engine.is_main,
                                          engine.barrier)
        else:
            if not args.resolved_train_data:
                raise ConfigError("no training data: set `train_data` (files, globs or folders of "
                                  "json/jsonl/csv/txt/parquet), or data_path with megatron_dataset_flag: true for "
                                  "prepared .bin/.idx data, or pass train_dataloader=")
            if args.dataloader_config:
                logger.info("dataloader_config is for user DataLoaders (get_dataloader_config()); the "
                            "built-in pipeline packs sequences without padding and does not use it")
            data = build_datasets(args, self.tokenizer, spec.seq_length)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        masking = None
        if args.reset_position_ids or args.reset_attention_mask:
            masking = DocumentMasking(self.tokenizer.eos_token_id, attention=args.reset_attention_mask)
            logger.info("document masking: positions restart after each EOS%s", "; attention stays within each "
                        "document" if args.reset_attention_mask else "")
        shard = {"rank": engine.data_rank, "world_size": engine.data_world_size, "masking": masking}
        stream = SampleStream(data.train, args.micro_batch_size, pad_id, seed=args.seed,
                              num_workers=args.num_workers, shuffle=not data.shuffled, **shard)
        evaluation = EvalBatches(data.eval, args.micro_batch_size, pad_id, **shard) if data.eval is not None \
            else None
        return stream, evaluation

    def _provided_data(self, seq_length: int) -> BuiltData:
        """Datasets from the custom_megatron_datasets_provider_function hook."""
        args = self.pretrain_args
        replicas = self.engine.data_world_size
        samples = [args.num_training_steps * args.micro_batch_size * args.gradient_accumulation_steps * replicas,
                   args.eval_iters * args.micro_batch_size * replicas, 0]
        provided = self.hooks.datasets_provider(samples)
        if not isinstance(provided, (tuple, list)) or len(provided) != 3:
            raise ConfigError("custom_megatron_datasets_provider_function must return (train, valid, test) datasets")
        train, valid, _ = provided
        if train is None:
            raise ConfigError("custom_megatron_datasets_provider_function returned no training dataset")
        return BuiltData(ProvidedSamples(train, seq_length, "train"),
                         ProvidedSamples(valid, seq_length, "valid") if valid is not None else None)

    # ----------------------------------------------------------------- loop
    def train(self) -> dict:
        """Train to `num_training_steps` (resuming first). SIGTERM/SIGINT end it after a checkpoint by raising
        `TrainingInterrupted` (a SystemExit with code 75)."""
        self.stop_requests.install()
        try:
            return self._train()
        except RuntimeError as exc:
            if self.engine.world_size == 1 or not is_collective_failure(exc):
                raise
            message = (f"rank {self.engine.rank}: a collective failed at step {self.completed_steps + 1} (after "
                       f"{self.pretrain_args.distributed_timeout_minutes:g} min at most, distributed_timeout_minutes)"
                       f"; another rank died or hangs. Rerun the same command to resume from the last checkpoint. "
                       f"Cause: {str(exc).splitlines()[0][:300]}")
            logger.error(message)
            raise CollectiveFailure(message) from exc
        finally:
            self.stop_requests.uninstall()

    def _train(self) -> dict:
        args, engine = self.pretrain_args, self.engine
        self._maybe_resume()
        trackers = open_trackers(args.report_to, args.save_dir, args.project_name, args.to_dict()) \
            if engine.is_main else []
        metrics = MetricsLog(args.save_dir, enabled=engine.is_main, trackers=trackers)
        meter = IntervalMeter(engine, self.flops, device_peak(engine.device, engine.precision.compute_dtype,
                                                              args.peak_tflops))
        metrics.write({"event": "resume" if self.completed_steps else "start", "step": self.completed_steps,
                       "config_hash": args.config_hash(), "engine": engine.name, "world_size": engine.world_size,
                       "device": str(engine.device), "dtype": args.dtype,
                       "hardware": f"{processor_name(engine.device)}, {torch.get_num_threads()} thread(s) per process",
                       "parameters": self.num_parameters, "flops_per_token": self.flops.per_token,
                       "peak": meter.peak.describe()})
        if self.completed_steps >= args.num_training_steps:
            logger.info("the run is already complete at step %d (num_training_steps=%d); nothing to train",
                        self.completed_steps, args.num_training_steps)
            if args.save_dir and args.export_hf:
                self.export(Path(args.save_dir) / "hf")
            metrics.close()
            return {"exited_early": False, "step": self.completed_steps, "tokens": self.tokens_seen}
        self._print_banner(meter)
        progress = Progress(args.num_training_steps, self.completed_steps, enabled=engine.is_main)
        last = {"saved": None, "evaluated": None}
        result = {"exited_early": False}
        step_start = time.perf_counter()
        self.model.train()
        watchdog = StepWatchdog(engine.rank, 60 * args.distributed_timeout_minutes) if engine.world_size > 1 \
            else None
        while self.completed_steps < args.num_training_steps:
            if watchdog:
                watchdog.arm(self.completed_steps + 1)
            step_loss, counts, grad_norm, lr = self._train_step(meter.phases)
            if watchdog:
                watchdog.disarm()
            self.completed_steps += 1
            step = self.completed_steps
            meter.add(step_loss, counts, time.perf_counter() - step_start)
            for pending in self._pending_rows:
                self._record(metrics, pending)
            self._pending_rows.clear()
            if step % args.log_interval == 0 or step == args.num_training_steps:
                self.tokens_seen += meter.take_targets()
                row = {"step": step, **meter.row(), "lr": lr, "grad_norm": float(grad_norm),
                       "tokens": self.tokens_seen, "epoch": self.train_stream.epoch}
                self._record(metrics, row)
                if engine.is_main:
                    progress.log(format_train_line(row, progress.eta(step)))
            progress.update(step)
            if args.save_interval and args.save_dir and step % args.save_interval == 0:
                self.tokens_seen += meter.take_targets()
                self._save_checkpoint()
                last["saved"] = step
            if args.eval_interval and step % args.eval_interval == 0 and self.eval_dataloader is not None:
                self._evaluate(metrics)
                last["evaluated"] = step
            if engine.any_rank(self.stop_requests.received is not None) and step < args.num_training_steps:
                if args.save_dir and last["saved"] != step:
                    self.tokens_seen += meter.take_targets()
                    self._save_checkpoint()
                result["interrupted"] = True
                break
            if args.exit_interval and step % args.exit_interval == 0 and step < args.num_training_steps:
                if args.save_dir and last["saved"] != step:
                    self.tokens_seen += meter.take_targets()
                    self._save_checkpoint()
                logger.info("exit_interval: stopping after step %d; rerun the same command to continue", step)
                result["exited_early"] = True
                break
            step_start = time.perf_counter()  # save/eval time is not part of the next step
        progress.close()
        if watchdog:
            watchdog.close()
        self.tokens_seen += meter.take_targets()
        interrupted = result.pop("interrupted", False)
        if not result["exited_early"] and not interrupted:
            self._finish(metrics, last)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        metrics.close()
        engine.barrier()
        result.update(step=self.completed_steps, tokens=self.tokens_seen)
        if interrupted:
            name = self.stop_requests.name or "a stop request on another rank"
            logger.warning("stopped after step %d on %s%s; rerun the same command to continue", self.completed_steps,
                           name, " (checkpoint saved)" if args.save_dir else " (no save_dir: nothing was saved)")
            raise TrainingInterrupted(self.completed_steps, name)
        return result

    def _train_step(self, phases: StepPhases):
        """One optimizer step over `gradient_accumulation_steps` micro-batches, averaged over all their tokens.

        Returns this rank's loss sum, the global [targets, useful tokens] (device tensors: nothing here waits
        for the device), the gradient norm and the learning rate used.
        """
        args, engine = self.pretrain_args, self.engine
        with phases.host("data"):
            host_batches = [self.hooks.next_batch(self.train_stream) for _ in range(args.gradient_accumulation_steps)]
            local_counts = torch.tensor([sum(int(count_targets(b)) for b in host_batches),
                                         sum(count_inputs(b) for b in host_batches)], dtype=torch.int64)
            micro_batches = [to_device(b, engine.device) for b in host_batches]
        # Token-weighted mean over the whole window: the loss of one big batch, whatever the split. The counts
        # are taken on the host batches and summed over ranks on the device, so no step waits for the device.
        with phases.host("comm"):
            counts = engine.reduce_counts(local_counts)
        # Data-parallel engines average gradients over replicas; scaling by their number makes the result the
        # gradient of (sum of token losses on all replicas) / (tokens on all replicas).
        scale = engine.data_world_size / counts[0].clamp(min=1)
        with phases.device("compute"):
            local_loss = engine.forward_backward(self.model, micro_batches, self.hooks.loss, scale)
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
        self._count_skipped_update(applied, grad_norm, "loss spike" if spike else "non-finite gradient norm")
        return local_loss, counts, grad_norm, lr

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

    # ---------------------------------------------------------- evaluation
    def _evaluate(self, metrics: MetricsLog) -> dict:
        result = evaluate(self.model, self.eval_dataloader, self.engine, self.pretrain_args.eval_iters)
        row = {"step": self.completed_steps, **result}
        self._record(metrics, row)
        if self.engine.is_main:
            logger.info(format_eval_line(row))
        self.model.train()
        return result

    def _record(self, metrics: MetricsLog, row: dict) -> None:
        metrics.write(row)
        self.log_history.append(row)

    # --------------------------------------------------------- checkpoints
    def _save_checkpoint(self) -> Path:
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
        saved_engine = trainer_state.get("engine")
        if (saved_engine == "deepspeed") != (self.engine.name == "deepspeed"):
            raise ConfigError(f"{path} was written by engine {saved_engine}; engine {self.engine.name} cannot read "
                              "it. Resume with the same engine or start a new save_dir.")
        if self.engine.name == "deepspeed" and trainer_state.get("world_size") != self.engine.world_size:
            raise ConfigError(f"{path} holds DeepSpeed ZeRO shards for {trainer_state.get('world_size')} "
                              f"process(es); resume it on the same number (this run has {self.engine.world_size})")
        if trainer_state.get("world_size", 1) != self.engine.world_size:
            logger.info("%s was saved by %d process(es) (%s); resharded onto %d (%s)", path,
                        trainer_state.get("world_size"), trainer_state.get("engine"), self.engine.world_size,
                        self.engine.name)
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
    def _finish(self, metrics: MetricsLog, last: dict) -> None:
        args = self.pretrain_args
        if self.eval_dataloader is not None and last["evaluated"] != self.completed_steps:
            self._evaluate(metrics)
        if args.save_dir and last["saved"] != self.completed_steps:
            self._save_checkpoint()
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
        """Write an HF folder (weights gathered by the engine, tokenizer included) on the main rank."""
        state = self.engine.full_state_dict(self.model)
        out = None
        if self.engine.is_main:
            dtype = self.pretrain_args.export_dtype or self.pretrain_args.dtype
            out = export_hf(self.engine.unwrap(self.model), state, self.tokenizer, out_dir, dtype)
        self.engine.barrier()
        return out

    def _print_banner(self, meter: IntervalMeter) -> None:
        args, engine = self.pretrain_args, self.engine
        if not engine.is_main:
            return
        for line in ("***** Running training *****",
                     f"  Num examples = {args.num_training_steps * args.batch_size}",
                     f"  Instantaneous batch size per device = {args.micro_batch_size}",
                     f"  Total train batch size (w. parallel, distributed & accumulation) = {args.batch_size}",
                     f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}",
                     f"  Total steps = {args.num_training_steps}",
                     f"  {engine.describe()}",
                     f"  Model parameters = {self.num_parameters:,}",
                     f"  LR = {args.lr:g} ({args.lr_decay_style}, warmup {args.warmup_steps_resolved()} steps, "
                     f"min {args.min_lr:g}), weight decay {args.weight_decay:g}, clip {args.clip_grad}",
                     f"  MFU = useful tokens/s per device x model FLOPs/token / peak; {meter.flops.describe()}; "
                     f"{meter.peak.describe()}"):
            logger.info(line)
        logger.info("[before the start of training step] datetime: %s", time.strftime("%Y-%m-%d %H:%M:%S"))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
