"""DeepSpeed JSON configs: read (comments allowed), fill every "auto" from the pretraining config, check conflicts.

The seeds' `ds_config_zero2.json` / `ds_config_zero3.json` are written for the HF Trainer, which fills "auto" values
from its own arguments; here they come from `PreTrainingArguments`. An explicit value that contradicts the pretraining
config (a different accumulation, say) is an error: DeepSpeed would silently change the global batch.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError, global_batch_size
from ..config.loading import non_finite_at, not_finite_message, read_user_text

logger = logging.getLogger(__name__)

AUTO = "auto"
# ZeRO bucket sizes filled from the model's hidden size (as the HF Trainer does).
HIDDEN_SIZE_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")

# DeepSpeed's default buffer sizes (elements), for keys a config leaves unset or "auto" before the hidden size is known.
BUFFER_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                   "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000}

# Keys found in published configs that current DeepSpeed rejects or ignores, and why.
DROPPED = {("fp16", "fp16_opt_level"): "an apex (O1/O2) setting; current DeepSpeed rejects it"}
IGNORED = {"min_lr": "not a DeepSpeed key: WarmupDecayLR decays to 0, set warmup_min_lr/min_lr in the run's config"}


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The DeepSpeed JSON, filled from the run's config and checked; what the engine hands deepspeed.initialize."""
    config: dict
    source: str = "key 'deepspeed'"   # where the JSON came from, for messages
    filled: dict = field(default_factory=dict)  # dotted key -> value filled from the run's config

    @staticmethod
    def for_zero(stage: int, offload_optimizer: bool = False, offload_parameters: bool = False) -> "DeepSpeedSettings":
        """A ZeRO stage with DeepSpeed's defaults (the layouts the planner compares)."""
        zero: dict = {"stage": stage}
        if offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu"}
        if offload_parameters:
            zero["offload_param"] = {"device": "cpu"}
        return DeepSpeedSettings({"zero_optimization": zero})

    @property
    def zero(self) -> dict:
        return self.config.get("zero_optimization") or {}

    @property
    def zero_stage(self) -> int:
        return int(self.zero.get("stage", 0))

    def offloads(self, kind: str) -> bool:
        """`optimizer` or `param` state offloaded (to the CPU or NVMe)."""
        return (self.zero.get(f"offload_{kind}") or {}).get("device", "none") not in ("none", None)

    def buffer(self, key: str) -> int:
        """A buffer size in elements (BUFFER_DEFAULTS' keys)."""
        value = self.zero.get(key, BUFFER_DEFAULTS[key])
        return BUFFER_DEFAULTS[key] if value == AUTO else int(value)

    def describe(self) -> str:
        # parameters are offloaded at stage 3 only (DeepSpeed ignores offload_param below, which the seed's ZeRO-2 sets)
        offload = [k for k in ("optimizer", "param") if self.offloads(k) and (k == "optimizer" or self.zero_stage == 3)]
        ignored = " (offload_param ignored below stage 3)" if self.offloads("param") and self.zero_stage < 3 else ""
        return f"zero_stage={self.zero_stage} offload={','.join('offload_' + k for k in offload) or 'none'}{ignored}"


def read_deepspeed_settings(args, world_size: int, dtype: str, hidden_size: int | None) -> DeepSpeedSettings:
    """The run's DeepSpeed JSON (`deepspeed`, or what an `accelerate launch` DeepSpeed config put in the
    environment), every "auto" filled from the config and checked with DeepSpeed's own models."""
    source = args.deepspeed if args.deepspeed is not None else config_from_accelerate_env()
    where = (f"key 'deepspeed' ({source})" if isinstance(source, str) else
             "key 'deepspeed'" if args.deepspeed is not None else "the accelerate DeepSpeed config")
    config, filled = fill_deepspeed_config(load_deepspeed_config(source), args, world_size, hidden_size, dtype=dtype)
    validate_deepspeed_config(config, where)
    if "optimizer" not in config and "offload_optimizer" in (config.get("zero_optimization") or {}):
        config["zero_force_ds_cpu_optimizer"] = False  # the run's AdamW groups run on DeepSpeed's offload
    return DeepSpeedSettings(config, where, filled)


def load_deepspeed_config(source) -> dict:
    """A dict, or a JSON file (with // comments, as the seed prints them)."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"key 'deepspeed': {path} does not exist")
    text = re.sub(r'("(?:\\.|[^"\\])*")|//[^\n]*', lambda m: m.group(1) or "",
                  read_user_text(path, "key 'deepspeed':"))
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: invalid DeepSpeed JSON ({exc.msg})") from None
    found = non_finite_at(config, "")  # JSON's NaN and Infinity, as the config's own keys refuse them
    if found is not None:
        raise ConfigError(f"key 'deepspeed': {path}: {not_finite_message(found[0].lstrip('.'), found[1])}")
    return config


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


def fill_deepspeed_config(config: dict, args, world_size: int, hidden_size: int | None,
                          dtype: str | None = None) -> tuple[dict, dict]:
    """Return the filled config and {dotted key: value} of what was filled. Without `hidden_size` (model not known yet)
    the ZeRO bucket sizes derived from it stay "auto". `dtype`: the resolved compute dtype (default: the config's)."""
    dtype = dtype or args.dtype
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
            _fill_or_check(block, "enabled", dtype == precision, filled, f"{precision}.")
        elif dtype == precision:
            config[precision] = {"enabled": True}
            filled[f"{precision}.enabled"] = True
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict):  # an optimizer parameter left out is filled too
        _fill_auto(optimizer.setdefault("params", {}), {"lr": args.lr, "betas": [args.adam_beta1, args.adam_beta2],
                                                        "eps": args.adam_eps, "weight_decay": args.weight_decay},
                   filled, "optimizer.params.", missing=AUTO)
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict):
        _fill_auto(scheduler.setdefault("params", {}), scheduler_values(scheduler.get("type"), args), filled,
                   "scheduler.params.")
    if hidden_size:  # the ZeRO bucket sizes still "auto", from the model's hidden size
        sizes = (hidden_size * hidden_size, int(0.9 * hidden_size * hidden_size), 10 * hidden_size)
        _fill_auto(config.get("zero_optimization") or {}, dict(zip(HIDDEN_SIZE_KEYS, sizes)), filled,
                   "zero_optimization.")
    later = {f"zero_optimization.{key}" for key in HIDDEN_SIZE_KEYS} if not hidden_size else set()
    leftovers = [k for k, v in _walk(config) if v == AUTO and k not in later]
    if leftovers:
        raise ConfigError(f"DeepSpeed config: cannot fill \"auto\" for {', '.join(leftovers)}; give explicit values")
    return config, filled


def _fill_auto(block: dict, values: dict, filled: dict, prefix: str, missing=None) -> None:
    """Set each of `values` that `block` holds as "auto" (or leaves out, with `missing` AUTO); record it in `filled`."""
    for key, value in values.items():
        if block.get(key, missing) == AUTO:
            block[key] = value
            filled[prefix + key] = value


def scheduler_values(kind: str | None, args) -> dict:
    """Each "auto" parameter of a DeepSpeed scheduler block, from the run's lr, min_lr, warmup and num_training_steps.
    DeepSpeed refuses warmup_num_steps 0 (and warms up over 2+ steps): no warmup becomes a flat one, lr to lr."""
    if args.warmup_tokens is not None:
        raise ConfigError("warmup_tokens cannot fill the DeepSpeed JSON scheduler's \"auto\" warmup (DeepSpeed "
                          "counts steps): give warmup_steps or warmup_fraction, or remove the JSON's scheduler block")
    total, warmup = args.num_training_steps, args.warmup_steps_resolved()
    lr, min_lr = args.lr, args.min_lr
    warmup_steps = max(1, warmup)
    warmup_start = 0.0 if warmup else lr
    common = {"warmup_num_steps": warmup_steps, "warmup_type": "linear"}
    values = {
        "WarmupLR": {**common, "warmup_min_lr": warmup_start, "warmup_max_lr": lr},
        "WarmupDecayLR": {**common, "warmup_min_lr": warmup_start, "warmup_max_lr": lr, "total_num_steps": total},
        "WarmupCosineLR": {**common, "total_num_steps": total, "warmup_min_ratio": warmup_start / lr,
                           "cos_min_ratio": min_lr / lr},
        # one cycle: up from min_lr to lr over the warmup (at least one step), down again over the rest
        "OneCycle": {"cycle_min_lr": min_lr, "cycle_max_lr": lr, "cycle_first_step_size": warmup_steps,
                     "cycle_second_step_size": max(1, total - warmup_steps), "decay_lr_rate": 0.0,
                     "decay_step_size": 0, "cycle_min_mom": args.adam_beta1, "cycle_max_mom": args.adam_beta1,
                     "decay_mom_rate": 0.0},
        # a sweep that starts at lr and grows by lr every num_training_steps steps
        "LRRangeTest": {"lr_range_test_min_lr": lr, "lr_range_test_step_size": total, "lr_range_test_step_rate": 1.0,
                        "lr_range_test_staircase": False},
    }
    return values.get(kind, {})


def _fill_or_check(block: dict, key: str, value, filled: dict, prefix: str = "") -> None:
    current = block.get(key, AUTO)
    if current == AUTO:
        block[key] = value
        filled[prefix + key] = value
    elif current != value and not (isinstance(value, float) and float(current) == value):
        raise ConfigError(f"DeepSpeed config sets {prefix}{key}={current!r} but the pretraining config gives "
                          f"{value!r}; set it to \"auto\" or make the two agree")


def validate_deepspeed_config(config: dict, source: str) -> None:
    """Check a (filled) config with DeepSpeed's own config models, as `deepspeed.initialize` will, so a bad value is
    one line naming its JSON path, the value and what is allowed. Values still "auto" get DeepSpeed's defaults here."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        from pydantic import ValidationError
    except ImportError:  # DeepSpeed versions without pydantic models
        ValidationError = ()
    checked = _without_auto(config)
    # DeepSpeed checks the global batch against its own world size, which it knows only once deepspeed.initialize
    # has set up its communication; the batch sizes were filled (and checked) from the launch above.
    checked.pop("train_batch_size", None)
    try:
        DeepSpeedConfig(checked)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            location = tuple(str(part) for part in error["loc"])
            value = error.get("input")
            path = _find_path(checked, location, value) or ".".join(location)
            allowed = "not a DeepSpeed setting (misspelt?)" if error["type"] == "extra_forbidden" else error["msg"]
            problems.append(f"{path}={value!r}: {allowed}")
        raise ConfigError(f"{source}: {'; '.join(problems)}") from None
    except (AssertionError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{source}: DeepSpeed does not accept this config: {exc}") from None
    _check_named_parts(checked, source)


def _check_named_parts(config: dict, source: str) -> None:
    """The optimizer and scheduler named by type, and the scheduler's parameters: DeepSpeed looks them up only
    inside deepspeed.initialize (an assertion or a TypeError there)."""
    import inspect

    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    optimizer = (config.get("optimizer") or {}).get("type")
    if optimizer is not None and str(optimizer).lower() not in DEEPSPEED_OPTIMIZERS \
            and getattr(torch.optim, str(optimizer), None) is None:
        raise ConfigError(f"{source}: optimizer.type={optimizer!r}: not an optimizer DeepSpeed knows (its own: "
                          f"{', '.join(DEEPSPEED_OPTIMIZERS)}; or a torch.optim class name)")
    scheduler = config.get("scheduler") or {}
    kind = scheduler.get("type")
    if kind is None:
        return
    cls = getattr(lr_schedules, str(kind), None) or getattr(torch.optim.lr_scheduler, str(kind), None)
    if not inspect.isclass(cls):
        raise ConfigError(f"{source}: scheduler.type={kind!r}: not a DeepSpeed scheduler (one of "
                          f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}; or a torch.optim.lr_scheduler class name)")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "optimizer"}
    unknown = sorted(set(scheduler.get("params") or {}) - accepted)
    if unknown:
        raise ConfigError(f"{source}: scheduler.params.{unknown[0]}: not a parameter of {kind} (it takes "
                          f"{', '.join(sorted(accepted))})")


def _without_auto(node):
    return {k: _without_auto(v) for k, v in node.items() if v != AUTO} if isinstance(node, dict) else node


def _find_path(config: dict, location: tuple, value) -> str | None:
    """The dotted path in `config` ending in `location` and holding `value`, else the block there (the value is a
    mapping: a whole block is wrong); pydantic locations are block-relative."""
    ending = [(path, found) for path, found in _walk(config, mappings=True)
              if tuple(path.split("."))[-len(location):] == location]
    leaves = [path for path, found in ending if not isinstance(found, dict) and found == value]
    return next(iter(leaves + [path for path, found in ending if isinstance(found, dict)]), None)


def _walk(node, prefix: str = "", mappings: bool = False):
    """(dotted path, value) of every leaf; with `mappings`, of every nested block too."""
    if isinstance(node, dict):
        if mappings and prefix:
            yield prefix.rstrip("."), node
        for key, value in node.items():
            yield from _walk(value, f"{prefix}{key}.", mappings)
    else:
        yield prefix.rstrip("."), node
