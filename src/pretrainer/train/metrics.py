"""Where logged values go: the console (the seed's line format), a progress bar, and `metrics.jsonl`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .errors import OutputError

logger = logging.getLogger("pretrainer")


class _StdoutHandler(logging.StreamHandler):
    """Writes to `sys.stdout` as of each record, not as of logging's setup: a caller that replaces it (a notebook cell,
    a test's output capture) gets the lines, and a stream it has since closed is never written to."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(level: int = logging.INFO) -> None:
    """`[INFO][YYYY-mm-dd HH:MM:SS,mmm]: msg`, as the seed prints."""
    root = logging.getLogger("pretrainer")
    if root.handlers:
        return
    handler = _StdoutHandler()
    handler.setFormatter(logging.Formatter("[%(levelname)s][%(asctime)s]: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


class MetricsLog:
    """Appends one JSON object per line, flushed as written; a resumed run continues the same file.
    Rows also go to the trackers `report_to` names (TensorBoard, wandb)."""

    def __init__(self, save_dir: str | None, enabled: bool = True, trackers: list | None = None):
        self.file = None
        self.path = Path(save_dir) / "metrics.jsonl" if save_dir else None
        self.trackers = trackers or []
        if self.path is not None and enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "ab", buffering=0)  # unbuffered: a row is on disk, or is not, once written

    def write(self, row: dict) -> None:
        if self.file is not None:
            self._append((json.dumps(row) + "\n").encode("utf-8"))
        for tracker in self.trackers:
            tracker.write(row)

    def _append(self, line: bytes) -> None:
        """One whole row, or none: a write cut short (a full disk) is taken back, so the file a resumed run
        continues and the report reads holds whole rows only."""
        start = os.fstat(self.file.fileno()).st_size
        try:
            written = self.file.write(line)
            if written != len(line):
                raise OSError(f"a short write, {written} of {len(line)} bytes: the disk is probably full")
        except OSError as exc:
            os.ftruncate(self.file.fileno(), start)
            raise OutputError(f"writing {self.path} failed ({exc}); free space there, then rerun the same command: "
                              "it resumes from the last checkpoint, if there is one") from None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


class Progress:
    """A tqdm bar on terminals; log lines carry the ETA so non-terminal logs have it too."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.total = total
        self.start_step = initial
        self.start_time = time.perf_counter()
        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=None if enabled else True, leave=False)

    def log(self, message: str) -> None:
        with contextlib.nullcontext() if self.bar.disable else logging_redirect_tqdm(loggers=[logger]):
            logger.info(message)

    def update(self, step: int) -> None:
        self.bar.update(step - self.bar.n)

    def eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        return format_duration((time.perf_counter() - self.start_time) / done * (self.total - step))

    def close(self) -> None:
        self.bar.close()


def format_duration(seconds: float) -> str:
    """`HH:MM:SS`, with the days before it past a day (`3d 04:05:06`); whole seconds, so any finite length
    prints (a time struct overflows past the year 9999)."""
    days, rest = divmod(int(seconds), 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {clock}" if days else clock


def format_train_line(row: dict, eta: str) -> str:
    features = ""
    if "moe_load_imbalance" in row:  # a Mixture-of-Experts model's routing over the interval
        features = (f"moe imbalance: {row['moe_load_imbalance']:.2f} | aux loss: {row['moe_aux_loss']:.4f} | "
                    + (f"dropped: {100 * row['moe_dropped_fraction']:.1f}% | " if "moe_dropped_fraction" in row
                       else "")
                    + (f"dead experts: {row['moe_dead_experts']} | " if row.get("moe_dead_experts") else ""))
    if "mtp_loss" in row:  # multi-token prediction: its mean loss and the first depth's accuracy
        features += f"mtp loss: {row['mtp_loss']:.6E} | mtp acc/1: {row['mtp_acc/1']:.4f} | "
    return (f"step: {row['step']} | elapsed time per iteration (ms): {row['elapsed_ms']:.1f} | "
            f"learning rate: {row['lr']:.3E} | lm loss: {row['loss']:.6E} | grad norm: {row['grad_norm']:.3f} | "
            f"{features}tokens/s: {row['tokens_per_s']:.0f} | MFU: {100 * row['mfu']:.1f}% | "
            f"peak mem (MB): {row['peak_mem_mb']:.0f} | eta: {eta}")


def format_eval_line(row: dict) -> str:
    return (f"validation at step: {row['step']} | eval_loss: {row['eval_loss']:.6E} | "
            f"eval_ppl: {row['eval_ppl']:.3f} | eval_acc: {row['eval_acc']:.4f}")
