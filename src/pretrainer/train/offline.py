"""A trained model outside the training loop: an HF folder's, or a checkpoint's weights in the model its run
configured, placed by an engine. `pretrainer export` writes it out, `pretrainer evaluate` scores tasks on it.

`pretrainer evaluate` takes a run's save_dir (a local folder or a URL) or an HF folder. A save_dir's model is rebuilt
from the `config.yaml` its newest checkpoint holds; in a single process (not under torchrun) the run's layout is
replaced by the single engine, so a checkpoint written by many ranks is read by one (DCP reshards it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from ..config import ConfigError, PreTrainingArguments, check_writable_folder, read_downstream_tasks, staging_folder
from ..parallel.registry import single_process_layout
from ..run import launch_world
from ..run.assembly import AssembledRun, assemble_run
from ..storage import RemoteFolder, StorageError, is_url, join_url
from . import checkpoint as ckpt
from .downstream import ScoredTask, format_scores, score_tasks
from .export import export_hf
from .length_stages import LengthStages
from .remote_checkpoints import fetch_checkpoint, locate_remote, step_folder

logger = logging.getLogger("pretrainer")

# A checkpoint's run layout, replaced when one process evaluates it: every engine's layout keys at their defaults.
SINGLE_PROCESS_LAYOUT = tuple(single_process_layout({f.name: f.default for f in
                                                     dataclasses.fields(PreTrainingArguments)}))


def load_model(args: PreTrainingArguments, checkpoint: Path | str | None) -> AssembledRun:
    """The model `args` configures on this launch's engine, with a checkpoint's weights when one is given
    (else those of `model_path`). A checkpoint URL is downloaded first (the staging folder's `.resume/`)."""
    world = launch_world(args)
    if checkpoint is not None and is_url(checkpoint):
        checkpoint = fetch_checkpoint(world, str(checkpoint), staging_folder(str(checkpoint), args.staging_dir)
                                      / ckpt.RESUME_DOWNLOADS, args.storage_retries)
    if checkpoint is not None and ckpt.checkpoint_format(ckpt.read_trainer_state(checkpoint)) != ckpt.DCP:
        raise ConfigError(f"{checkpoint} is a DeepSpeed checkpoint: its run exported save_dir/hf at the end "
                          "(use that folder); to rebuild weights from ZeRO shards use DeepSpeed's "
                          "zero_to_fp32.py on it")
    try:
        loaded = assemble_run(args, world, data=None)
    except BaseException:
        world.close(barrier=False)
        raise
    if checkpoint is not None:
        try:
            ckpt.load_model_weights(checkpoint, loaded.model)
            # the RoPE of the sequence-length stage its last update trained in
            LengthStages(loaded.resolved.sizes, loaded.engine.unwrap(loaded.model)).settle(
                int(ckpt.read_trainer_state(checkpoint)["step"]))
        except BaseException:
            loaded.engine.close()
            raise
    return loaded


def export_checkpoint(args: PreTrainingArguments, checkpoint: str | None, output: str | None) -> Path | str:
    """Load a checkpoint's weights into the configured model and write it as an HF folder. Checkpoint, save_dir
    and output may be URLs: the folder is written locally (the staging folder's `hf/`), then uploaded."""
    path = export_source(args, checkpoint)
    target = output or (join_url(args.save_dir, "hf") if args.remote_save_dir else
                        str(Path(args.save_dir) / "hf") if args.save_dir else None)
    if target is None:
        raise ConfigError("no output folder: pass --output or set save_dir")
    out = staging_folder(target, args.staging_dir) if is_url(target) else Path(target)
    check_writable_folder(out.parent, "--output" if output else "key 'save_dir'")
    loaded = load_model(args, path)
    try:
        run = loaded.resolved
        export_hf(loaded.engine, loaded.model, run.tokenizer, out, args.export_dtype or run.dtype,
                  args.export_max_shard_size)
        if is_url(target) and loaded.engine.is_main:
            folder = RemoteFolder(target, args.storage_retries)
            folder.remove("")  # a previous export's extra shards must not stay beside these
            folder.put_tree(out, "")
            logger.info("uploaded the HF folder to %s", target)
    finally:  # the engine (and its process group) ends on every path
        loaded.engine.close()
    return target if is_url(target) else out


def export_source(args: PreTrainingArguments, checkpoint: str | None) -> Path | str:
    """The checkpoint `pretrainer export` reads: --checkpoint, else save_dir's newest (a URL stays a URL)."""
    if checkpoint is not None and is_url(checkpoint):
        return checkpoint
    if checkpoint is None and args.remote_save_dir:
        return args.remote_save_dir
    given_as = "--checkpoint" if checkpoint else "key 'save_dir'"
    path = ckpt.resolve_resume(checkpoint or "auto", args.save_dir, given_as) if (checkpoint or args.save_dir) else None
    if path is None:
        raise ConfigError("no checkpoint to export: pass --checkpoint or set save_dir to a run with checkpoints")
    return path


def evaluation_args(target: str | Path, overrides: list[str]) -> tuple[PreTrainingArguments, Path | str | None]:
    """The run to evaluate and the checkpoint holding its weights (None: an HF folder's own weights). A run in
    object storage: its newest complete checkpoint's URL (downloaded when the model is loaded)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = [*(() if world_size > 1 else SINGLE_PROCESS_LAYOUT), *overrides]
    if is_url(target):
        return remote_evaluation_args(str(target), overrides)
    target = Path(target)
    if ckpt.checkpoints_root(target).is_dir():
        checkpoint = ckpt.find_latest(target)
        if checkpoint is None:
            raise ConfigError(f"{target}: no complete checkpoint in {ckpt.checkpoints_root(target)}; evaluate its "
                              "HF folder (save_dir/hf) instead")
        return PreTrainingArguments.from_yaml(checkpoint / "config.yaml", overrides), checkpoint
    if (target / "config.json").is_file():
        # an HF folder has no layout of its own: every process of the launch is a data-parallel replica
        base = {"model_path": str(target), "num_training_steps": 1, "micro_batch_size": 1, "dp": world_size,
                "dtype": "auto", "write_report": False, "export_hf": False}
        return PreTrainingArguments.from_dict(base, overrides, source="evaluate"), None
    raise ConfigError(f"{target}: neither a run's save_dir (with checkpoints/) nor an HF model folder (with "
                      "config.json)")


def remote_evaluation_args(url: str, overrides: list[str]) -> tuple[PreTrainingArguments, str]:
    """A run's save_dir (or one checkpoint) by URL: its config.yaml read from the bucket, the checkpoint's URL."""
    try:
        remote, step = locate_remote(url, retries=4)
        if step is None:
            raise ConfigError(f"{url}: no complete checkpoint under {remote.folder.url}/checkpoints")
        text = remote.folder.read_text(f"{step_folder(step)}/config.yaml")
    except StorageError as exc:
        raise ConfigError(str(exc)) from None
    if text is None:
        raise ConfigError(f"{remote.folder.url}/{step_folder(step)} has no config.yaml to rebuild its model from")
    local = staging_folder(remote.folder.url, None) / ckpt.RESUME_DOWNLOADS / f"config-step-{step}.yaml"
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(text, encoding="utf-8")
    return PreTrainingArguments.from_yaml(local, overrides), remote.folder.url_of(step_folder(step))


def evaluate(target: str | Path, task_paths: list[str], overrides: list[str], limit: int | None = None,
             num_fewshot: int | None = None) -> dict[str, dict]:
    """{task: {acc, acc_norm, bpb, records}} of a save_dir's newest checkpoint or an HF folder. Tasks: the
    files given, else the run's own `downstream_evals`."""
    args, checkpoint = evaluation_args(target, overrides)
    entries = [{"path": path} for path in task_paths] or [dataclasses.asdict(t) for t in args.downstream_tasks]
    if not entries:
        raise ConfigError("no tasks to score: pass --tasks FILE ... (the run configured no downstream_evals)")
    changes = {k: v for k, v in (("limit", limit), ("num_fewshot", num_fewshot)) if v is not None}
    tasks = read_downstream_tasks([{**entry, **changes} for entry in entries])
    loaded = load_model(args, checkpoint)
    try:
        run = loaded.resolved
        if run.tokenizer is None:
            raise ConfigError("pretrainer evaluate needs the model's tokenizer: set tokenizer_path=FOLDER")
        scored = [ScoredTask.load(task, run.tokenizer, run.sizes.seq_length) for task in tasks]
        scores = score_tasks(loaded.model, loaded.engine, scored, run.sizes.micro_batch_tokens)
        if loaded.engine.is_main:
            logger.info("evaluated %s: %s", checkpoint or target, format_scores(scores))
    finally:  # the engine (and its process group) ends on every path, a bad task file included
        loaded.engine.close()
    for task in scored:
        scores[task.task.name]["records"] = len(task.records)
    return scores


def write_scores(scores: dict[str, dict], path: str | Path) -> Path:
    path = Path(path)
    check_writable_folder(path.parent, "--output")
    path.write_text(json.dumps(scores, indent=1) + "\n", encoding="utf-8")
    return path
