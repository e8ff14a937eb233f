"""What a checkpoint keeps of the loop beside the model and optimizer: the schedule's and the loss scaler's
state, the token count, the data position, the skipped updates, the spike rules' windows, the schedule's keys
and the RNG, each registered once as a `RunState` component (run_state.py); and the resume that loads them."""

from __future__ import annotations

import logging

from ..config import ConfigError
from ..optim import realign_to_schedule
from . import checkpoint as ckpt
from .run_state import RunState, rng_state, set_rng_state

logger = logging.getLogger("pretrainer")

# The keys that shape the learning rate: a resume whose values differ is refused unless override_schedule
# (Megatron's check of its optimizer-parameter scheduler), since the lr would jump at the resumed step.
SCHEDULE_KEYS = ("lr", "min_lr", "lr_decay_style", "warmup_steps", "warmup_fraction", "warmup_tokens",
                 "wsd_decay_fraction", "wsd_decay_tokens", "wsd_decay_shape", "num_training_steps",
                 "cooldown_from", "cooldown_tokens", "batch_size_schedule")


def loop_state(trainer) -> RunState:
    """The trainer's saved state components (their keys are the checkpoint format's)."""
    state, guard, scheduler = RunState(), trainer.spike_guard, trainer.lr_scheduler
    state.register("scheduler", scheduler.state_dict, scheduler.load_state_dict, per_rank=True)
    state.register("scaler", trainer.engine.precision.state_dict, trainer.engine.precision.load_state_dict,
                   per_rank=True)
    state.register("tokens", lambda: trainer.tokens_seen, lambda tokens: setattr(trainer, "tokens_seen", int(tokens)),
                   default=0)
    state.register("data", trainer.train_stream.state_dict, trainer.train_stream.load_state_dict)
    state.register("skipped_updates", lambda: trainer.skips.total, trainer.skips.load, default=0)
    state.register("loss_history", guard.state_dict if guard else list, guard.load_state_dict if guard
                   else lambda _: None, default=[])
    state.register("schedule", lambda: schedule_keys(trainer.pretrain_args),
                   lambda saved: check_schedule(saved, trainer), default=None)
    state.register("rng", rng_state, set_rng_state, per_rank=True)  # last: loading the rest may draw numbers
    return state


def schedule_keys(args) -> dict:
    return {key: getattr(args, key) for key in SCHEDULE_KEYS}


def check_schedule(saved: dict | None, trainer) -> None:
    """Refuse to resume a run whose schedule keys changed since `saved` (a checkpoint written before the keys
    were kept passes, and so does a cooldown branch starting from its parent's checkpoint)."""
    args = trainer.pretrain_args
    if saved is None or args.override_schedule or trainer.starting_branch:
        return
    current = schedule_keys(args)
    changed = [f"{key} {saved[key]!r} -> {current[key]!r}" for key in SCHEDULE_KEYS
               if key in saved and saved[key] != current[key]]
    if changed:
        raise ConfigError(f"the schedule changed since {trainer.resume_from} was saved ({'; '.join(changed)}): "
                          "the lr would jump at the resumed step. Resume with the checkpoint's values (its "
                          "config.yaml), set override_schedule: true to continue on the new schedule from here, "
                          "or start a cooldown branch (cooldown_from, cooldown_tokens)")


def resume_run(trainer) -> None:
    """Load the checkpoint the trainer elected, if any: model, optimizer and every state component; a cooldown
    branch's first start (or override_schedule) then puts the lr on this run's schedule at that step."""
    path = trainer.resume_from
    if path is None:
        return
    peaks = list(getattr(trainer.lr_scheduler, "base_lrs", []))  # this run's, before the checkpoint's replace them
    saved = ckpt.load_checkpoint(path, engine=trainer.engine, model=trainer.model, optimizer=trainer.optimizer,
                                 state=trainer.state)
    if saved.get("config_hash") != trainer.pretrain_args.config_hash():
        logger.warning("resuming from %s, whose config differs from this run's (see its config.yaml)", path)
    trainer.completed_steps = int(saved["step"])
    if trainer.starting_branch or trainer.pretrain_args.override_schedule:  # the new schedule from this step on
        realign_to_schedule(trainer.lr_scheduler, peaks)
    logger.info("%s from %s at step %d", "cooldown branch starts" if trainer.starting_branch else "resumed", path,
                trainer.completed_steps)
