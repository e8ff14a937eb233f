"""Where `prepare --sharded` keeps its shards: a local (or shared) folder, or a folder in object storage (docs/data.md,
'A corpus on a cluster').

Both answer the same questions for shards.py: where a task writes its shard, how a finished shard is published (its
completion record last), which records hold, and the manifest. A local shard is written in place and checked by its
checksums; a shard bound for object storage is written to a local temporary folder, uploaded (`.bin`, `.idx`, then the
record) and checked by its objects' sizes, so no node needs a shared file system.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import write_text_whole
from ..storage import RemoteFolder, StorageError, is_url
from ..storage import file_sha256 as sha256
from .errors import DataError
from .indexed import remove_stale_partial_files

MANIFEST = "manifest.json"
RECORD = ".done.json"
READERS = 16  # records read at once from object storage when a rerun checks which shards are done


def shard_store(location: str):
    """The store of the folder `location` (a path, or a URL)."""
    return RemoteShards(location) if is_url(location) else LocalShards(location)


class LocalShards:
    def __init__(self, location: str):
        self.location, self.folder = location, Path(location)

    def begin(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        remove_stale_partial_files(self.folder)  # of tasks killed on this machine before they finished

    def writer_prefix(self, name: str) -> Path:
        return self.folder / name

    def publish(self, name: str, record: dict, written: Path | None = None) -> None:
        write_text_whole(self.folder / f"{name}{RECORD}", json.dumps(record, indent=1))

    def discard(self, written: Path) -> None:
        """Nothing: a failed writer removed its own temporary files."""

    def present(self, name: str, record: dict) -> bool:
        """The shard's files are here with the sizes its record holds (the driver sees what the tasks wrote)."""
        return all((self.folder / f"{name}.{suffix}").is_file()
                   and (self.folder / f"{name}.{suffix}").stat().st_size == record.get(f"{suffix}_bytes")
                   for suffix in ("bin", "idx"))

    def records(self, names: list[str]) -> dict[str, dict]:
        found = {}
        for name in names:
            try:
                found[name] = json.loads((self.folder / f"{name}{RECORD}").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
        return found

    def holds(self, name: str, record: dict) -> bool:
        """The shard's files are there with the checksums its record holds."""
        files = {suffix: self.folder / f"{name}.{suffix}" for suffix in ("bin", "idx")}
        return all(path.is_file() and sha256(path) == record.get(f"{suffix}_sha256") for suffix, path in files.items())

    def remove_manifest(self) -> None:
        (self.folder / MANIFEST).unlink(missing_ok=True)

    @contextlib.contextmanager
    def finishing(self):
        """The last check of the records and the manifest, one run at a time (a lock file in the folder)."""
        with open(self.folder / ".manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def write_manifest(self, text: str) -> None:
        write_text_whole(self.folder / MANIFEST, text)


class RemoteShards:
    def __init__(self, location: str, attempts: int = 4):
        self.location = location.rstrip("/")
        try:
            self.remote = RemoteFolder(self.location, attempts)
        except StorageError as exc:
            raise DataError(f"--output-prefix {location}: {exc}") from None
        self._sizes: dict[str, int] | None = None

    def begin(self) -> None:
        """That these credentials may write, list and delete there, checked before any tokenizing."""
        self._storage(lambda: self.remote.check_access(".pretrainer-access-probe", need_delete=True))

    def writer_prefix(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"pretrainer-{name}-")) / name

    def publish(self, name: str, record: dict, written: Path | None = None) -> None:
        """The shard at `written` (its writer prefix) uploaded, then its record; the local copy removed."""
        try:
            for suffix in (".bin", ".idx"):
                self._storage(lambda s=suffix: self.remote.put_file(Path(f"{written}{s}"), f"{name}{s}"))
            self._storage(lambda: self.remote.put_text(f"{name}{RECORD}", json.dumps(record, indent=1)))
        finally:
            shutil.rmtree(written.parent, ignore_errors=True)

    def discard(self, written: Path) -> None:
        """The local folder of a shard that failed before its upload."""
        shutil.rmtree(written.parent, ignore_errors=True)

    def present(self, name: str, record: dict) -> bool:
        return True  # uploaded by the task itself before it returned its record

    def records(self, names: list[str]) -> dict[str, dict]:
        self._sizes = self._storage(self.remote.sizes)  # one listing serves every `holds`
        present = [name for name in names if f"{name}{RECORD}" in self._sizes]
        with ThreadPoolExecutor(READERS) as pool:
            texts = list(pool.map(lambda n: self._storage(lambda: self.remote.read_text(f"{n}{RECORD}")), present))
        found = {}
        for name, text in zip(present, texts):
            try:
                found[name] = json.loads(text)
            except (TypeError, ValueError):
                continue
        return found

    def holds(self, name: str, record: dict) -> bool:
        """The shard's objects are there with the sizes its record holds (their checksums are checked when training
        copies them to local disk)."""
        sizes = self._sizes or {}
        return all(sizes.get(f"{name}.{suffix}") == record.get(f"{suffix}_bytes") for suffix in ("bin", "idx"))

    def remove_manifest(self) -> None:
        self._storage(lambda: self.remote.remove(MANIFEST))

    @contextlib.contextmanager
    def finishing(self):
        """Object storage has no lock: parts finishing in the same moment may each miss the other's last record,
        and then a rerun of either writes the manifest (it tokenizes nothing)."""
        yield

    def write_manifest(self, text: str) -> None:
        self._storage(lambda: self.remote.put_text(MANIFEST, text))

    def _storage(self, action):
        try:
            return action()
        except StorageError as exc:
            raise DataError(f"--output-prefix {self.location}: {exc}") from None


def is_sharded(folder: Path) -> bool:
    """Whether `folder` holds the manifest of `prepare --sharded` (another tool's manifest.json is not one)."""
    try:
        return bool(read_manifest(folder))
    except DataError:
        return (folder / MANIFEST).is_file()  # ours, damaged: read_manifest says so where it is read


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        return manifest if isinstance(manifest, dict) and manifest.get("format") == "pretrainer-shards" else {}
    except (OSError, ValueError) as exc:
        raise DataError(f"data_path {folder}: {MANIFEST} cannot be read ({exc}); prepare the corpus again") from None

