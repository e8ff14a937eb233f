"""Files in object storage (`s3://`, `gs://`, `az://`, any URL fsspec knows) as training data (docs/data.md,
'Files in object storage').

A remote file stands in for a local `Path` where the data pipeline lists, fingerprints and opens files: it is
read as a stream (never copied whole to local disk first) into the local token cache. Endpoint and credentials come
from the filesystem's own configuration; nothing here logs or stores them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

from ..storage import URL, StorageError, download_once, identity_key, is_url, object_identity, object_version
from ..storage import filesystem as storage_filesystem
from .cache_roots import remote_cache_root
from .errors import DataError

__all__ = ["URL", "RemoteFile", "expand_remote", "filesystem", "is_url", "local_file", "local_prefix",
           "with_local_prefixes"]


def filesystem(url: str):
    """(the fsspec filesystem of `url`, its path there), a missing client package told as a data error."""
    try:
        return storage_filesystem(url)
    except StorageError as exc:
        raise DataError(str(exc)) from None


class RemoteFile:
    """One object: its URL, size and version (ETag or modification time)."""

    def __init__(self, url: str, size: int, version: str):
        self.url, self.size, self.version = url, int(size), version
        self._pure = PurePosixPath(URL.sub("", url))

    @property
    def name(self) -> str:
        return self._pure.name

    @property
    def suffix(self) -> str:
        return self._pure.suffix

    @property
    def suffixes(self) -> list[str]:
        return self._pure.suffixes

    def stat(self):
        return SimpleNamespace(st_size=self.size)

    def identity(self) -> list:
        """What names this object's contents in the token cache's key."""
        return [self.url, self.size, self.version]

    def open(self, mode: str = "rb"):
        fs, path = filesystem(self.url)
        return fs.open(path, mode)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemoteFile({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemoteFile) and self.identity() == other.identity()

    def __hash__(self) -> int:
        return hash(tuple(self.identity()))


def expand_remote(pattern: str, what: str, supported) -> list[RemoteFile]:
    """The objects a URL names: one object, a glob, or a "folder" (its supported objects, sorted)."""
    fs, path = filesystem(pattern)
    protocol = URL.match(pattern).group(1)
    try:
        if any(ch in path for ch in "*?["):
            names = sorted(fs.glob(path))
            if not names:
                raise DataError(f"{what}: pattern {pattern!r} matches no object")
        elif fs.isfile(path):
            names = [path]
        elif fs.isdir(path):
            names = sorted(name for name in fs.find(path) if supported(PurePosixPath(name)))
            if not names:
                raise DataError(f"{what}: {pattern} holds no supported files")
        else:
            raise DataError(f"{what}: {pattern} does not exist")
        infos = [fs.info(name) for name in names]
        return [RemoteFile(f"{protocol}://{info['name']}", info["size"], object_version(info)) for info in infos]
    except DataError:
        raise
    except Exception as exc:  # the client's own error types (credentials, endpoint, permissions)
        raise DataError(f"{what}: listing {pattern} failed ({type(exc).__name__}: {str(exc)[:300]})") from None


# ---------------------------------------------------------------- objects copied locally on first use
def local_prefix(prefix: str, attempts: int = 4) -> str:
    """A prepared prefix in object storage as a local prefix: its `.bin` and `.idx` copied into the local cache on
    first use (storage/cache.py says why not range reads), into a folder named by both objects' identities."""
    try:
        identities = [object_identity(prefix + suffix, attempts) for suffix in (".bin", ".idx")]
        folder = remote_cache_root() / "prefixes" / identity_key(identities)
        name = prefix.rstrip("/").rsplit("/", 1)[-1]
        for suffix, (url, size, _) in zip((".bin", ".idx"), identities):
            download_once(url, folder / f"{name}{suffix}", size, attempts)
    except StorageError as exc:
        raise DataError(f"data_path {prefix}: {exc}") from None
    return str(folder / name)


def local_file(url: str, what: str, attempts: int = 4) -> Path:
    """One object (a task file) as a local file in the cache, copied on first use."""
    try:
        identity = object_identity(url, attempts)
        name = url.rstrip("/").rsplit("/", 1)[-1]
        return download_once(url, remote_cache_root() / "files" / identity_key([identity]) / name, identity[1],
                             attempts)
    except StorageError as exc:
        raise DataError(f"{what}: {exc}") from None


def with_local_prefixes(args):
    """`args` with every prefix URL in `data_path` (or `dataloader_config.data_path`) replaced by its local copy;
    the run's own arguments (its config copy and hash) keep the URLs."""
    def local(item):
        if isinstance(item, str):
            return " ".join(local_prefix(word, args.storage_retries) if is_url(word) else word
                            for word in item.split()) if any(is_url(w) for w in item.split()) else item
        if isinstance(item, dict) and isinstance(item.get("path"), str) and is_url(item["path"]):
            return {**item, "path": local_prefix(item["path"], args.storage_retries)}
        return item

    def localized(value):
        return [local(item) for item in value] if isinstance(value, list) else local(value)
    loader = args.get_dataloader_config()
    changes = {"data_path": localized(args.data_path)}
    if "data_path" in loader:
        changes["dataloader_config"] = {**loader, "data_path": localized(loader["data_path"])}
    return dataclasses.replace(args, **changes)
