"""Object storage (`s3://`, `gs://`, `az://`, any URL fsspec knows): URLs, retries, and a remote folder that a
run's local folder is mirrored to. The filesystem packages are extras (`pip install 'pretrainer[s3]'`)."""

from .cache import download_once, file_sha256, identity_key, object_identity, object_version
from .folder import RemoteFolder
from .retry import StorageError
from .urls import URL, filesystem, is_url, join_url

__all__ = ["URL", "RemoteFolder", "StorageError", "download_once", "file_sha256", "filesystem", "identity_key",
           "is_url", "join_url", "object_identity", "object_version"]
