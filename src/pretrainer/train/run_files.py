"""A save_dir URL's files other than checkpoints (remote_checkpoints.py has those).

The run writes them in its local staging folder as it would in a local save_dir; the bucket holds the run's truth. At
the start the main rank takes `metrics.jsonl` from the bucket (a resumed run continues it, as a local one does); after
every checkpoint commit it uploads `metrics.jsonl` again (an object is replaced whole: S3 cannot append), and at the end
of the run the report, the HF export (`hf/`, replacing the previous one) and TensorBoard's event files as well.
"""

from __future__ import annotations

import logging

from ..storage import RemoteFolder, StorageError
from .errors import CheckpointError

logger = logging.getLogger("pretrainer")

METRICS = "metrics.jsonl"
OUTPUT_FOLDERS = ("report", "hf", "tensorboard")


class RunFiles:
    def __init__(self, args, is_main: bool):
        self.local, self.url = args.run_dir, args.remote_save_dir
        self.failure = args.checkpoint_failure
        # only the main rank reads and writes these files
        self.remote = RemoteFolder(args.remote_save_dir, args.storage_retries) \
            if args.remote_save_dir and is_main else None

    def pull_metrics(self) -> None:
        """The bucket's metrics.jsonl in place of any local copy (which a previous run here may have left)."""
        if self.remote is None:
            return
        local = self.local / METRICS
        local.unlink(missing_ok=True)
        if self.remote.exists(METRICS):
            self.remote.get_file(METRICS, local)

    def push_metrics(self) -> None:
        if self.remote is not None and (self.local / METRICS).is_file():
            self.remote.put_file(self.local / METRICS, METRICS)

    def push_outputs(self, engine) -> None:
        """At the end of the run (collective): metrics.jsonl, the report, the HF export and TensorBoard's files
        uploaded; an error is handled as `checkpoint_failure` says."""
        problem = None
        if self.remote is not None:
            try:
                self.push_metrics()
                for name in OUTPUT_FOLDERS:
                    if (self.local / name).is_dir():
                        self.remote.remove(name)  # a previous export's extra shards must not stay beside these
                        self.remote.put_tree(self.local / name, name)
                logger.info("uploaded the run's files to %s", self.remote.url)
            except StorageError as exc:
                problem = str(exc)
        problem = engine.broadcast_object(problem)
        if problem is None:
            return
        if self.failure == "fatal":
            raise CheckpointError(f"the run's files were not all uploaded to {self.url}: {problem}")
        logger.warning("the run's files were not all uploaded: %s (checkpoint_failure is warn)", problem)


def write_remote_report(url: str, branches: list[str] | None, attempts: int = 4) -> str:
    """`pretrainer report URL`: the run's metrics.jsonl taken from the bucket into its staging folder, the report
    written there and uploaded to URL/report (replacing the one there); returns the report's URL."""
    from ..config import staging_folder
    from .report import ReportError, write_report

    local = staging_folder(url, None)
    remote = RemoteFolder(url, attempts)
    if not remote.exists(METRICS):
        raise ReportError(f"{remote.url_of(METRICS)} does not exist: give the save_dir of a run")
    remote.get_file(METRICS, local / METRICS)
    page = write_report(local, branches)
    remote.remove("report")
    remote.put_tree(page.parent, "report")
    return remote.url_of(f"report/{page.name}")
