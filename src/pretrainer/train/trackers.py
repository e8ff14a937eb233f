"""Where metric rows go besides `metrics.jsonl`: TensorBoard event files and Weights & Biases.

`report_to` names them (`tensorboard`, `wandb`, several: comma-separated or a list; `jsonl`/`none` add nothing:
metrics.jsonl is always written). Train rows become `train/<name>` scalars, eval rows `eval/<name>`, downstream rows
keep `eval/<task>/<metric>` (with `eval/downstream_seconds`), at the row's step; event rows (start, resume) are skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import ConfigError

logger = logging.getLogger("pretrainer")

KNOWN = ("tensorboard", "wandb", "jsonl", "none", "all")


def requested(report_to) -> list[str]:
    """Tracker names; `all` (as in Accelerate's log_with) = those whose package is installed."""
    names = report_to if isinstance(report_to, list) else str(report_to or "").split(",")
    names = [n.strip().lower() for n in names if n and n.strip()]
    for name in names:
        if name not in KNOWN:
            raise ConfigError(f"key 'report_to': {name!r} is not supported; use {', '.join(KNOWN)} "
                              "(metrics.jsonl is always written)")
    if "all" in names:
        import importlib.util

        names = [n for n, module in (("tensorboard", "tensorboard"), ("wandb", "wandb"))
                 if importlib.util.find_spec(module)]
    return [n for n in names if n not in ("jsonl", "none")]


def scalars(row: dict) -> tuple[str, dict[str, float]] | None:
    """(prefix, numeric fields) of a train or eval row; None for event rows."""
    if "event" in row or "step" not in row:
        return None
    downstream = "downstream_seconds" in row  # its `tokens` is the train rows' figure: not plotted twice
    prefix = "eval" if downstream or any(k.startswith("eval_") for k in row) else "train"
    skipped, marker = (("step", "tokens"), "eval/") if downstream else (("step",), "eval_")
    return prefix, {key.removeprefix(marker): float(value) for key, value in row.items()
                    if key not in skipped and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoardTracker:
    def __init__(self, save_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("report_to: tensorboard needs the tensorboard package (pip install tensorboard, or "
                              "pip install 'pretrainer[tensorboard]')") from None
        self.folder = Path(save_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.folder))
        logger.info("TensorBoard events in %s (tensorboard --logdir %s)", self.folder, self.folder)

    def write(self, row: dict) -> None:
        found = scalars(row)
        if found:
            prefix, values = found
            for key, value in values.items():
                self.writer.add_scalar(f"{prefix}/{key}", value, global_step=row["step"])
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """Online, or offline without a network (`WANDB_MODE=offline`; `wandb sync` uploads later)."""

    def __init__(self, save_dir: str, project: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError("report_to: wandb needs the wandb package (pip install wandb)") from None
        self.run = wandb.init(project=project, dir=save_dir, config=config, resume="allow")

    def write(self, row: dict) -> None:
        found = scalars(row)
        if found:
            prefix, values = found
            self.run.log({f"{prefix}/{k}": v for k, v in values.items()}, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def open_trackers(report_to, save_dir: str | None, project: str, config: dict) -> list:
    names = requested(report_to)
    if names and not save_dir:
        raise ConfigError(f"key 'report_to': {', '.join(names)} writes under save_dir; set save_dir")
    return [TensorBoardTracker(save_dir) if name == "tensorboard" else WandbTracker(save_dir, project, config)
            for name in names]
