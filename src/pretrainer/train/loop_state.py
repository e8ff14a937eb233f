"""What a checkpoint keeps of the loop beside the model and optimizer: the schedule's and the loss scaler's
state, the token count, the data position, the skipped updates, the spike rules' windows, the keys that shape
the run's state (resume_keys.py), the callbacks' own state and the RNG, each registered once as a `RunState`
component (run_state.py); and the resume that loads them."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import yaml

from ..optim import realign_to_schedule
from ..storage import is_url, join_url
from . import checkpoint as ckpt
from .checkpoint_files import STEP_DIR
from .remote_checkpoints import fetch_checkpoint
from .resume_keys import RECORD, check_resume_keys, recorded_keys
from .run_state import RunState, rng_state, set_rng_state

logger = logging.getLogger("pretrainer")


def loop_state(trainer) -> RunState:
    """The trainer's saved state components (their keys are the checkpoint format's)."""
    state, guard, scheduler = RunState(), trainer.spike_guard, trainer.lr_scheduler
    state.register("scheduler", scheduler.state_dict, scheduler.load_state_dict, per_rank=True)
    state.register("scaler", trainer.engine.precision.state_dict, trainer.engine.precision.load_state_dict,
                   per_rank=True)
    progress = trainer.train_state
    state.register("tokens", lambda: progress.tokens, progress.load_tokens, default=0)
    state.register("data", trainer.train_stream.state_dict, trainer.train_stream.load_state_dict)
    state.register("skipped_updates", lambda: trainer.skips.total, trainer.skips.load, default=0)
    state.register("loss_history", guard.state_dict if guard else list, guard.load_state_dict if guard
                   else lambda _: None, default=[])
    # checked against this run before anything is built (resume_keys.py), so loading them does nothing
    state.register(RECORD, lambda: recorded_keys(trainer.pretrain_args, trainer.branch), lambda saved: None,
                   default=None)
    for callback in trainer.callbacks:  # a feature's own saved state (a mixture's token counts)
        callback.register_state(state)
    state.register("rng", rng_state, set_rng_state, per_rank=True)  # last: loading the rest may draw numbers
    return state


def elect_start(world, args, branch) -> tuple[Path | None, bool]:
    """The checkpoint the run starts from (its own newest, else the branch point), checked by resume_keys.py, and
    whether it is a cooldown branch's first start."""
    checkpoint = ckpt.elect_resume(world, args)
    starting_branch = branch is not None and checkpoint is None
    if starting_branch:  # the branch point, downloaded first when it is a URL (collective)
        checkpoint = fetch_checkpoint(world, branch.checkpoint, args.run_dir / ckpt.RESUME_DOWNLOADS,
                                      args.storage_retries, "key 'cooldown_from'") \
            if is_url(branch.checkpoint) else Path(branch.checkpoint)
    shown = downloaded_from(args, branch, checkpoint, starting_branch)
    for change in check_resume_keys(args, branch, checkpoint, starting_branch, shown):
        logger.warning("resuming with a changed key, as its override_* key allows: %s", change)
    return checkpoint, starting_branch


def downloaded_from(args, branch, checkpoint: Path | None, starting_branch: bool) -> str | None:
    """The URL of a checkpoint downloaded from object storage (messages name it, not the local copy)."""
    if checkpoint is None:
        return None
    if starting_branch:
        return branch.checkpoint if is_url(branch.checkpoint) else None
    url = args.resume if is_url(args.resume) else args.remote_save_dir if args.resume == "auto" else None
    if url is None or STEP_DIR.match(url.rstrip("/").rsplit("/", 1)[-1]):
        return url
    return join_url(url, "checkpoints", checkpoint.name)


# How a run was started, not what it trains: a resume changes it freely (after `resume: none`, or from a path).
NOT_COMPARED = ("resume",)


def changed_keys(path: Path, args) -> list[str]:
    """The keys whose values differ from those in the checkpoint's config.yaml (none where it has none)."""
    written = path / "config.yaml"
    if not written.is_file():
        return []
    saved = yaml.safe_load(written.read_text()) or {}
    plain = functools.partial(json.dumps, sort_keys=True, default=str)
    return [key for key, value in args.to_dict().items()
            if key not in NOT_COMPARED and key in saved and plain(saved[key]) != plain(value)]


def resume_run(trainer) -> None:
    """Load the checkpoint the trainer elected, if any: model, optimizer and every state component; a cooldown
    branch's first start (or override_schedule) then puts the lr on this run's schedule at that step."""
    path = trainer.resume_from
    if path is None:
        return
    peaks = list(getattr(trainer.lr_scheduler, "base_lrs", []))  # this run's, before the checkpoint's replace them
    saved = ckpt.load_checkpoint(path, engine=trainer.engine, model=trainer.model, optimizer=trainer.optimizer,
                                 state=trainer.state)
    changed = changed_keys(path, trainer.pretrain_args)
    if changed:
        logger.warning("resuming from %s, whose config (its config.yaml) differs from this run's in: %s", path,
                       ", ".join(changed))
    trainer.train_state.step = int(saved["step"])
    if trainer.starting_branch or trainer.pretrain_args.override_schedule:  # the new schedule from this step on
        realign_to_schedule(trainer.lr_scheduler, peaks)
    logger.info("%s from %s at step %d", "cooldown branch starts" if trainer.starting_branch else "resumed", path,
                trainer.train_state.step)
