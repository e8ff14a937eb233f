"""`pretrainer` command line: `train` and `export`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .config import ConfigError, PreTrainingArguments
from .data import DataError

logger = logging.getLogger("pretrainer")

EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrainer", description="Pretrain causal language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train from a YAML config")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys for nested ones)")

    export = commands.add_parser("export", help="write an HF folder from a checkpoint")
    export.add_argument("config", help="the run's YAML config")
    export.add_argument("overrides", nargs="*", help="key=value overrides")
    export.add_argument("--checkpoint", help="checkpoint folder (default: the latest in save_dir)")
    export.add_argument("--output", help="output folder (default: save_dir/hf)")

    # The deepspeed launcher passes --local_rank=N right after the program; LOCAL_RANK in the environment
    # says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    try:
        args = PreTrainingArguments.from_yaml(ns.config, ns.overrides)
        if ns.command == "train":
            from .train import PreTrainer

            PreTrainer(args).train()
        else:
            export_checkpoint(args, ns.checkpoint, ns.output)
    except (ConfigError, DataError) as exc:
        print(f"pretrainer: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def export_checkpoint(args: PreTrainingArguments, checkpoint: str | None, output: str | None) -> Path:
    """Load a checkpoint's weights into the configured model and export it."""
    from .models import build_model, preflight
    from .parallel import create_engine
    from .train import checkpoint as ckpt
    from .train.export import export_hf
    from .train.metrics import setup_logging

    setup_logging()
    path = ckpt.resolve_resume(checkpoint or "auto", args.save_dir) if (checkpoint or args.save_dir) else None
    if path is None:
        raise ConfigError("no checkpoint to export: pass --checkpoint or set save_dir to a run with checkpoints")
    out = Path(output) if output else (Path(args.save_dir) / "hf" if args.save_dir else None)
    if out is None:
        raise ConfigError("no output folder: pass --output or set save_dir")
    if ckpt.read_trainer_state(path).get("engine") == "deepspeed":
        raise ConfigError(f"{path} is a DeepSpeed checkpoint: its run exported save_dir/hf at the end; to rebuild "
                          "weights from ZeRO shards use DeepSpeed's zero_to_fp32.py on it")
    engine = create_engine(args)
    spec = preflight(args)
    model = engine.wrap(build_model(args, spec))
    ckpt.load_model_weights(path, engine=engine, model=model)
    state = engine.full_state_dict(model)
    if engine.is_main:
        export_hf(engine.unwrap(model), state, spec.tokenizer, out, args.export_dtype or args.dtype)
    engine.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
