"""What a URL is (the config's one parser, config/urls.py), and the fsspec filesystem that serves it.

Endpoint and credentials come from each filesystem's own configuration (for S3: `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `~/.aws`, or fsspec's `FSSPEC_S3_*`); nothing here logs, copies or stores them.
"""

from __future__ import annotations

import re

from ..config.urls import is_url, parse_url
from .retry import StorageError

__all__ = ["PACKAGES", "URL", "filesystem", "is_url", "join_url"]

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")  # a parsed URL's scheme and `://` (to strip them)
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def join_url(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(part.strip("/") for part in parts if part)])


def filesystem(url: str):
    """(fsspec filesystem, path) of `url`: a fresh instance, so the current endpoint and credentials apply."""
    import fsspec

    url = parse_url(url) or url
    protocol = URL.match(url).group(1)
    try:
        return fsspec.core.url_to_fs(url, skip_instance_cache=True)
    except (ImportError, ValueError) as exc:
        package = PACKAGES.get(protocol, f"the fsspec implementation of {protocol}://")
        raise StorageError(f"{url}: {protocol}:// needs {package} ({exc}); pip install 'pretrainer[s3]' for S3, "
                           "or the package fsspec names for this protocol") from None
