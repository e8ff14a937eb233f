"""What a checkpoint folder holds and how it is checked, wherever it is stored (checkpoint.py describes the
folder)."""

from __future__ import annotations

import json
import logging
import re
import zlib
from pathlib import Path

from ..config import CHECKPOINT_STATE_FILE

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = CHECKPOINT_STATE_FILE
MANIFEST = "manifest.json"


def checkpoints_root(save_dir: str | Path) -> Path:
    return Path(save_dir) / "checkpoints"


def read_trainer_state(path: str | Path) -> dict:
    return json.loads((Path(path) / STATE_FILE).read_text())


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file()  # written last, after every rank's shards


def listed_files(folder: Path) -> list[str]:
    """The files a manifest lists: all but itself and trainer_state.json (written after it)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, STATE_FILE))


def file_entries(folder: Path, names: list[str], checksums: bool) -> dict:
    return {name: {"bytes": (folder / name).stat().st_size} | ({"crc32": _crc32(folder / name)} if checksums else {})
            for name in names}


def manifest_of(state: dict, files: dict) -> dict:
    """Step, config hash, world layout, and every file's size (and CRC-32) in the checkpoint folder."""
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


def retention_victims(steps: list[int], complete: set[int], newest: int, keep_last: int | None,
                      keep_every: int | None) -> list[int]:
    """The checkpoints (by step) to delete after `newest` is saved: all but the newest `keep_last` complete ones
    and every `keep_every`-th step; never `newest` or anything after it (incomplete folders older than it go)."""
    if not keep_last:
        return []
    done = sorted(step for step in steps if step in complete)
    keep = set(done[-keep_last:]) | {newest} | {step for step in done if keep_every and step % keep_every == 0}
    return [step for step in sorted(steps) if step not in keep and step < newest]
