"""Transient object-storage errors retried with exponential backoff, each retry logged with its count."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("pretrainer")

# Answers that another try cannot change: a missing object, refused credentials, a wrong kind of path.
PERMANENT = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)


class StorageError(RuntimeError):
    """An object-storage operation failed (after its retries); the message is one line naming the URL."""


def retried(action, what: str, attempts: int = 4, delay: float = 1.0, cancel: threading.Event | None = None):
    """`action()`, tried up to `attempts` times with `delay`, 2 x `delay`, ... between tries, then a StorageError whose
    one line says `what` failed and why. `cancel` set (another upload of the batch gave up) stops further tries."""
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except PERMANENT as exc:
            raise StorageError(f"{what} failed: {reason(exc)}") from None
        except Exception as exc:  # the clients' own error types (connection, throttling, server errors)
            if attempt == attempts or (cancel is not None and cancel.is_set()):
                raise StorageError(f"{what} failed after {attempt} attempt(s): {reason(exc)}") from None
            wait = delay * 2 ** (attempt - 1)
            logger.warning("%s: attempt %d of %d failed (%s); retrying in %.0f s", what, attempt, attempts,
                           reason(exc), wait)
            if cancel is not None:
                cancel.wait(wait)
            else:
                time.sleep(wait)
    raise AssertionError("unreachable")


def reason(exc: BaseException) -> str:
    """An exception in one line: its type and its text, cut at 300 characters."""
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
