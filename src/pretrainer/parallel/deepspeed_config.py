"""DeepSpeed JSON configs: read (comments allowed), fill every "auto" from the pretraining config, check conflicts.

The seeds' `ds_config_zero2.json` / `ds_config_zero3.json` are written for the HF Trainer, which fills
"auto" values from its own arguments; here the same values come from `PreTrainingArguments`. An
explicit value that contradicts the pretraining config (a different accumulation, say) is an error,
since DeepSpeed would otherwise silently change the global batch.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from pathlib import Path

from ..config import ConfigError, global_batch_size

logger = logging.getLogger(__name__)

AUTO = "auto"

# Keys found in published configs that current DeepSpeed rejects or ignores, and why.
DROPPED = {("fp16", "fp16_opt_level"): "an apex (O1/O2) setting; current DeepSpeed rejects it"}
IGNORED = {"min_lr": "not a DeepSpeed key: WarmupDecayLR decays to 0, set warmup_min_lr/min_lr in the run's config"}


def load_deepspeed_config(source) -> dict:
    """A dict, or a JSON file (with // comments, as the seed prints them)."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"key 'deepspeed': {path} does not exist")
    text = re.sub(r'("(?:\\.|[^"\\])*")|//[^\n]*', lambda m: m.group(1) or "", path.read_text(encoding="utf-8"))
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: invalid DeepSpeed JSON ({exc.msg})") from None


def config_from_accelerate_env() -> dict:
    """What an `accelerate launch` DeepSpeed config (deepspeed_config: {...}) put in the environment."""
    env = os.environ
    if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        return load_deepspeed_config(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"])
    config: dict = {"train_micro_batch_size_per_gpu": AUTO, "train_batch_size": AUTO,
                    "gradient_accumulation_steps": AUTO, "gradient_clipping": AUTO,
                    "zero_optimization": {"stage": int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))}}
    if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in env:
        config["gradient_accumulation_steps"] = int(env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"])
    if "ACCELERATE_GRADIENT_CLIPPING" in env:
        config["gradient_clipping"] = float(env["ACCELERATE_GRADIENT_CLIPPING"])
    for kind in ("optimizer", "param"):
        device = env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{kind.upper()}_DEVICE", "none")
        if device not in ("none", ""):
            config["zero_optimization"][f"offload_{kind}"] = {"device": device}
    return config


def fill_deepspeed_config(config: dict, args, world_size: int, hidden_size: int | None) -> tuple[dict, dict]:
    """Return the filled config and {dotted key: value} of what was filled."""
    config = copy.deepcopy(config)
    filled: dict = {}
    for (block, key), why in DROPPED.items():
        if key in (config.get(block) or {}):
            del config[block][key]
            logger.info("DeepSpeed config: dropped %s.%s (%s)", block, key, why)
    for key, why in IGNORED.items():
        if key in config:
            logger.info("DeepSpeed config: %s=%s is ignored by DeepSpeed (%s)", key, config[key], why)
    ga = args.gradient_accumulation_steps
    targets = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": ga,
        "train_batch_size": global_batch_size(args.micro_batch_size, ga, world_size),  # DeepSpeed: dp = world
        "gradient_clipping": float(args.clip_grad or 0.0),
    }
    for key, value in targets.items():
        _fill_or_check(config, key, value, filled)
    for precision in ("fp16", "bf16"):
        block = config.get(precision)
        if isinstance(block, dict):
            _fill_or_check(block, "enabled", args.dtype == precision, filled, f"{precision}.")
        elif args.dtype == precision:
            config[precision] = {"enabled": True}
            filled[f"{precision}.enabled"] = True
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict):
        params = optimizer.setdefault("params", {})
        values = {"lr": args.lr, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_eps,
                  "weight_decay": args.weight_decay}
        for key, value in values.items():
            if params.get(key, AUTO) == AUTO:
                params[key] = value
                filled[f"optimizer.params.{key}"] = value
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict):
        params = scheduler.setdefault("params", {})
        values = {"total_num_steps": args.num_training_steps, "warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                  "warmup_num_steps": args.warmup_steps_resolved()}
        for key, value in values.items():
            if params.get(key) == AUTO:
                params[key] = value
                filled[f"scheduler.params.{key}"] = value
    zero = config.get("zero_optimization") or {}
    if hidden_size:
        sizes = {"reduce_bucket_size": hidden_size * hidden_size,
                 "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                 "stage3_param_persistence_threshold": 10 * hidden_size}
        for key, value in sizes.items():
            if zero.get(key) == AUTO:
                zero[key] = value
                filled[f"zero_optimization.{key}"] = value
    leftovers = [k for k, v in _walk(config) if v == AUTO]
    if leftovers:
        raise ConfigError(f"DeepSpeed config: cannot fill \"auto\" for {', '.join(leftovers)}; give explicit values")
    return config, filled


def _fill_or_check(block: dict, key: str, value, filled: dict, prefix: str = "") -> None:
    current = block.get(key, AUTO)
    if current == AUTO:
        block[key] = value
        filled[prefix + key] = value
    elif current != value and not (isinstance(value, float) and float(current) == value):
        raise ConfigError(f"DeepSpeed config sets {prefix}{key}={current!r} but the pretraining config gives "
                          f"{value!r}; set it to \"auto\" or make the two agree")


def _walk(node, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node
