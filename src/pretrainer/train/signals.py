"""Stop cleanly on SIGTERM/SIGINT (preemption, Ctrl-C): finish the step, checkpoint, exit with a code of its own
(docs/checkpoints-and-faults.md, 'Faults').

The handler only records the signal; the loop asks every rank after each step whether any rank got one (one host-side
all-reduce), so all ranks stop after the same step and write the same checkpoint. One stop often arrives twice (Slurm
signals every process of the job step, and the launcher forwards it to its workers): a repeat within
`REPEAT_WINDOW_S` of the first is the same request.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger("pretrainer")

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"; a scheduler can requeue the job on this code
HANDLED = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 3.0


class TrainingInterrupted(SystemExit):
    """Raised by `PreTrainer.train()` after the checkpoint of a stop request; exits the process with
    EXIT_PREEMPTED unless caught. Rerunning the same command resumes from that checkpoint."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(EXIT_PREEMPTED)
        self.step, self.signal_name = step, signal_name


class StopRequests:
    def __init__(self):
        self.received: int | None = None
        self._received_at = 0.0
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def _handle(self, signum, frame) -> None:
        if self.received is not None and time.monotonic() - self._received_at < REPEAT_WINDOW_S:
            return  # the same stop, delivered again by another sender
        if self.received is not None:  # the second signal: stop now, without a checkpoint
            self.uninstall()
            logger.warning("second %s: aborting without a checkpoint", signal.Signals(signum).name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received, self._received_at = signum, time.monotonic()
        logger.warning("%s received: finishing this step, then checkpointing and exiting (send it again to abort "
                       "at once)", signal.Signals(signum).name)
