"""The data pipeline's error: bad input data, named by its file and line."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input data; the message names the file and line. `reason` groups bad records in summaries."""

    def __init__(self, message: str, reason: str = "bad data"):
        super().__init__(message)
        self.reason = reason
