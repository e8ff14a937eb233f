"""`PreTrainer`: the training loop, readable in one sitting.

Construction is a list of steps, cheapest checks first (the launch, the checkpoint to resume from, the seed, one
assembly of the run, the train module, the saved state, the loop's own callbacks); `train()` resumes, runs optimizer
steps until a stop rule says to leave, then exports and reports. The order and why: docs/architecture.md, 'The loop'.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from pathlib import Path

from ..config import PreTrainingArguments
from ..plan import check_memory_before_build
from ..run import launch_world
from ..run.assembly import DataSources, assemble_run
from ..run.branch import branch_args, no_folder_left_if_refused
from ..run.callbacks import TrainState
from . import checkpoint as ckpt
from .downstream import DownstreamEvaluator
from .errors import collective_failure, is_collective_failure
from .export import export_hf
from .hooks import Hooks
from .length_stages import LengthStages
from .loop_state import elect_start, loop_state, resume_run
from .metrics import setup_logging
from .remote_checkpoints import check_save_dir
from .replicas import ReplicaGroups, replica_args
from .report import write_report_logged
from .run_files import RunFiles
from .run_log import IntervalRows, LoopParts, RunLog
from .run_state import seed_everything
from .signals import StopRequests, TrainingInterrupted
from .skips import SkippedUpdates
from .spikes import SpikeGuard
from .start import check_inputs, model_ready_row, prepare_process, print_banner, start_row
from .train_module import TrainModule
from .validation import Validator
from .watchdog import StepWatchdog

logger = logging.getLogger("pretrainer")


class PreTrainer:
    def __init__(self, pretrain_args: PreTrainingArguments, accelerator=None, model=None, optimizer=None,
                 lr_scheduler=None, train_dataloader=None, eval_dataloader=None, callbacks=()):
        setup_logging()
        # a cooldown branch (cooldown_from) starts from its parent's checkpoint, in a folder of its own
        args, self.branch = branch_args(pretrain_args)
        args, self.replica_group = replica_args(args)  # a fault-tolerant run's group writes in save_dir/replica-<I>
        with no_folder_left_if_refused(args, self.branch):
            self.pretrain_args = args
            self.accelerator = accelerator
            check_inputs(args, accelerator, model, optimizer, lr_scheduler, callbacks, train_dataloader,
                         eval_dataloader)
            self.world = launch_world(args)
            self._closed = False
            self._started = time.perf_counter()
            atexit.register(_close_at_exit, weakref.ref(self))  # before the interpreter tears down (see close)
            try:
                self._assemble(args, model, optimizer, lr_scheduler, train_dataloader, eval_dataloader, callbacks)
            except BaseException:
                # In a process of its own (a script, a notebook, a test) the next PreTrainer must find no group
                # left; under a launcher the process ends with the error, which is told first (a peer's exit
                # makes the launcher stop this one).
                if self.world.size == 1:
                    self.close(barrier=False)
                raise

    def _assemble(self, args, model, optimizer, lr_scheduler, train_dataloader, eval_dataloader, callbacks) -> None:
        """After the launch: the checkpoint to resume from, the seed, the run's one assembly, the loop's parts."""
        world = self.world
        prepare_process(world)
        check_save_dir(world, args)  # a save_dir URL's bucket exists and takes writes, before anything is built
        self.resume_from, self.starting_branch = elect_start(world, args, self.branch)
        seed_everything(args.seed)
        self.hooks = Hooks(args.plugin_args)
        if model is None and self.hooks.model_provider is not None:
            model = self.hooks.build_model()
        self.optimizer_given = optimizer is not None
        run = assemble_run(args, world, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                           data=DataSources(train_dataloader, eval_dataloader, self.hooks.datasets_provider),
                           before_build=check_memory_before_build, callbacks=callbacks)
        self.resolved, self.engine, self.tokenizer = run.resolved, run.engine, run.resolved.tokenizer
        # a fault-tolerant run's group joins the lighthouse once the run is checked and built
        self.replicas = None if self.replica_group is None else ReplicaGroups(args.replica_settings,
                                                                              self.replica_group, world)
        self.model, self.optimizer, self.lr_scheduler = run.model, run.optimizer, run.scheduler
        self.train_dataloader, self.train_stream, self.eval_dataloader = train_dataloader, run.data.train, run.data.eval
        self.eval_sources = run.data.eval_sources  # a mixture's: evaluated one by one too
        self.facts, self.callbacks, self.predicted_memory, self.host_heap = run.facts, run.callbacks, \
            run.predicted_memory, run.host_heap
        self.total_steps = run.resolved.sizes.num_training_steps  # a cooldown branch derives its own
        self.model_memory = model_ready_row(self.engine, run.facts.load_stats)
        self._setup_loop()

    def _setup_loop(self) -> None:
        """The loop's counters and rules, its saved state, and what it delegates to."""
        args, engine = self.pretrain_args, self.engine
        self.train_state = TrainState()
        self.skips = SkippedUpdates(args.max_skipped_updates)
        self.stop_requests = StopRequests()
        self.spike_guard = SpikeGuard.of(args)  # None without a spike rule
        if self.replicas is not None:
            self.replicas.bind(self.model, self.optimizer, self.train_state,
                               self.resolved.sizes.global_batch_size // args.replica_settings.replica_groups,
                               self.total_steps, self.train_stream)
            self.callbacks = [*self.callbacks, self.replicas]
        self.module = TrainModule(engine, self.model, self.optimizer, self.lr_scheduler, self.hooks.loss,
                                  self.callbacks, args.clip_grad, self.skips, self.spike_guard, self.replicas)
        self.stages = LengthStages(self.resolved.sizes, engine.unwrap(self.model))
        self.log_history: list[dict] = []  # every row written to metrics.jsonl, also kept in memory
        self.state = loop_state(self)
        self.files = RunFiles(args, engine.is_main)  # a save_dir URL's metrics, report and export, uploaded
        self.files.pull_metrics()
        self.checkpointer = ckpt.Checkpointer(args, engine, self.state, self.files.push_metrics, self.callbacks) \
            if args.save_dir else None
        # The order of docs/python-api.md, 'Callbacks': evaluation after the checkpoint, so that it never costs one
        self.loop_callbacks = [IntervalRows(args.log_interval, self.total_steps, self.train_stream, self.callbacks),
                               *self.callbacks, *([self.checkpointer] if self.checkpointer is not None else []),
                               Validator(self.eval_dataloader, engine, args.eval_interval, args.eval_iters,
                                         self.eval_sources, self.stages.cut),
                               DownstreamEvaluator(args.downstream_tasks, self.tokenizer, engine,
                                                   self.resolved.sizes, args.eval_interval, self._started)]

    # ----------------------------------------------------------------- loop
    def train(self) -> dict:
        """Train to `num_training_steps` (resuming first); a stop request raises `TrainingInterrupted` after its
        checkpoint (docs/checkpoints-and-faults.md, 'Ending cleanly')."""
        self.stop_requests.install()
        try:
            return self._train()
        except BaseException as exc:
            if self.checkpointer is not None and not isinstance(exc, TrainingInterrupted):
                self.checkpointer.abandon()  # a stop request's checkpoint is complete
            if isinstance(exc, RuntimeError) and self.engine.world_size > 1 and is_collective_failure(exc):
                raise collective_failure(exc, self.engine.rank, self.train_state.step + 1,
                                         self.pretrain_args.distributed_timeout_minutes) from exc
            raise
        finally:
            self.stop_requests.uninstall()

    def close(self, barrier: bool = True) -> None:
        """End the run's use of the processes (docs/checkpoints-and-faults.md, 'Ending cleanly'); at interpreter
        exit without the `barrier`, as a peer may have failed."""
        if self._closed:
            return
        self._closed = True
        checkpointer, engine = getattr(self, "checkpointer", None), getattr(self, "engine", None)
        if checkpointer is not None:
            checkpointer.abandon()  # a clean end has completed it already
        if getattr(self, "replicas", None) is not None:
            self.replicas.close()
        self.model = self.optimizer = self.lr_scheduler = self.module = None
        self.train_stream = self.eval_dataloader = self.loop = None
        self.loop_callbacks = []  # they hold the eval data and the checkpointer
        if engine is not None:
            engine.close(barrier)
        else:  # it failed before the engine was built
            self.world.close(barrier)

    def __enter__(self) -> "PreTrainer":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.close(barrier=kind is None)

    def _train(self) -> dict:
        args, engine, state = self.pretrain_args, self.engine, self.train_state
        resume_run(self)
        self.log = log = RunLog(args, engine, self.facts.flops, self.resolved.recompute.mode, self.log_history,
                                self.callbacks)
        self.loop = LoopParts(self.model, self.optimizer, log, state)
        log.seq_length = self.stages.settle(state.step, log.meter)  # a resumed stage's RoPE, before any export
        if self.replicas is not None:
            self.replicas.start(self.loop.count_tokens)
        log.record(start_row(self, log.meter, resumed=state.step > 0 and not self.starting_branch))
        if state.step >= self.total_steps:
            logger.info("the run is already complete at step %d (num_training_steps=%d); nothing to train",
                        state.step, self.total_steps)
            self._export_to_save_dir()
            self.files.push_outputs(self.engine)
            log.close()
            return {"exited_early": False, "step": state.step, "tokens": state.tokens}
        print_banner(self, log.meter)
        watchdog = StepWatchdog(engine.rank, engine.world_size, 60 * args.distributed_timeout_minutes)
        try:
            log.start_progress(self.total_steps, state.step)
            stop = self._steps(watchdog)
        finally:  # on every way out: the watchdog thread is stopped and joined, the bar closed
            log.close_progress()
            watchdog.close()
        self.loop.count_tokens()
        if stop is None:
            self._finish()
        if self.checkpointer is not None:  # the last save and upload complete; what is only in staging is named
            self.checkpointer.end_run()
        log.close()
        engine.barrier()
        if stop == "interrupted":
            name = self.stop_requests.name or "a stop request on another rank"
            logger.warning("stopped after step %d on %s%s; rerun the same command to continue", state.step, name,
                           " (checkpoint saved)" if args.save_dir else " (no save_dir: nothing was saved)")
            raise TrainingInterrupted(state.step, name)
        return {"exited_early": stop == "exit_interval", "step": state.step, "tokens": state.tokens}

    def _steps(self, watchdog) -> str | None:
        """The step loop; returns why it left early: "interrupted", "exit_interval" or None (the last step)."""
        log, state = self.log, self.train_state
        self.model.train()
        step_start = time.perf_counter()
        while state.step < self.total_steps:
            with watchdog.watching(state.step + 1):
                if self.replicas is not None:  # the quorum; a restarted group receives the live groups' state
                    self.replicas.start_step()
                log.seq_length = self.stages.enter(state.step, log.meter)
                with log.meter.phases.host("data"):  # the step's micro-batches (gradient accumulation's, a ramp's)
                    host_batches = [self.engine.shard_batch(self.stages.cut(self.hooks.next_batch(self.train_stream)))
                                    for _ in range(self.resolved.sizes.accumulation(state.step))]
                result = self.module.step(host_batches, state, log.meter.phases, log.defer)
            if not result.committed:  # replica groups: one failed in the step, or they gather at the start
                step_start = time.perf_counter()
                continue
            log.meter.add(result.loss_sum, result.counts, time.perf_counter() - step_start)
            log.write_deferred()
            for callback in self.loop_callbacks:  # the row, the user's, the checkpoint, evaluations
                callback.after_step(result, state, self.loop)
            stop = self._stop_reason(state.step)
            if stop is not None:
                for callback in self.loop_callbacks:
                    callback.on_stop(state, self.loop)
                return stop
            step_start = time.perf_counter()  # save/eval time is not part of the next step
        return None

    def _stop_reason(self, step: int) -> str | None:
        """Whether to leave the loop after `step` before the end: a signal on any rank, or exit_interval."""
        args = self.pretrain_args
        if step >= self.total_steps:
            return None
        if self.engine.any_rank(self.stop_requests.received is not None):
            return "interrupted"
        if args.exit_interval and step % args.exit_interval == 0:
            logger.info("exit_interval: stopping after step %d; rerun the same command to continue", step)
            return "exit_interval"
        return None

    # ------------------------------------------------------------- the end
    def _finish(self) -> None:
        args = self.pretrain_args
        for callback in self.loop_callbacks:  # the last checkpoint, evaluation and scores
            callback.at_end(self.train_state, self.loop)
        self._export_to_save_dir()
        if args.save_dir and args.write_report and self.engine.is_main:
            write_report_logged(args.run_dir)
        self.files.push_outputs(self.engine)

    def _export_to_save_dir(self) -> None:
        if self.pretrain_args.save_dir and self.pretrain_args.export_hf:
            self.export(self.pretrain_args.run_dir / "hf")

    def export(self, out_dir: str | Path) -> Path | None:
        """Write an HF folder (weights streamed from the engine's shards, tokenizer included); the main rank's
        path, None on the others."""
        args = self.pretrain_args
        out = export_hf(self.engine, self.model, self.tokenizer, out_dir, args.export_dtype or self.resolved.dtype,
                        args.export_max_shard_size)
        self.engine.barrier()
        return out


def _close_at_exit(trainer: "weakref.ref[PreTrainer]") -> None:
    live = trainer()
    if live is not None:
        live.close(barrier=False)
