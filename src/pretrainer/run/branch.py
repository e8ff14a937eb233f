"""Where a cooldown branch starts (`cooldown_from: RUN/checkpoints/step-N`, `cooldown_tokens: T`).

A branch is a new run that continues a run in its stable phase from one of its checkpoints (weights,
optimizer state, data position, token count) and decays the learning rate from the parent's value at step N
to `min_lr` over T tokens (`ScheduleSettings`; the loading is any resume's). One long stable run then
serves several budgets. This module reads the branch point and names the branch's own folder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch

from ..config import CHECKPOINT_STATE_FILE, BranchPoint, extra_state_file, key_error

logger = logging.getLogger("pretrainer")

BRANCHES = "branches"  # a run's branches live in RUN/branches/<name> unless given a save_dir of their own


def read_branch_point(args) -> BranchPoint | None:
    """The checkpoint `cooldown_from` names: its step, its run and the lr multiplier its schedule had reached
    (None without `cooldown_from`)."""
    if args.cooldown_from is None:
        return None
    folder = Path(args.cooldown_from)
    if not (folder / CHECKPOINT_STATE_FILE).is_file():
        steps = sorted(p.name for p in (folder / "checkpoints").glob("step-*")) if folder.is_dir() else []
        hint = f" (this folder's checkpoints: {', '.join(steps)})" if steps else ""
        raise key_error("cooldown_from", f"{folder} is not a complete checkpoint folder (expected "
                        f"{CHECKPOINT_STATE_FILE} inside, e.g. RUN/checkpoints/step-1000){hint}")
    step = int(json.loads((folder / CHECKPOINT_STATE_FILE).read_text())["step"])
    schedule = torch.load(folder / extra_state_file(0), weights_only=False).get("scheduler", {})
    if not schedule.get("base_lrs") or not schedule.get("_last_lr"):
        raise key_error("cooldown_from", f"{folder} holds no pretrainer schedule state (a DeepSpeed JSON "
                        "scheduler or a user's lr_scheduler wrote it), so its lr at the branch point is unknown")
    ratio = schedule["_last_lr"][0] / schedule["base_lrs"][0]
    return BranchPoint(str(folder), str(folder.parent.parent), step, ratio)


def branch_save_dir(args, branch: BranchPoint) -> str:
    """The branch's folder: `save_dir` as given, unless it is the parent's own (its config reused): then
    RUN/branches/cooldown-step-N-T."""
    if args.save_dir is not None and Path(args.save_dir).resolve() != Path(branch.run).resolve():
        return args.save_dir
    tokens = re.sub(r"\.0$", "", f"{args.cooldown_tokens:g}".replace("+", ""))
    return str(Path(branch.run) / BRANCHES / f"cooldown-step-{branch.step}-{tokens}")


def find_branches(save_dir: str | Path) -> list[Path]:
    """The branch folders under a run (RUN/branches/*) that have metrics."""
    return sorted(p for p in (Path(save_dir) / BRANCHES).glob("*") if (p / "metrics.jsonl").is_file())



def branch_args(args):
    """(`args` with the branch's own save_dir, the branch point), or (`args`, None) for an ordinary run."""
    branch = read_branch_point(args)
    if branch is None:
        return args, None
    save_dir = branch_save_dir(args, branch)
    logger.info("cooldown branch of %s: decays over %g tokens into %s", branch.lineage, args.cooldown_tokens,
                save_dir)
    return dataclasses.replace(args, save_dir=save_dir), branch
