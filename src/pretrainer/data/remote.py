"""Files in object storage (`s3://`, `gs://`, `az://`, any URL fsspec knows) as training data.

A remote file stands in for a local `Path` where the data pipeline lists, fingerprints and opens files: it is
read as a stream (never copied whole to local disk first) into the local token cache, which then serves every
later run. Its fingerprint is its URL, size and version (the ETag, else the modification time), so a changed
object is tokenized again. Endpoint and credentials come from the filesystem's own configuration (for S3:
`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `~/.aws`, or fsspec's `FSSPEC_S3_*`); nothing
here logs or stores them. The filesystem package is an extra: `pip install 'pretrainer[s3]'` (s3fs).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from types import SimpleNamespace

from .errors import DataError

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def is_url(text: str) -> bool:
    return bool(URL.match(str(text)))


def filesystem(url: str):
    """(the fsspec filesystem of `url`, its path there); a fresh instance, so the environment of this moment
    (endpoint, credentials) applies."""
    import fsspec

    protocol = URL.match(url).group(1)
    try:
        return fsspec.core.url_to_fs(url, skip_instance_cache=True)
    except (ImportError, ValueError) as exc:
        package = PACKAGES.get(protocol, f"the fsspec implementation of {protocol}://")
        raise DataError(f"{url}: reading {protocol}:// needs {package} ({exc}); pip install 'pretrainer[s3]' for "
                        "S3, or the package fsspec names for this protocol") from None


class RemoteFile:
    """One object: its URL, size and version (ETag or modification time)."""

    def __init__(self, url: str, size: int, version: str):
        self.url, self.size, self.version = url, int(size), version
        self._pure = PurePosixPath(URL.sub("", url))

    @staticmethod
    def of(protocol: str, info: dict) -> "RemoteFile":
        version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
        return RemoteFile(f"{protocol}://{info['name']}", info["size"], str(version).strip('"'))

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
        return [RemoteFile.of(protocol, fs.info(name)) for name in names]
    except DataError:
        raise
    except Exception as exc:  # the client's own error types (credentials, endpoint, permissions)
        raise DataError(f"{what}: listing {pattern} failed ({type(exc).__name__}: {str(exc)[:300]})") from None
