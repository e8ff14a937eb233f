"""`downstream_evals`: the multiple-choice tasks a run scores while it trains, read once into typed settings.

Each entry is a task file's path, or a mapping with `path` and any other field of `DownstreamTask`. The files themselves
are read by `data/tasks.py`; only the settings are checked here, so a typo fails at load.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from .errors import key_error

TASK_FORMATS = ("auto", "choices", "hellaswag", "arc", "piqa", "mmlu", "ceval")
KEY = "downstream_evals"


@dataclass(frozen=True)
class DownstreamTask:
    path: str
    name: str = ""                    # metrics keys eval/<name>/...; default: the file's stem
    format: str = "auto"              # how the file's records are laid out (TASK_FORMATS); auto: from their fields
    num_fewshot: int = 0              # solved examples put before each context
    fewshot_path: str | None = None   # where they come from (default: the task file's first records, not scored)
    limit: int | None = None          # score at most this many records (the first ones)
    every: int | None = None          # steps between scorings (default: eval_interval); always once at the end
    target_delimiter: str = " "       # between context and choice (lm-evaluation-harness's default)
    fewshot_delimiter: str = "\n\n"   # between few-shot examples


def read_downstream_tasks(value) -> tuple[DownstreamTask, ...]:
    """The tasks of `downstream_evals` (null: none), with every value checked."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise key_error(KEY, f"{KEY} is a list of task files or of {{path: ..., name: ...}} mappings, got "
                        f"{type(value).__name__}")
    tasks = tuple(_read_task(index, entry) for index, entry in enumerate(value))
    names = [task.name for task in tasks]
    for name in names:
        if names.count(name) > 1:
            raise key_error(KEY, f"two tasks are named {name!r}; give them distinct `name`s")
    return tasks


def _read_task(index: int, entry) -> DownstreamTask:
    where = f"{KEY}[{index}]"
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict):
        raise key_error(KEY, f"{where}: expected a file path or a mapping with `path`, got {entry!r}")
    known = {f.name: f for f in fields(DownstreamTask)}
    for key in entry:
        if key not in known:
            raise key_error(KEY, f"{where}: unknown key {key!r} (known: {', '.join(known)})")
    if not isinstance(entry.get("path"), str) or not entry["path"]:
        raise key_error(KEY, f"{where}: `path` (the task file) is required")
    settings = dict(entry)
    settings.setdefault("name", Path(entry["path"]).name.split(".")[0])
    for key in ("name", "format", "target_delimiter", "fewshot_delimiter"):
        if key in settings and not isinstance(settings[key], str):
            raise key_error(KEY, f"{where}.{key}: expected a string, got {settings[key]!r}")
    if not settings["name"] or any(c in settings["name"] for c in "/ "):
        raise key_error(KEY, f"{where}.name: {settings['name']!r} must be non-empty, without '/' or spaces")
    if settings.get("format", "auto") not in TASK_FORMATS:
        raise key_error(KEY, f"{where}.format: {settings['format']!r} is not one of {', '.join(TASK_FORMATS)}")
    for key, low in (("num_fewshot", 0), ("limit", 1), ("every", 1)):
        number = settings.get(key)
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < low):
            raise key_error(KEY, f"{where}.{key}: expected an integer >= {low}, got {number!r}")
    if settings.get("fewshot_path") is not None and not isinstance(settings["fewshot_path"], str):
        raise key_error(KEY, f"{where}.fewshot_path: expected a file path, got {settings['fewshot_path']!r}")
    return DownstreamTask(**settings)
