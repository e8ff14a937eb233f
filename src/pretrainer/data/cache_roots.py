"""Where the data caches live when `data_cache_path` does not say: `$PRETRAINER_CACHE_DIR`, else
`$XDG_CACHE_HOME/pretrainer` (~/.cache/pretrainer): token stores under `tokenized/`, local copies of objects in
object storage under `remote/`."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PRETRAINER_CACHE_DIR"


def default_cache_root() -> Path:
    """The token stores' folder."""
    return Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else _user_cache() / "tokenized"


def remote_cache_root() -> Path:
    """The local copies of prepared prefixes and task files read by URL."""
    return Path(os.environ.get(CACHE_ENV) or _user_cache()) / "remote"


def _user_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pretrainer"
