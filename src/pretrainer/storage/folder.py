"""A folder in object storage, addressed by paths relative to its URL, every operation retried (retry.py).

Object stores have no folders, only keys with a common prefix: a "folder" here is such a prefix, and a
listing is read fresh each time (another node may have written since), never from the client's cache.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .retry import StorageError, reason, retried
from .urls import filesystem, join_url

logger = logging.getLogger("pretrainer")

UPLOAD_WORKERS = 8  # objects in flight at once: enough to fill a node's link with checkpoint shards


class RemoteFolder:
    def __init__(self, url: str, attempts: int = 4):
        self.url = url.rstrip("/")
        self.fs, root = filesystem(self.url)
        self.root = root.rstrip("/")
        self.attempts = attempts

    def url_of(self, rel: str = "") -> str:
        return join_url(self.url, rel)

    def _path(self, rel: str) -> str:
        return "/".join([self.root, rel.strip("/")]) if rel.strip("/") else self.root

    def _retried(self, action, what: str, cancel: threading.Event | None = None):
        return retried(action, what, self.attempts, cancel=cancel)

    # ------------------------------------------------------------ objects
    def put_file(self, local: Path, rel: str, cancel: threading.Event | None = None) -> None:
        self._retried(lambda: self.fs.put_file(str(local), self._path(rel)), f"uploading {self.url_of(rel)}",
                      cancel)

    def put_text(self, rel: str, text: str) -> None:
        self._retried(lambda: self.fs.pipe_file(self._path(rel), text.encode("utf-8")),
                      f"writing {self.url_of(rel)}")

    def get_file(self, rel: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        self._retried(lambda: self.fs.get_file(self._path(rel), str(local)), f"downloading {self.url_of(rel)}")

    def read_text(self, rel: str) -> str | None:
        """The object's text, or None where there is none."""
        def read():
            try:
                return self.fs.cat_file(self._path(rel)).decode("utf-8")
            except FileNotFoundError:
                return None
        return self._retried(read, f"reading {self.url_of(rel)}")

    def exists(self, rel: str) -> bool:
        """Whether the object `rel` is there (one request; no listing of the folder)."""
        def exists():
            self.fs.invalidate_cache()
            return self.fs.isfile(self._path(rel))
        return self._retried(exists, f"reading {self.url_of(rel)}")

    # ------------------------------------------------------------ access
    def check_access(self, probe: str, need_delete: bool) -> None:
        """That this folder's bucket exists and these credentials may write, list (and, with `need_delete`,
        delete) objects in it; a refusal raises StorageError, one line naming the URL and what failed."""
        where = self.url_of(probe)
        refused = self._refusal(lambda: self.fs.pipe_file(self._path(probe), b""), f"writing {where}")
        if isinstance(refused, FileNotFoundError):
            bucket = self.url.split("://", 1)[-1].split("/", 1)[0]
            raise StorageError(f"{self.url}: no such bucket ({bucket}); create it or correct the URL")
        if refused is not None:
            raise StorageError(f"{self.url}: access denied: cannot write {where} ({reason(refused)}); give "
                               "these credentials permission to write objects under it")
        try:  # the probe is there, so the folder exists: only a refusal or an outage fails this
            refused = self._refusal(lambda: self.fs.ls(self.root, refresh=True), f"listing {self.url}")
        except StorageError as exc:
            refused = exc
        if isinstance(refused, (PermissionError, StorageError)):
            detail = str(refused) if isinstance(refused, StorageError) else reason(refused)
            raise StorageError(f"{self.url}: cannot list it ({detail}); give these credentials "
                               "permission to list the bucket (resume and retention list it)")
        refused = self._refusal(lambda: self.fs.rm_file(self._path(probe)), f"deleting {where}")
        if refused is not None and need_delete:
            raise StorageError(f"{self.url}: cannot delete {where} ({reason(refused)}); keep_last_checkpoints "
                               "deletes older checkpoints: give these credentials permission to delete objects, "
                               "or remove keep_last_checkpoints")
        if refused is not None:
            logger.warning("%s: cannot delete %s (%s); it stays there (harmless)", self.url, where, reason(refused))

    def _refusal(self, action, what: str) -> Exception | None:
        """None, or the refusal (no such object or bucket, access denied) `action` met; transient errors are
        retried, and raise StorageError once the tries are spent."""
        def attempt():
            try:
                action()
            except (FileNotFoundError, PermissionError) as exc:
                return exc
            return None
        return self._retried(attempt, what)

    # ------------------------------------------------------------ listings
    def _listing(self, rel: str, lister, empty):
        """`lister` (`fs.find` or `fs.ls`) of `rel` with details, read fresh; `empty` where nothing is there."""
        base = self._path(rel)

        def listing():
            self.fs.invalidate_cache()
            return lister(base, detail=True) if self.fs.exists(base) else empty
        return self._retried(listing, f"listing {self.url_of(rel)}")

    def sizes(self, rel: str = "") -> dict[str, int]:
        """Every object under `rel`: its path relative to `rel`, and its size in bytes."""
        base, found = self._path(rel), self._listing(rel, self.fs.find, {})
        return {name[len(base):].lstrip("/"): int(info["size"]) for name, info in found.items()
                if info.get("type") != "directory"}

    def folders(self, rel: str = "") -> list[str]:
        """The names of the folders directly under `rel`."""
        return sorted(entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in self._listing(rel, self.fs.ls, [])
                      if entry.get("type") == "directory")

    def remove(self, rel: str) -> None:
        """Delete everything under `rel` (nothing there is not an error)."""
        def remove():
            self.fs.invalidate_cache()
            if self.fs.exists(self._path(rel)):
                self.fs.rm(self._path(rel), recursive=True)
        self._retried(remove, f"deleting {self.url_of(rel)}")

    # ------------------------------------------------------------ trees
    def put_tree(self, local: Path, rel: str, names: list[str] | None = None) -> None:
        """Upload the files under `local` (or only `names`, relative to it) to `rel`, several at once. The first upload
        that gives up stops the others' retries, and its error is raised (theirs would name the cancellation)."""
        names = names if names is not None else sorted(
            p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        cancel, lock, failures = threading.Event(), threading.Lock(), []

        def upload(name: str) -> None:
            try:
                self.put_file(local / name, f"{rel}/{name}", cancel)
            except Exception as exc:
                with lock:
                    failures.append(exc)
                cancel.set()
        with ThreadPoolExecutor(UPLOAD_WORKERS) as pool:
            for future in [pool.submit(upload, name) for name in names]:
                future.result()
        if failures:
            raise failures[0]

    def get_tree(self, rel: str, local: Path) -> list[str]:
        """Download every object under `rel` into `local`; returns their relative names."""
        names = sorted(self.sizes(rel))
        with ThreadPoolExecutor(UPLOAD_WORKERS) as pool:
            for future in [pool.submit(self.get_file, f"{rel}/{name}", local / name) for name in names]:
                future.result()
        return names
