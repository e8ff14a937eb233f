"""The error object storage raises, importable without torch or fsspec."""


class StorageError(RuntimeError):
    """An object-storage operation failed (after its retries); the message is one line naming the URL."""
