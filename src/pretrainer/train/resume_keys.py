"""The keys that shape what a checkpoint's state means, recorded in every checkpoint and compared when a run resumes
or a cooldown branch starts from one, before anything is built.

A resumed run that changed one of them would go on silently from a state that no longer fits it: the learning
rate jumps at the resumed step, the steps already trained are re-read from another blend (and each source's
token count recounted), a trained multi-token-prediction depth is dropped, or a cooldown branch continues
another run's checkpoint and records the wrong parent. Each group of keys is one row of `GROUPS`, with the
`override_*` key that accepts its change (the lineage has none: a branch continues only its own checkpoints).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError
from ..storage import is_url
from .checkpoint_files import STATE_FILE, read_trainer_state

# The keys that shape the learning rate (Megatron checks its optimizer-parameter scheduler the same way).
SCHEDULE_KEYS = ("lr", "muon_lr", "min_lr", "lr_decay_style", "warmup_steps", "warmup_fraction", "warmup_tokens",
                 "wsd_decay_fraction", "wsd_decay_tokens", "wsd_decay_shape", "num_training_steps",
                 "cooldown_from", "cooldown_tokens", "batch_size_schedule")
# What a cooldown branch sets for itself: its decay (from the parent's lr at the branch point) and its length.
# The rest of the schedule continues the parent's, so it must be the parent's.
BRANCH_OWN_KEYS = ("min_lr", "lr_decay_style", "wsd_decay_fraction", "wsd_decay_tokens", "wsd_decay_shape",
                   "num_training_steps", "cooldown_from", "cooldown_tokens")
RECORD = "run_keys"  # the trainer_state.json component that holds them


@dataclass(frozen=True)
class KeyGroup:
    name: str
    values: Callable          # (args, lineage) -> {key: value}, as JSON keeps it
    override: str | None      # the key that accepts a change (None: never accepted)
    consequence: str          # what the change would do, for the message
    branch_own: tuple[str, ...] = ()  # keys a branch may set apart from its parent's checkpoint


def schedule_values(args, lineage) -> dict:
    return {key: getattr(args, key) for key in SCHEDULE_KEYS} | {"cooldown_from": folder_name(args.cooldown_from),
                                                                 "seq_length_schedule sequences": stage_batches(args)}


def stage_batches(args) -> list | None:
    """The batch ramp the sequence-length stages that name `sequences` make: (first token, length, sequences)."""
    stages = args.seq_stages
    if stages is None or all(stage.sequences is None for stage in stages.stages):
        return None
    return [[stages.start_tokens(index), stage.seq_length, stage.sequences]
            for index, stage in enumerate(stages.stages)]


def length_stage_values(args, lineage) -> dict:
    """Each sequence-length stage as it trains: its end, its length (the last at the run's) and its RoPE."""
    stages = args.seq_stages
    if stages is None:
        return {"seq_length_schedule": None}
    last = len(stages.stages) - 1
    return {"seq_length_schedule": [
        {"until_tokens": stage.until_tokens, "seq_length": args.seq_length if index == last else stage.seq_length,
         "rope_theta": stage.rope_theta, "rope_scaling": stage.rope_scaling}
        for index, stage in enumerate(stages.stages)]}


def folder_name(folder: str | None) -> str | None:
    """A folder as compared: absolute (two spellings of one folder are one), a URL without its last slash."""
    if folder is None:
        return None
    return folder.rstrip("/") if is_url(folder) else str(Path(folder).resolve())


def mixture_values(args, lineage) -> dict:
    """The blend: each stage's end and normalised weights by source, each source's files (None: plain files)."""
    mixture = args.mixture
    if mixture is None:
        return {"mixture": None, "sources": None}
    return {"mixture": [{"until_tokens": stage.until_tokens, "weights": dict(zip(mixture.names, stage.weights))}
                        for stage in mixture.stages],
            "sources": {source.name: list(source.paths) for source in mixture.sources}}


def file_names(sources: dict | None) -> dict | None:
    """Each source's files as compared: by their names, so that a corpus moved to another disk or machine with
    the run is the same, and swapped or other files are not."""
    if not isinstance(sources, dict):
        return sources
    return {name: [str(path).rstrip("/").rsplit("/", 1)[-1] for path in paths] for name, paths in sources.items()}


GROUPS = (  # the lineage first: a checkpoint of another run is the one thing to say about it
    KeyGroup("lineage", lambda args, lineage: {"branch_of": lineage}, None,
             "the run would continue another run's checkpoint"),
    KeyGroup("schedule", schedule_values, "override_schedule", "the lr would jump at this step",
             BRANCH_OWN_KEYS),
    KeyGroup("mixture", mixture_values, "override_mixture",
             "the steps already trained would be read from another blend or other files, and each source's token "
             "count recounted"),
    KeyGroup("length_stages", length_stage_values, "override_schedule",
             "the steps from here on would train at other window lengths or with another RoPE than the checkpoint's "
             "run planned", ("seq_length_schedule",)),
    KeyGroup("mtp", lambda args, lineage: {"mtp_num_layers": args.mtp_num_layers}, "override_mtp",
             "a trained prediction depth's weights would be dropped"),
)


def recorded_keys(args, branch) -> dict:
    """What a checkpoint of this run records: {group: {key: value}}, as JSON reads it back. A cooldown branch's
    lineage is its parent as `RUN@step-N`, RUN as `folder_name` compares it (None for an ordinary run)."""
    lineage = None if branch is None else f"{folder_name(branch.run)}@step-{branch.step}"
    return json.loads(json.dumps({group.name: group.values(args, lineage) for group in GROUPS}, default=str))


def saved_keys(state: dict, checkpoint) -> dict:
    """The groups a checkpoint recorded (one written before the groups existed holds only its schedule)."""
    saved = state.get(RECORD) if state.get(RECORD) is not None else (
        {"schedule": state["schedule"]} if state.get("schedule") else {})
    if not (isinstance(saved, dict) and all(isinstance(keys, dict) for keys in saved.values())):
        raise ConfigError(f"{checkpoint}: its {STATE_FILE} holds no readable {RECORD!r} (a mapping of mappings, got "
                          f"{str(saved)[:80]!r}); restore the file, resume from another checkpoint, or start a new "
                          "save_dir")
    return saved


def check_resume_keys(args, branch, checkpoint: Path | None, starting_branch: bool, shown: str | None = None) \
        -> list[str]:
    """Refuse a resume (or branch start) that changes `checkpoint`'s recorded keys (docs/checkpoints-and-faults.md,
    'What a resume compares'); returns accepted changes. `shown`: the checkpoint as the user knows it (its URL)."""
    if checkpoint is None:
        return []
    saved, current = saved_keys(read_trainer_state(checkpoint), shown or checkpoint), recorded_keys(args, branch)
    if saved.get("schedule", {}).get("cooldown_from"):  # written as given by checkpoints before the groups
        saved["schedule"]["cooldown_from"] = folder_name(saved["schedule"]["cooldown_from"])
    for keys in (saved.get("mixture"), current["mixture"]):
        if keys and "sources" in keys:
            keys["sources"] = file_names(keys["sources"])
    refused, accepted = [], []
    for group in GROUPS:
        if group.name not in saved or group.name == "lineage" and (starting_branch or branch is None):
            continue  # a branch's start has no lineage yet; an ordinary run's resume of one is the schedule's
        skip = group.branch_own if starting_branch else ()
        changes = [f"{key} {_show(saved[group.name][key])} -> {_show(value)}"
                   for key, value in current[group.name].items()
                   if key not in skip and key in saved[group.name] and saved[group.name][key] != value]
        if not changes:
            continue
        impossible = _impossible(group, saved, current)
        if group.name == "lineage":
            raise ConfigError(f"resuming from {shown or checkpoint}: {impossible}")
        if impossible is None and getattr(args, group.override):
            accepted += changes
            continue
        refused.append(impossible or f"{', '.join(changes)} ({group.consequence}; set {group.override}: true to "
                                     "accept)")
    if refused:
        where = shown or checkpoint
        what, keep = (f"the cooldown branch from {where}", "the parent's values (the checkpoint's config.yaml)") \
            if starting_branch else (f"resuming from {where}", "the checkpoint's values (its config.yaml), or "
                                     "start a new save_dir")
        raise ConfigError(f"{what} would change the run's state: {'; '.join(refused)}. Keep {keep}")
    return accepted


def _impossible(group: KeyGroup, saved: dict, current: dict) -> str | None:
    """A change no override key accepts, with why (None: the group's override key decides)."""
    if group.name == "lineage":
        theirs, ours = saved["lineage"]["branch_of"], current["lineage"]["branch_of"]
        whose = f"a cooldown branch of {theirs}" if theirs else "a run that is no cooldown branch"
        return (f"the checkpoint belongs to {whose}, not to this cooldown branch of {ours}; give a branch a "
                "save_dir of its own (or the parent's: its branches go to RUN/branches/...) and no resume, which "
                "cooldown_from replaces")
    if group.name == "mtp" and current["mtp"]["mtp_num_layers"] > (before := saved["mtp"]["mtp_num_layers"]):
        after = current["mtp"]["mtp_num_layers"]
        return (f"mtp_num_layers {before} -> {after}: the checkpoint holds no weights for the added depths; resume "
                f"with mtp_num_layers: {before}, or start a new run from its export")
    return None


def _show(value) -> str:
    return repr(value) if not isinstance(value, (list, dict)) else json.dumps(value)
