"""The one error type for configuration problems; its message says where the problem is and how to fix it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, with where it is and how to fix it in the message."""


def key_error(key: str, message: str) -> ConfigError:
    """A ConfigError about one top-level key; the loader prefixes the file and line where that key stands."""
    exc = ConfigError(f"key {key!r}: {message}")
    exc.key = key
    return exc
