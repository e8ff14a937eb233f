"""Objects copied to local disk on first use, once per machine, and again only when the object changes.

For what is read at random offsets (a prepared `.bin`'s samples) or whole many times (a task file), a GET per read would
cost a round trip each: the object is copied into a local cache and memory-mapped from there, in a folder named by its
identity (URL, size, ETag or modification time), so a replaced object is fetched again into a new folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

from .retry import StorageError, retried
from .urls import filesystem

logger = logging.getLogger("pretrainer")


def object_identity(url: str, attempts: int = 4) -> list:
    """[URL, size, version] of one object (a missing one raises StorageError naming the URL)."""
    fs, path = filesystem(url)
    info = retried(lambda: fs.info(path), f"reading {url}", attempts)
    return [url, int(info["size"]), object_version(info)]


def object_version(info: dict) -> str:
    """What changes when an object is replaced: its ETag, else its modification time (from fsspec's `info`)."""
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return str(version).strip('"')


def identity_key(identities: list[list]) -> str:
    return hashlib.sha256(json.dumps(identities, sort_keys=True).encode()).hexdigest()[:20]


def download_once(url: str, target: Path, size: int, attempts: int = 4, sha256: str | None = None) -> Path:
    """`url` at `target`, unless a copy of `size` bytes is there. Processes of one machine asking at once take turns on
    a lock beside it: the first downloads (into a temporary name, renamed when whole and, given `sha256`, checked),
    the others find it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if _whole(target, size):
        return target
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _whole(target, size):
            fs, path = filesystem(url)
            partial = target.with_name(f"{target.name}.part-{os.getpid()}")
            logger.info("copying %s (%.1f MB) into the local cache %s", url, size / 2**20, target.parent)
            retried(lambda: fs.get_file(path, str(partial)), f"downloading {url}", attempts)
            if sha256 is not None and file_sha256(partial) != sha256:
                partial.unlink()
                raise StorageError(f"{url}: its checksum is not the one its manifest lists (the object was replaced "
                                   "or damaged after it was written); write it again")
            os.replace(partial, target)
    return target


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _whole(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size
