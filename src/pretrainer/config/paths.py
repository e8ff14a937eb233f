"""Folders a run will write into, checked when the run starts instead of at the first save; files written whole."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError

CHECKPOINT_STATE_FILE = "trainer_state.json"  # a checkpoint folder's run-level state, written last


def extra_state_file(rank: int) -> str:
    """A checkpoint's file of one rank's own state (RNG, loss scaler, schedule)."""
    return f"extra_state_rank{rank}.pt"


def check_writable_folder(path: str | Path, what: str) -> Path:
    """Create `path` (and its parents) if needed and write a probe file in it. `what` names the setting in the
    message (e.g. "key 'save_dir'")."""
    folder = Path(path)
    probe = folder / f".pretrainer-write-check-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"{what}: {folder} cannot be created or written ({reason}); choose a folder you can "
                          "write to") from None
    return folder


def write_text_whole(path: Path, text: str) -> None:
    """`path` holds `text` whole, or keeps what it held: written beside it, then renamed over it (a write cut
    short by a full disk leaves no half file, and a reader never sees one)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def staging_folder(url: str, staging_dir: str | None) -> Path:
    """The local folder a save_dir URL's files are written in before they are uploaded: `staging_dir`, or one
    named after the URL under the user's cache folder (`$XDG_CACHE_HOME`, else ~/.cache)."""
    if staging_dir:
        return Path(staging_dir)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    scheme, _, rest = url.partition("://")
    return cache / "pretrainer" / "staging" / scheme / rest.strip("/")
