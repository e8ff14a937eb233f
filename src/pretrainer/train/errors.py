"""Errors that end a run, importable without torch (the command line maps them to exit codes)."""


class TrainingDiverged(RuntimeError):
    """Too many updates in a row were skipped for non-finite gradients."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (no space, a failing disk); the previous one is untouched."""


class CollectiveFailure(RuntimeError):
    """A collective failed or timed out: another rank died or hangs."""


def is_collective_failure(exc: BaseException) -> bool:
    """torch.distributed errors, and the plain RuntimeErrors gloo raises for a lost or silent peer."""
    name = type(exc).__name__
    text = str(exc)
    return name.startswith("Dist") or any(marker in text for marker in (
        "gloo", "NCCL", "Timed out", "timed out", "Connection closed by peer", "Connection reset by peer"))
