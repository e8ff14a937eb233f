"""Resumable checkpoints in `save_dir/checkpoints/step-<N>/`.

Model and optimizer state go through the engine (torch.distributed.checkpoint: each rank writes its own shards,
and a checkpoint loads on another data-parallel size, which DCP reshards). Beside them, the run's registered
state components (run_state.py): each rank's own in `extra_state_rank<R>.pt` (RNG, loss scaler, scheduler), the
run's in `trainer_state.json` (tokens, data position, ...) with the step, engine and world size; then
`config.yaml`; `trainer_state.json` is written last. All of it goes into a hidden temporary folder that is renamed
into place only when complete, so a folder named `step-<N>` is always whole; `latest` names the newest one.
`manifest.json` lists every file with its size and CRC-32, and a checkpoint that no longer matches it (truncated,
corrupted) is skipped on resume with a message naming the file. Before a save, the free space is checked against
the previous checkpoint's size; after one, older checkpoints beyond the retention settings are deleted (never
before the new one is complete).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings
import zlib
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..config import CHECKPOINT_STATE_FILE, ConfigError, extra_state_file
from ..parallel.registry import BY_NAME
from . import checkpoint_io
from .checkpoint_io import DCP
from .errors import CheckpointError
from .run_state import RunState

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = CHECKPOINT_STATE_FILE
MANIFEST = "manifest.json"
FORMAT_NAMES = {DCP: "torch.distributed.checkpoint", "deepspeed": "DeepSpeed ZeRO"}  # for messages


def checkpoints_root(save_dir: str | Path) -> Path:
    return Path(save_dir) / "checkpoints"


class Checkpointer:
    """Writes checkpoints; with `async_save`, the model/optimizer shards are written in the background.

    An asynchronous save copies the state to host memory and returns; the write finishes while training
    goes on, and the folder is completed (trainer_state.json, rename, `latest`) when the write is done:
    at the next save, or at the end of the run (`wait`). Every rank calls the same methods in order.
    """

    def __init__(self, save_dir: str | Path, engine, state: RunState, config_yaml: str, config_hash: str,
                 async_save: bool = False, keep_last: int | None = None, keep_every: int | None = None,
                 checksums: bool = True, interval: int | None = None):
        self.root = checkpoints_root(save_dir)
        self.engine, self.state = engine, state
        self.config_yaml, self.config_hash = config_yaml, config_hash
        self.interval = interval
        self.last_saved_step: int | None = None
        self.keep_last, self.keep_every, self.checksums = keep_last, keep_every, checksums
        self.async_save = async_save and engine.supports_async_save
        if async_save and not engine.supports_async_save:
            logger.info("engine %s saves checkpoints synchronously (async_checkpoint is ignored)", engine.name)
        self._pending = None

    @classmethod
    def of_run(cls, args, engine, state: RunState) -> "Checkpointer":
        """The checkpointer a config asks for (save_dir, async_checkpoint, retention, checksums, save_interval)."""
        return cls(args.save_dir, engine, state, args.to_yaml(), args.config_hash(), args.async_checkpoint,
                   keep_last=args.keep_last_checkpoints, keep_every=args.keep_checkpoints_every,
                   checksums=args.checkpoint_checksums, interval=args.save_interval)

    def is_due(self, step: int) -> bool:
        """Whether `save_interval` asks for a checkpoint after this step."""
        return bool(self.interval) and step % self.interval == 0

    def saved(self, step: int) -> bool:
        return self.last_saved_step == step

    def save(self, step: int, *, model, optimizer) -> Path:
        """Model and optimizer through the engine, and every registered component, as of `step`."""
        self.wait()
        self.last_saved_step = step
        engine = self.engine
        final, tmp = self.root / f"step-{step}", self.root / f".step-{step}.tmp"
        if engine.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        engine.barrier()  # the folder exists before any rank writes into it
        self._check_free_space()
        state = {**self.state.saved(per_rank=False), "config_hash": self.config_hash, "step": step,
                 "world_size": engine.world_size, "engine": engine.name, "checkpoint_format": engine.checkpoint_format}
        try:
            torch.save(self.state.saved(per_rank=True), tmp / extra_state_file(engine.rank))
            with _single_process_ok():
                if self.async_save:
                    self._pending = (checkpoint_io.save_state_async(engine, tmp, model, optimizer), tmp, final,
                                     state)
                    return final
                checkpoint_io.save_state(engine, tmp, model, optimizer)
        except OSError as exc:  # ENOSPC, EIO, ...: leave nothing half-written, keep the previous checkpoint
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"writing checkpoint {final} failed ({exc}); the previous checkpoint "
                                  f"{find_latest(self.root.parent, verify=False) or '(none)'} is intact") from None
        self._complete(tmp, final, state)
        return final

    def _check_free_space(self) -> None:
        """Refuse to start a save that will not fit: the previous checkpoint's size is the estimate."""
        previous = find_latest(self.root.parent, verify=False)
        if previous is None:
            return
        needed = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file())
        free = shutil.disk_usage(self.root).free
        if free < needed * 1.05:
            raise CheckpointError(f"not enough disk space for a checkpoint in {self.root}: about {needed / 2**30:.2f} "
                                  f"GiB needed (the size of {previous.name}), {free / 2**30:.2f} GiB free. Free "
                                  "space or set keep_last_checkpoints; the previous checkpoint is intact")

    def wait(self) -> None:
        """Finish an asynchronous save, if one is under way."""
        if self._pending is None:
            return
        future, *rest = self._pending
        self._pending = None
        future.result()
        self._complete(*rest)

    def abandon(self) -> None:
        """Leave an asynchronous save under way incomplete (a run that failed or ends at once): its folder is
        never completed, so it is never resumed from; the background write ends on its own."""
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
            _write_json(tmp / MANIFEST, manifest(tmp, state, self.checksums))
            _write_json(tmp / STATE_FILE, state)  # written last: marks the folder complete
            _fsync_dir(tmp)
            if final.exists():  # a replay after resume saves the same step again
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_text_atomic(self.root / "latest", final.name)
            logger.info("saved checkpoint %s", final)
            self._apply_retention(final)
        engine.barrier()

    def _apply_retention(self, newest: Path) -> None:
        """Keep the newest `keep_last` complete checkpoints and every `keep_every`-th step; delete the rest."""
        if not self.keep_last:
            return
        steps = sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name)))
        complete = [(step, p) for step, p in steps if is_complete(p)]
        keep = {p for _, p in complete[-self.keep_last:]} | {newest}
        keep |= {p for step, p in complete if self.keep_every and step % self.keep_every == 0}
        for step, path in steps:
            if path not in keep and step < int(STEP_DIR.match(newest.name).group(1)):
                shutil.rmtree(path, ignore_errors=True)
                logger.info("deleted checkpoint %s (keep_last_checkpoints=%d)", path, self.keep_last)


def read_trainer_state(path: str | Path) -> dict:
    return json.loads((Path(path) / STATE_FILE).read_text())


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
        lines = [line.strip() for line in str(exc).splitlines() if any(s in line.lower() for s in signs)]
        if not lines:
            raise
        reason = lines[0]
        raise ConfigError(f"{path} does not fit this run's model and optimizer ({reason[:300]}); it was written "
                          "for another model or layout. Resume it with the config it was written with (its "
                          "config.yaml), start a new save_dir, or set resume: none") from None


def load_model_weights(path: str | Path, model) -> None:
    """Only the model's weights from a checkpoint written by a torch-native engine (for export)."""
    with _single_process_ok():
        checkpoint_io.load_model_weights(path, model)


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file()  # written last, after every rank's shards


def manifest(folder: Path, state: dict, checksums: bool) -> dict:
    """Step, config hash, world layout, and every file's size (and CRC-32) in the checkpoint folder."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, STATE_FILE)):
        entry = {"bytes": path.stat().st_size}
        if checksums:
            entry["crc32"] = _crc32(path)
        files[path.relative_to(folder).as_posix()] = entry
    return {"step": state["step"], "config_hash": state.get("config_hash"), "engine": state["engine"],
            "world_size": state["world_size"], "files": files}


def verify_checkpoint(path: Path, checksums: bool = True) -> str | None:
    """What is wrong with a complete-looking checkpoint, or None. Older checkpoints without a manifest pass."""
    listing = path / MANIFEST
    if not listing.is_file():
        return None
    try:
        files = json.loads(listing.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"its {MANIFEST} is unreadable ({exc})"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"{name} is {size:,} bytes, its manifest says {entry['bytes']:,} (truncated or overwritten)"
        if checksums and "crc32" in entry and _crc32(file) != entry["crc32"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def find_latest(save_dir: str | Path, verify: bool = True) -> Path | None:
    """The newest complete checkpoint that matches its manifest (`latest` first, then by step)."""
    root = checkpoints_root(save_dir)
    if not root.is_dir():
        return None
    candidates = []
    pointer = root / "latest"
    if pointer.is_file():
        candidates.append(root / pointer.read_text().strip())
    steps = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))), reverse=True)
    candidates += [p for _, p in steps if p not in candidates]
    for candidate in candidates:
        if not is_complete(candidate):
            logger.warning("skipping incomplete checkpoint %s", candidate)
            continue
        problem = verify_checkpoint(candidate) if verify else None
        if problem is None:
            return candidate
        logger.warning("skipping checkpoint %s: %s", candidate, problem)
    return None


def _crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def elect_resume(world, resume: str, save_dir: str | None) -> Path | None:
    """The checkpoint to resume from, chosen (and verified against its manifest) by the main rank only and the
    same on every rank."""
    outcome = None
    if world.is_main:
        try:
            outcome = ("path", resolve_resume(resume, save_dir))
        except ConfigError as exc:
            outcome = ("error", str(exc))
    kind, value = world.broadcast_object(outcome)
    if kind == "error":
        raise ConfigError(value)
    return value


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


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns when used without a process group; for the single-process engine that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


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
