"""Errors that end a run, importable without torch (the command line maps them to exit codes)."""

import logging


class TrainingDiverged(RuntimeError):
    """Too many updates in a row were skipped for non-finite gradients."""


class CheckpointError(RuntimeError):
    """A checkpoint or export could not be written (no space, a failing disk); the previous checkpoint is untouched."""


class OutputError(RuntimeError):
    """A file of the run's record (metrics.jsonl) could not be written; the checkpoints are untouched."""


logger = logging.getLogger("pretrainer")


class CollectiveFailure(RuntimeError):
    """A collective failed or timed out: another rank died or hangs."""


def collective_failure(exc: BaseException, rank: int, step: int, timeout_minutes: float) -> CollectiveFailure:
    """The one line a rank logs and raises when a collective of `step` failed under it."""
    message = (f"rank {rank}: a collective failed at step {step} (after {timeout_minutes:g} min at most, "
               "distributed_timeout_minutes); another rank died or hangs. Rerun the same command to resume from the "
               f"last checkpoint. Cause: {str(exc).splitlines()[0][:300]}")
    logger.error(message)
    return CollectiveFailure(message)


def is_collective_failure(exc: BaseException) -> bool:
    """torch.distributed errors, and the plain RuntimeErrors gloo raises for a lost or silent peer (not a
    checkpoint's storage error, whose text may speak of a reset connection too)."""
    if isinstance(exc, CheckpointError):
        return False
    text = str(exc)
    return type(exc).__name__.startswith("Dist") or any(marker in text for marker in (
        "gloo", "NCCL", "Timed out", "timed out", "Connection closed by peer", "Connection reset by peer"))
