"""Measurements of this machine kept across runs (`~/.cache/pretrainer/gemm_peak.json`): the GEMM peaks, the
low-precision speed-ups, the runtime baseline. Written atomically (processes of one job may write at once)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..config import write_text_whole

logger = logging.getLogger(__name__)


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "pretrainer" / "gemm_peak.json"


def read_entry(key: str):
    return _read_json(cache_path()).get(key)


def write_entry(key: str, value) -> None:
    path = cache_path()
    table = {**_read_json(path), key: value}  # read again: another process may have added its own
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_whole(path, json.dumps(table, indent=1))
    except OSError as exc:  # a read-only home: measured again next time
        logger.info("could not cache a measurement of this machine in %s (%s)", path, exc)


def cached_measurement(key: str, measure) -> float:
    """A measurement of this machine, taken once under `key` (again where the cache cannot be written)."""
    value = read_entry(key)
    if value is None:
        value = measure()
        write_entry(key, value)
    return value


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
