"""Where a cooldown branch starts (`cooldown_from: RUN/checkpoints/step-N`, `cooldown_tokens: T`).

A branch is a new run that continues a run in its stable phase from one of its checkpoints (weights, optimizer state,
data position, token count) and decays the learning rate from the parent's value at step N to `min_lr` over T tokens
(`ScheduleSettings`; the loading is any resume's), so one long stable run serves several budgets. This module reads the
branch point and names the branch's own folder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import CHECKPOINT_STATE_FILE, BranchPoint, extra_state_file, key_error, staging_folder
from ..storage import RemoteFolder, StorageError, is_url, join_url

logger = logging.getLogger("pretrainer")

BRANCHES = "branches"  # a run's branches live in RUN/branches/<name> unless given a save_dir of their own


def read_branch_point(args) -> BranchPoint | None:
    """The checkpoint `cooldown_from` names (a folder, or its URL): its step, its run and the lr multiplier its schedule
    had reached (None without `cooldown_from`)."""
    if args.cooldown_from is None:
        return None
    folder = args.cooldown_from
    state, schedule = remote_branch_state(args) if is_url(folder) else local_branch_state(Path(folder))
    if not schedule.get("base_lrs") or not schedule.get("_last_lr"):
        raise key_error("cooldown_from", f"{folder} holds no pretrainer schedule state (a DeepSpeed JSON "
                        "scheduler or a user's lr_scheduler wrote it), so its lr at the branch point is unknown")
    ratio = schedule["_last_lr"][0] / schedule["base_lrs"][0]
    run = folder.rstrip("/").rsplit("/", 2)[0] if is_url(folder) else str(Path(folder).parent.parent)
    return BranchPoint(str(folder), run, int(state["step"]), ratio)


def local_branch_state(folder: Path) -> tuple[dict, dict]:
    """The checkpoint's trainer_state.json and rank 0's scheduler state."""
    if not (folder / CHECKPOINT_STATE_FILE).is_file():
        steps = sorted(p.name for p in (folder / "checkpoints").glob("step-*")) if folder.is_dir() else []
        hint = f" (this folder's checkpoints: {', '.join(steps)})" if steps else ""
        raise key_error("cooldown_from", f"{folder} is not a complete checkpoint folder (expected "
                        f"{CHECKPOINT_STATE_FILE} inside, e.g. RUN/checkpoints/step-1000){hint}")
    schedule = torch.load(folder / extra_state_file(0), weights_only=False).get("scheduler", {})
    return json.loads((folder / CHECKPOINT_STATE_FILE).read_text()), schedule


def remote_branch_state(args) -> tuple[dict, dict]:
    """As local_branch_state, from object storage (the checkpoint itself is downloaded when the branch starts)."""
    url = args.cooldown_from
    remote = RemoteFolder(url, args.storage_retries)
    try:
        text = remote.read_text(CHECKPOINT_STATE_FILE)
        if text is None:
            raise key_error("cooldown_from", f"{url} is not a complete checkpoint (no {CHECKPOINT_STATE_FILE} "
                            "there: its upload did not finish, or the URL names no checkpoint, e.g. "
                            "s3://bucket/run/checkpoints/step-1000)")
        local = staging_folder(url, None) / extra_state_file(0)
        remote.get_file(extra_state_file(0), local)
    except StorageError as exc:
        raise key_error("cooldown_from", str(exc)) from None
    return json.loads(text), torch.load(local, weights_only=False).get("scheduler", {})


def branch_save_dir(args, branch: BranchPoint) -> str:
    """The branch's folder: `save_dir` as given, unless it is the parent's own (its config reused): then
    RUN/branches/cooldown-step-N-T (a URL under a parent in object storage)."""
    tokens = re.sub(r"\.0$", "", f"{args.cooldown_tokens:g}".replace("+", ""))
    name = f"cooldown-step-{branch.step}-{tokens}"
    if is_url(branch.run):
        if args.save_dir is not None and args.save_dir.rstrip("/") != branch.run:
            return args.save_dir
        return join_url(branch.run, BRANCHES, name)
    if args.save_dir is not None and (is_url(args.save_dir) or
                                      Path(args.save_dir).resolve() != Path(branch.run).resolve()):
        return args.save_dir
    return str(Path(branch.run) / BRANCHES / name)


def find_branches(save_dir: str | Path) -> list[Path]:
    """The branch folders under a run (RUN/branches/*) that have metrics."""
    return sorted(p for p in (Path(save_dir) / BRANCHES).glob("*") if (p / "metrics.jsonl").is_file())


@contextmanager
def no_folder_left_if_refused(args, branch: BranchPoint | None):
    """A branch refused at start (a bad key, a model that fails to load) leaves no empty folder: the folders it creates
    (RUN/branches/<name>, RUN/branches) are removed if empty, since an empty one reads as an existing branch."""
    new = []  # the folders that do not exist yet, deepest first
    if branch is not None and args.save_dir is not None and not is_url(args.save_dir):
        folder = Path(args.save_dir).absolute()
        while not folder.exists() and folder != folder.parent:
            new.append(folder)
            folder = folder.parent
    try:
        yield
    except BaseException:
        for folder in new:  # each while it is empty (a file found keeps it and what is above)
            try:
                folder.rmdir()
            except OSError:  # not empty (another rank started writing), or already gone
                break
        raise


def branch_args(args):
    """(`args` with the branch's own save_dir, the branch point), or (`args`, None) for an ordinary run."""
    branch = read_branch_point(args)
    if branch is None:
        return args, None
    save_dir = branch_save_dir(args, branch)
    logger.info("cooldown branch of %s: decays over %g tokens into %s", branch.lineage, args.cooldown_tokens,
                save_dir)
    return dataclasses.replace(args, save_dir=save_dir), branch
