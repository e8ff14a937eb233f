"""Resumable checkpoints in `save_dir/checkpoints/step-<N>/` (the files and the resume checks:
docs/checkpoints-and-faults.md, 'Checkpoints').

Model and optimizer state go through the engine (torch.distributed.checkpoint, which reshards on load); the run's
registered state components (run_state.py) go beside them. Everything is written into a hidden temporary folder renamed
into place only when complete, so a folder named `step-<N>` is always whole; older checkpoints are deleted only after
the new one is complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..config import ConfigError, extra_state_file, staging_folder, write_text_whole
from ..parallel.registry import BY_NAME
from ..run.callbacks import Callback
from ..storage import StorageError, is_url
from . import checkpoint_io
from .checkpoint_files import (
    MANIFEST,
    STATE_FILE,
    STEP_DIR,
    checkpoints_root,
    file_entries,
    find_latest,
    is_complete,
    listed_files,
    manifest_of,
    read_trainer_state,
    retention_victims,
    verify_checkpoint,
)
from .checkpoint_io import DCP
from .errors import CheckpointError
from .remote_checkpoints import CheckpointUploads, fetch_checkpoint, locate_remote, step_folder
from .run_state import RunState

logger = logging.getLogger(__name__)

# what callers read about checkpoint folders, from checkpoint_files.py
__all__ = ["Checkpointer", "checkpoints_root", "elect_resume", "find_latest", "is_complete", "load_checkpoint",
           "read_trainer_state", "resolve_resume", "verify_checkpoint"]

RESUME_DOWNLOADS = ".resume"  # where a checkpoint in object storage is downloaded to be resumed
FORMAT_NAMES = {DCP: "torch.distributed.checkpoint", "deepspeed": "DeepSpeed ZeRO"}  # for messages


class Checkpointer(Callback):
    """Writes checkpoints: as the loop's callback, every `save_interval` steps, when the loop stops early and at
    the end (once a step). An asynchronous save's folder is completed (trainer_state.json, rename, `latest`) at
    the next save or at the end of the run (`wait`). Every rank calls the same methods in order."""

    def __init__(self, args, engine, state: RunState, after_commit=None, callbacks=()):
        """For a save_dir URL, the uploads from the staging folder, `after_commit` following each."""
        self.root = checkpoints_root(args.run_dir)
        self.uploads = None  # a save_dir URL's: each checkpoint uploaded from this (staging) folder
        if args.remote_save_dir:
            self.uploads = CheckpointUploads(args, engine, after_commit)
            self.uploads.keep_leftovers(self.root)
        self.args, self.engine, self.state = args, engine, state
        self.config_yaml, self.config_hash = args.to_yaml(), args.config_hash()
        self.last_saved_step: int | None = None
        # To a URL the slow part is the upload, which async_checkpoint moves to the background; the write to the
        # local staging folder stays synchronous, so that the upload can start from complete files.
        self.async_save = args.async_checkpoint and engine.supports_async_save and self.uploads is None
        self.last_bytes: int | None = None  # the size of the last checkpoint written here (free-space estimate)
        if args.async_checkpoint and not engine.supports_async_save:
            logger.info("engine %s saves checkpoints synchronously (async_checkpoint is ignored)", engine.name)
        self._pending = None
        self.callbacks = callbacks  # told of each checkpoint complete on disk (run/callbacks.py's on_save)

    def after_step(self, result, state, loop) -> None:
        if self.args.save_interval and state.step % self.args.save_interval == 0:
            self.at_end(state, loop)

    def at_end(self, state, loop) -> None:
        if self.last_saved_step != state.step:  # a step already saved is not written again
            loop.count_tokens()
            self.save(state.step, model=loop.model, optimizer=loop.optimizer)

    on_stop = at_end  # the loop leaving early saves its step as its end does

    def save(self, step: int, *, model, optimizer) -> Path:
        """Model and optimizer through the engine, and every registered component, as of `step`."""
        self.wait()
        self.last_saved_step = step
        engine = self.engine
        final, tmp = self.root / f"step-{step}", self.root / f".step-{step}.tmp"
        if engine.world.local_rank == 0:  # on every node: its ranks write there (a staging disk is the node's)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True, exist_ok=True)
        engine.barrier()  # the folder exists before any rank writes into it
        self._check_free_space()
        state = {**self.state.saved(per_rank=False), "config_hash": self.config_hash, "step": step,
                 "world_size": engine.world_size, "engine": engine.name, "checkpoint_format": engine.checkpoint_format}
        with self._failed_write_explained(tmp, final):
            torch.save(self.state.saved(per_rank=True), tmp / extra_state_file(engine.rank))
            with _single_process_ok():
                if self.async_save:
                    self._pending = (checkpoint_io.save_state_async(engine, tmp, model, optimizer), tmp, final,
                                     state)
                    return final
                checkpoint_io.save_state(engine, tmp, model, optimizer)
        self._complete(tmp, final, state)
        return final

    def _check_free_space(self) -> None:
        """Refuse to start a save that will not fit: the previous checkpoint's size is the estimate."""
        previous = find_latest(self.root.parent, verify=False) if self.uploads is None else None
        if previous is not None:
            needed, name = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file()), previous.name
        elif self.last_bytes is not None:  # the staged copy was deleted once uploaded
            needed, name = self.last_bytes, "the last checkpoint"
        else:
            return
        free = shutil.disk_usage(self.root).free
        if free < needed * 1.05:
            remedy = "or point staging_dir at a larger disk" if self.uploads else "or set keep_last_checkpoints"
            raise CheckpointError(f"not enough disk space for a checkpoint in {self.root}: about {needed / 2**30:.2f} "
                                  f"GiB needed (the size of {name}), {free / 2**30:.2f} GiB free. Free space "
                                  f"{remedy}; the previous checkpoint is intact")

    def end_run(self) -> None:
        """At the run's end: finish the last save (`wait`); for a save_dir URL, report what never reached the
        bucket (`CheckpointUploads.report_end`, collective)."""
        self.wait()
        if self.uploads is not None:
            self.uploads.report_end()

    def wait(self) -> None:
        """Finish an asynchronous save or upload, if one is under way."""
        if self._pending is not None:
            future, tmp, final, state = self._pending
            self._pending = None
            with self._failed_write_explained(tmp, final):
                future.result()
            self._complete(tmp, final, state)
        if self.uploads is not None:
            self.uploads.finish()

    @contextlib.contextmanager
    def _failed_write_explained(self, tmp: Path, final: Path):
        """A write that fails (ENOSPC, EIO, a file-size limit) on every rank (DCP gathers each rank's outcome)
        ends the run with one line, nothing half-written left, the previous checkpoint kept."""
        try:
            yield
        except (OSError, RuntimeError, CheckpointException) as exc:
            cause = write_failure(exc)
            if cause is None:  # not a write: a collective's failure, which the loop reports as such
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            previous = find_latest(self.root.parent, verify=False)
            kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
            raise CheckpointError(f"writing checkpoint {final} failed ({cause}); {kept}") from None

    def abandon(self) -> None:
        """Leave an asynchronous save under way incomplete (a run that failed or ends at once): its folder is
        never completed, so it is never resumed from; the background write ends on its own."""
        if self.uploads is not None:
            self.uploads.abandon()
        if self._pending is None:
            return
        _, tmp, final, _ = self._pending
        self._pending = None
        logger.warning("checkpoint %s abandoned while being written: it stays incomplete (%s) and the run resumes "
                       "from the one before it", final.name, tmp.name)

    def _complete(self, tmp: Path, final: Path, state: dict) -> None:
        engine = self.engine
        engine.barrier()  # every rank's shards are on disk
        if engine.is_main:
            (tmp / "config.yaml").write_text(self.config_yaml, encoding="utf-8")
            _fsync_dir(tmp)
            entries = file_entries(tmp, listed_files(tmp), self.args.checkpoint_checksums)
            _write_json(tmp / MANIFEST, manifest_of(state, entries))
            _write_json(tmp / STATE_FILE, state)  # written last: marks the folder complete
            _fsync_dir(tmp)
            if final.exists():  # a replay after resume saves the same step again
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_whole(self.root / "latest", final.name)
            logger.info("saved checkpoint %s", final)
            if self.uploads is None:
                self._apply_retention(state["step"])
        engine.barrier()
        if engine.world.local_rank == 0 and tmp.exists():  # a node whose staging disk is its own
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        if self.callbacks:
            engine.barrier()  # the folder is in place on every node
        for callback in self.callbacks:
            callback.on_save(state["step"], final)
        if self.uploads is not None:  # the staged copy goes once uploaded; its size is the free-space estimate
            self.last_bytes = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
            self.uploads.start(state["step"], final, state)

    def _apply_retention(self, newest: int) -> None:
        """Keep the newest `keep_last` complete checkpoints and every `keep_every`-th step; delete the rest."""
        steps = {int(m.group(1)): p for p in self.root.iterdir() if (m := STEP_DIR.match(p.name))}
        complete = {step for step, path in steps.items() if is_complete(path)}
        keep_last = self.args.keep_last_checkpoints
        for step in retention_victims(list(steps), complete, newest, keep_last, self.args.keep_checkpoints_every):
            shutil.rmtree(steps[step], ignore_errors=True)
            logger.info("deleted checkpoint %s (keep_last_checkpoints=%d)", steps[step], keep_last)


def checkpoint_format(trainer_state: dict) -> str:
    """How a checkpoint's model/optimizer state was written ("dcp" or an engine's own format)."""
    if "checkpoint_format" in trainer_state:
        return trainer_state["checkpoint_format"]
    # written before the format was recorded: the format of the engine that wrote it
    entry = BY_NAME.get(trainer_state.get("engine"))
    return entry.cls.checkpoint_format if entry is not None else DCP


def check_resumable(path: Path, trainer_state: dict, engine) -> None:
    """Refuse a checkpoint this engine cannot read (another format, or shards for another process count)."""
    saved_engine, saved_format = trainer_state.get("engine"), checkpoint_format(trainer_state)
    if saved_format != engine.checkpoint_format:
        raise ConfigError(f"{path} was written by engine {saved_engine}; engine {engine.name} cannot read it. "
                          "Resume with the same engine or start a new save_dir.")
    saved_world = trainer_state.get("world_size", 1)
    if engine.checkpoint_needs_same_world_size and saved_world != engine.world_size:
        raise ConfigError(f"{path} holds {FORMAT_NAMES.get(saved_format, saved_format)} shards for {saved_world} "
                          f"process(es); resume it on the same number (this run has {engine.world_size})")
    if saved_world != engine.world_size:
        logger.info("%s was saved by %d process(es) (%s); resharded onto %d (%s)", path, saved_world, saved_engine,
                    engine.world_size, engine.name)


def load_checkpoint(path: str | Path, *, engine, model, optimizer, state: RunState) -> dict:
    """Restore model and optimizer in place and every registered component of `state`; return the checkpoint's
    trainer_state.json (its step, config hash, ...)."""
    path = Path(path)
    trainer_state = read_trainer_state(path)
    check_resumable(path, trainer_state, engine)
    _load_engine_state(path, engine, model, optimizer)
    extra_file = path / extra_state_file(engine.rank)
    if not extra_file.is_file():  # resumed on more ranks than saved: share rank 0's
        extra_file = path / extra_state_file(0)
    state.restore(trainer_state, torch.load(extra_file, weights_only=False), str(path))
    return trainer_state


def _load_engine_state(path: Path, engine, model, optimizer) -> None:
    try:
        with _single_process_ok():
            checkpoint_io.load_state(engine, path, model, optimizer)
    except (RuntimeError, ValueError, CheckpointException) as exc:
        signs = ("missing key", "size mismatch", "shape")
        # DCP's exception carries each rank's traceback: its source lines (`raise RuntimeError(f"Missing key
        # ...{fqn}")`) match too, so only the messages are read
        lines = [line.strip() for line in str(exc).splitlines() if any(s in line.lower() for s in signs)
                 and not line.strip().startswith(("raise ", "File "))]
        if not lines:
            raise
        raise ConfigError(f"{path} does not fit this run's model and optimizer ({lines[0][:300]}); it was written "
                          "for another model or layout. Resume it with the config it was written with (its "
                          "config.yaml), or start a new save_dir") from None


def load_model_weights(path: str | Path, model) -> None:
    """Only the model's weights from a checkpoint written by a torch-native engine (for export)."""
    with _single_process_ok():
        checkpoint_io.load_model_weights(path, model)


def elect_resume(world, args) -> Path | None:
    """The checkpoint to resume from (`resume`, `save_dir`), chosen (and verified against its manifest) by the main
    rank only and the same on every rank; one in object storage is downloaded first (docs/remote-storage.md)."""
    url = args.resume if is_url(args.resume) else args.remote_save_dir if args.resume == "auto" else None
    if url is not None:
        local_root = (args.run_dir or staging_folder(url, args.staging_dir)) / RESUME_DOWNLOADS
        given_as = "key 'resume'" if url == args.resume else None  # `auto` may find none: a fresh start
        return fetch_checkpoint(world, url, local_root, args.storage_retries, given_as)
    outcome = None
    if world.is_main:
        try:
            if args.resume == "none":
                refuse_to_overwrite(args)
            outcome = ("path", resolve_resume(args.resume, args.save_dir))
        except (ConfigError, StorageError) as exc:
            outcome = ("error", str(exc))
    kind, value = world.broadcast_object(outcome)
    if kind == "error":
        raise ConfigError(value)
    return value


def refuse_to_overwrite(args) -> None:
    """`resume: none` is refused where save_dir holds an earlier run (docs/checkpoints-and-faults.md, 'Checkpoints')."""
    if not args.save_dir:
        return
    if args.remote_save_dir:
        remote, step = locate_remote(args.remote_save_dir, args.storage_retries)
        held = f"checkpoint ({remote.folder.url}/{step_folder(step)})" if step is not None else None
    else:
        latest = find_latest(args.save_dir, verify=False)
        metrics = Path(args.save_dir) / "metrics.jsonl"
        held = f"checkpoint ({latest})" if latest is not None else f"metrics ({metrics})" if metrics.is_file() \
            else None
    if held:
        origin = args.origin_of("resume")
        raise ConfigError(f"{origin + ': ' if origin else ''}key 'resume': none starts the run afresh, but save_dir "
                          f"holds an earlier run's {held}, which this run's would overwrite or join; give a new "
                          "save_dir, move that run's files away, or set resume: auto to continue it")


def resolve_resume(resume: str, save_dir: str | None, given_as: str = "key 'resume'") -> Path | None:
    """The checkpoint `resume` names (`given_as`: where the user wrote it, for the message)."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(save_dir) if save_dir else None
    path = Path(resume)
    if not is_complete(path) and checkpoints_root(path).is_dir():  # a save_dir: take its newest checkpoint
        path = find_latest(path) or path
    if not is_complete(path):
        raise ConfigError(f"{given_as}: {resume} is not a complete checkpoint folder (expected {STATE_FILE} inside, "
                          "e.g. save_dir/checkpoints/step-100) nor a save_dir holding one")
    return path


# What torch's zip writer (torch.save, and DCP's files of non-tensor items) says when a write comes up short: the
# errno of the failed write is lost on the way.
SHORT_WRITE_SIGNS = ("inline_container.cc", "PytorchStreamWriter failed writing")


def write_failure(exc: BaseException) -> str | None:
    """The cause of a failed checkpoint write in one line, or None where `exc` is not a failed write."""
    if isinstance(exc, CheckpointException):  # DCP: every rank's failure, each with its traceback
        causes = [write_failure(failure) for failure, _ in exc.failures.values()]
        return causes[0] if causes and all(causes) else None
    if isinstance(exc, OSError):
        return str(exc)
    if isinstance(exc, RuntimeError) and any(sign in str(exc) for sign in SHORT_WRITE_SIGNS):
        return f"a short write ({str(exc).splitlines()[0][:200]}): the disk is probably full"
    return None


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns when used without a process group; for the single-process engine that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")


def _fsync_dir(path: Path) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
