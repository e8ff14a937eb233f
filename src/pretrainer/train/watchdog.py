"""A per-step watchdog for multi-process runs: a step that runs far longer than the collective timeout allows is
reported by the waiting rank, with the step, before the collective fails. Whichever process the failure reaches first
(gloo and NCCL may abort a process from their own threads), every rank's log already says which step stalled where.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

logger = logging.getLogger("pretrainer")

WARN_AT = 0.9  # of distributed_timeout_minutes


class StepWatchdog:
    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.limit = rank, WARN_AT * timeout_s
        self._step, self._deadline, self._reported = 0, None, False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None  # one process has no other rank to wait for
        if world_size > 1:
            self._thread = threading.Thread(target=self._watch, name="pretrainer-step-watchdog", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def watching(self, step: int):
        """Arm for `step` while the block runs."""
        with self._lock:
            self._step, self._deadline, self._reported = step, time.monotonic() + self.limit, False
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def close(self) -> None:
        """Stop the thread and wait for it (it wakes at least every 0.5 s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(min(0.5, self.limit / 4)):
            with self._lock:
                late = self._deadline is not None and not self._reported and time.monotonic() > self._deadline
                if late:
                    self._reported = True
                    step = self._step
            if late:
                logger.error("rank %d: step %d has run for %.0f s, 90%% of distributed_timeout_minutes; another "
                             "rank has probably died or hangs, and the next collective will fail", self.rank, step,
                             self.limit)
