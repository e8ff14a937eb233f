"""Files in object storage (`s3://`, `gs://`, `az://`, any URL fsspec knows) as training data (docs/data.md,
'Files in object storage').

A remote file stands in for a local `Path` where the data pipeline lists, fingerprints and opens files: it is
read as a stream (never copied whole to local disk first) into the local token cache. Endpoint and credentials come
from the filesystem's own configuration; nothing here logs or stores them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

from ..storage import (
    URL,
    RemoteFolder,
    StorageError,
    download_once,
    identity_key,
    is_url,
    object_identity,
    object_version,
)
from ..storage import filesystem as storage_filesystem
from ..storage.retry import retried
from .cache_roots import remote_cache_root
from .errors import DataError
from .shard_store import MANIFEST

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
    """A prepared corpus in object storage as a local path, copied into the local cache on first use (storage/cache.py
    says why not range reads) into a folder named by its objects' identities: a Megatron prefix (its `.bin` and
    `.idx`), the folder `prepare --sharded` wrote (its manifest's shards, each checked against its checksum), or
    datatrove `.ds` / dolma `.npy` token files (one, or a folder of them)."""
    try:
        fs, path = filesystem(prefix)
        if _is_object(fs, f"{path}.bin", prefix, attempts):
            return _local_objects([f"{prefix}{suffix}" for suffix in (".bin", ".idx")], "prefixes", attempts)[:-4]
        sharded = _is_object(fs, f"{path.rstrip('/')}/{MANIFEST}", prefix, attempts)
        return (sharded and _local_shards(prefix.rstrip("/"), attempts)) or _local_token_files(prefix, attempts)
    except StorageError as exc:
        raise DataError(f"data_path {prefix}: {exc}") from None


def _is_object(fs, path: str, url: str, attempts: int) -> bool:
    return retried(lambda: fs.isfile(path), f"reading {url}", attempts)


def _local_objects(urls: list[str], kind: str, attempts: int, checksums: list | None = None) -> str:
    """The objects copied into one cache folder named by their identities; returns the first one's local path."""
    identities = [object_identity(url, attempts) for url in urls]
    folder = remote_cache_root() / kind / identity_key(identities)
    for (url, size, _), checksum in zip(identities, checksums or [None] * len(urls)):
        download_once(url, folder / url.rsplit("/", 1)[-1], size, attempts, checksum)
    return str(folder / urls[0].rsplit("/", 1)[-1])


def _local_shards(url: str, attempts: int) -> str | None:
    """The shards a manifest of `prepare --sharded` lists, checked as they are copied; None for another tool's
    manifest.json (the folder may hold token files)."""
    try:
        manifest = json.loads(RemoteFolder(url, attempts).read_text(MANIFEST) or "{}")
    except ValueError as exc:
        raise DataError(f"data_path {url}: {MANIFEST} cannot be read ({exc}); prepare the corpus again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "pretrainer-shards":
        return None
    shards = manifest.get("shards") or []
    if not shards or not all(isinstance(s, dict) and {"shard", "bin_sha256", "idx_sha256"} <= set(s) for s in shards):
        raise DataError(f"data_path {url}: {MANIFEST} lists no shards, or shards without their checksums; prepare "
                        "the corpus again")
    urls = [f"{url}/{MANIFEST}"] + [f"{url}/{s['shard']}{suffix}" for s in shards for suffix in (".bin", ".idx")]
    checksums = [None] + [s[f"{suffix}_sha256"] for s in shards for suffix in ("bin", "idx")]
    return str(Path(_local_objects(urls, "shards", attempts, checksums)).parent)


def _local_token_files(url: str, attempts: int) -> str:
    """datatrove's `.ds` (with `.ds.index` and `.ds.metadata` beside it) or dolma's `.npy`: one object, or a folder."""
    fs, path = filesystem(url)
    nothing = DataError(f"data_path {url}: no Megatron prefix (PREFIX.bin, PREFIX.idx), {MANIFEST} of `prepare "
                        "--sharded`, datatrove .ds or dolma .npy token files there")
    if not retried(lambda: fs.exists(path), f"reading {url}", attempts):
        raise nothing
    folder = URL.sub("", url).rstrip("/")  # a folder's own files, as on local disk (not those of its subfolders)
    listed = expand_remote(url, f"data_path {url}", lambda p: p.suffix in (".ds", ".npy"))
    token_files = [f for f in listed if f.suffix in (".ds", ".npy")
                   and folder in (URL.sub("", f.url), URL.sub("", f.url).rsplit("/", 1)[0])]
    if not token_files:
        raise nothing
    urls = [f.url for f in token_files]
    urls += [f"{u}{extra}" for u in urls if u.endswith(".ds") for extra in (".index", ".metadata")
             if _is_object(fs, URL.sub("", f"{u}{extra}"), url, attempts)]
    first = _local_objects(urls, "token-files", attempts)
    return first if len(token_files) == 1 and URL.sub("", url).endswith(token_files[0].suffix) else \
        str(Path(first).parent)


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
