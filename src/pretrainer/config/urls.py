"""The one reading of a string as an object-storage URL (`s3://bucket/path`) or a local path.

Every path a config key takes goes through `parse_url` at load (arguments.py), as does every later `is_url`
(storage/urls.py), so a string reads the same everywhere: the scheme is case-insensitive (`S3://` is `s3://`), a known
scheme with fewer than two slashes (`s3:/bucket/run`, `s3:bucket`) is a mistake, not a local folder named `s3:`, and a
bucket scheme needs its bucket (`s3://`, `s3:///run` name none). It lives in the config layer, below storage, so that
loading a config needs neither fsspec nor a client.
"""

from __future__ import annotations

import re

from .errors import ConfigError

# Schemes whose first part names a bucket or container: `s3://` alone names nothing to write to.
BUCKET_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci")
# Schemes a string with one slash or none is read as a mistyped URL of; any other `word:` stays a local name.
KNOWN_SCHEMES = (*BUCKET_SCHEMES, "file", "memory", "http", "https", "hdfs", "webhdfs", "hf", "ftp", "sftp")
URL_LIKE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/*)(.*)$", re.DOTALL)


def parse_url(text: str) -> str | None:
    """`text` as a URL (scheme lower-cased), None for a local path, or a one-line ConfigError with the fix."""
    match = URL_LIKE.match(text)
    if match is None:
        return None
    scheme, slashes, rest = match.group(1).lower(), match.group(2), match.group(3)
    if len(slashes) < 2:
        if scheme not in KNOWN_SCHEMES:
            return None  # e.g. a folder named `run:1`
        if scheme == "file":
            raise ConfigError(f"{text} is not a URL (file: needs three slashes); give the local path "
                              f"/{rest.lstrip('/')} itself")
        fixed = f"{scheme}://{rest.lstrip('/') or 'bucket/path'}"
        raise ConfigError(f"{text} is not a URL ({scheme}: needs two slashes); write {fixed}")
    after = "/" * (len(slashes) - 2) + rest  # what follows `scheme://`
    if scheme in BUCKET_SCHEMES and not after.split("/", 1)[0]:
        raise ConfigError(f"{text} names no bucket; write {scheme}://BUCKET/path (e.g. {scheme}://my-bucket/run)")
    return f"{scheme}://{after}"


def is_url(text) -> bool:
    """Whether `text` is an object-storage URL (a malformed one raises ConfigError)."""
    return isinstance(text, str) and parse_url(text) is not None
