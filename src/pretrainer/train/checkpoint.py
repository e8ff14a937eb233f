"""Resumable checkpoints in `save_dir/checkpoints/step-<N>/`.

A checkpoint is written into a hidden temporary folder and renamed into place
only when complete, so a folder named `step-<N>` is always whole; `latest`
names the newest one. Contents: model and optimizer state, scheduler, loss
scaler, RNG states, data position, counters and the config used.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"


def checkpoints_root(save_dir: str | Path) -> Path:
    return Path(save_dir) / "checkpoints"


def save_checkpoint(save_dir: str | Path, step: int, *, model_state: dict, optimizer_state: dict,
                    scheduler_state: dict, scaler_state: dict, trainer_state: dict, config_yaml: str) -> Path:
    root = checkpoints_root(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(model_state, tmp / "model.pt")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save({"scheduler": scheduler_state, "scaler": scaler_state, "rng": rng_state()}, tmp / "extra_state.pt")
    (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
    _write_json(tmp / STATE_FILE, {**trainer_state, "step": step})  # written last: marks the folder complete
    _fsync_dir(tmp)
    if final.exists():  # a replay after resume saves the same step again
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_text_atomic(root / "latest", final.name)
    logger.info("saved checkpoint %s", final)
    return final


def load_checkpoint(path: str | Path) -> dict:
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    extra = torch.load(path / "extra_state.pt", weights_only=False)
    return {
        "model": torch.load(path / "model.pt", map_location="cpu", weights_only=True),
        "optimizer": torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False),
        "scheduler": extra["scheduler"],
        "scaler": extra["scaler"],
        "rng": extra["rng"],
        "trainer_state": json.loads((path / STATE_FILE).read_text()),
    }


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / "model.pt").is_file()


def find_latest(save_dir: str | Path) -> Path | None:
    """The checkpoint named by `latest`, or else the highest complete `step-<N>`."""
    root = checkpoints_root(save_dir)
    if not root.is_dir():
        return None
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if is_complete(candidate):
            return candidate
        logger.warning("checkpoint pointer %s names %s, which is not complete; looking for another", pointer,
                       candidate)
    steps = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))), reverse=True)
    for _, candidate in steps:
        if is_complete(candidate):
            return candidate
        logger.warning("skipping incomplete checkpoint %s", candidate)
    return None


def resolve_resume(resume: str, save_dir: str | None) -> Path | None:
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(save_dir) if save_dir else None
    path = Path(resume)
    if not is_complete(path) and checkpoints_root(path).is_dir():  # a save_dir: take its newest checkpoint
        path = find_latest(path) or path
    if not is_complete(path):
        raise ConfigError(f"key 'resume': {resume} is not a complete checkpoint folder (expected {STATE_FILE} and "
                                "model.pt inside, e.g. save_dir/checkpoints/step-100) nor a save_dir holding one")
    return path


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    for child in path.iterdir():
        with open(child, "rb") as f:
            os.fsync(f.fileno())
