"""Resumable checkpoints in `save_dir/checkpoints/step-<N>/`.

Model and optimizer state go through torch.distributed.checkpoint (each rank
writes its own shards; a checkpoint can be loaded on another data-parallel size,
which DCP reshards). Beside them: `extra_state_rank<R>.pt` (RNG, loss scaler,
scheduler), `config.yaml`, and `trainer_state.json` (step, tokens, data position),
written last. All of it goes into a hidden temporary folder that is renamed into
place only when complete, so a folder named `step-<N>` is always whole; `latest`
names the newest one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from ..config import ConfigError

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"


def checkpoints_root(save_dir: str | Path) -> Path:
    return Path(save_dir) / "checkpoints"


class Checkpointer:
    """Writes checkpoints; with `async_save`, the model/optimizer shards are written in the background.

    An asynchronous save copies the state to host memory and returns; the write finishes while training
    goes on, and the folder is completed (trainer_state.json, rename, `latest`) when the write is done:
    at the next save, or at the end of the run (`wait`). Every rank calls the same methods in order.
    """

    def __init__(self, save_dir: str | Path, engine, async_save: bool = False):
        self.root = checkpoints_root(save_dir)
        self.engine = engine
        self.async_save = async_save and engine.supports_async_save
        if async_save and not engine.supports_async_save:
            logger.info("engine %s saves checkpoints synchronously (async_checkpoint is ignored)", engine.name)
        self._pending = None

    def save(self, step: int, *, model, optimizer, scheduler_state: dict, trainer_state: dict,
             config_yaml: str) -> Path:
        self.wait()
        engine = self.engine
        final, tmp = self.root / f"step-{step}", self.root / f".step-{step}.tmp"
        if engine.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        engine.barrier()
        torch.save({"rng": rng_state(), "scaler": engine.precision.state_dict(), "scheduler": scheduler_state},
                   tmp / f"extra_state_rank{engine.rank}.pt")
        state = {**trainer_state, "step": step, "world_size": engine.world_size, "engine": engine.name}
        with _single_process_ok():
            if self.async_save:
                self._pending = (engine.save_state_async(tmp, model, optimizer), tmp, final, state, config_yaml)
                return final
            engine.save_state(tmp, model, optimizer)
        self._complete(tmp, final, state, config_yaml)
        return final

    def wait(self) -> None:
        """Finish an asynchronous save, if one is under way."""
        if self._pending is None:
            return
        future, *rest = self._pending
        self._pending = None
        future.result()
        self._complete(*rest)

    def _complete(self, tmp: Path, final: Path, state: dict, config_yaml: str) -> None:
        engine = self.engine
        engine.barrier()  # every rank's shards are on disk
        if engine.is_main:
            (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
            _write_json(tmp / STATE_FILE, state)  # written last: marks the folder complete
            _fsync_dir(tmp)
            if final.exists():  # a replay after resume saves the same step again
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_text_atomic(self.root / "latest", final.name)
            logger.info("saved checkpoint %s", final)
        engine.barrier()


def read_trainer_state(path: str | Path) -> dict:
    return json.loads((Path(path) / STATE_FILE).read_text())


def load_checkpoint(path: str | Path, *, engine, model, optimizer) -> dict:
    """Restore model and optimizer in place; return this rank's extra state (RNG, scaler, scheduler)."""
    path = Path(path)
    with _single_process_ok():
        engine.load_state(path, model, optimizer)
    extra_file = path / f"extra_state_rank{engine.rank}.pt"
    if not extra_file.is_file():  # resumed on more ranks than saved: share rank 0's
        extra_file = path / "extra_state_rank0.pt"
    return torch.load(extra_file, weights_only=False)


def load_model_weights(path: str | Path, *, engine, model) -> None:
    """Only the model's weights from a checkpoint written by a torch-native engine (for export)."""
    state = {"model": get_model_state_dict(model)}
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file()  # written last, after every rank's shards


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
        raise ConfigError(f"key 'resume': {resume} is not a complete checkpoint folder (expected {STATE_FILE} "
                                "inside, e.g. save_dir/checkpoints/step-100) nor a save_dir holding one")
    return path


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns when used without a process group; for the single-process engine that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


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
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
