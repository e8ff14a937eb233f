"""`pretrainer mup-check`: the coordinate check (docs/optimization.md, 'The coordinate check (`pretrainer mup-check`)').

The config's model at several widths: its config.json with `hidden_size`, the number of heads and key-value heads and
`intermediate_size` scaled (head_dim, depth, vocabulary and everything else kept), written with the tokenizer to a
folder of its own that `model_path` points at. Each width is one ordinary run of `PreTrainer` (its build,
initialisation, optimizer groups and step, with the same seed and data), with `ActivationProbe`, a callback, hooking
the outputs of the embedding, each layer's attention and MLP, and the output head.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, PreTrainingArguments
from ..run.callbacks import Callback

logger = logging.getLogger("pretrainer")

# Each kind's modules, by the end of their names in an HF Llama-style model; attention and MLP: one per layer.
MODULE_KINDS = {"embedding": "embed_tokens", "attention": "self_attn.o_proj", "mlp": "mlp.down_proj",
                "logits": "lm_head"}
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model",
                   "*.tiktoken", "chat_template*")
# What each width's run does besides training: nothing (no checkpoint, export, report, evaluation to speak of, resume or
# branch); the head gives full logits (a chunked loss head returns loss sums) and the modules run eagerly (hooked).
RUN_SETTINGS = {"save_dir": "null", "save_interval": "0", "eval_interval": "0", "eval_iters": "1",
                "downstream_evals": "null", "export_hf": "false", "write_report": "false", "report_to": "null",
                "loss_chunk_size": "0", "compile": "false", "resume": "none", "cooldown_from": "null",
                "cooldown_tokens": "null", "exit_interval": "0"}


def parse_widths(text: str) -> list[int]:
    """`--widths 64,128,256`: at least two different whole numbers, smallest first."""
    items = [item.strip() for item in text.split(",")]
    if not items or not all(item.isdigit() and int(item) > 0 for item in items):
        raise ConfigError(f"--widths {text}: expected whole numbers separated by commas, e.g. 64,128,256,512")
    widths = sorted({int(item) for item in items})
    if len(widths) < 2:
        raise ConfigError(f"--widths {text}: give at least two different widths to compare")
    return widths


def width_config(config: dict, width: int, source: str) -> dict:
    """A config.json's mapping at hidden size `width`: head_dim kept, the heads in proportion (`width / head_dim` where
    head_dim is hidden_size / num_attention_heads, as in Llama), the key-value heads at the config's ratio to them (at
    least one, dividing them) and intermediate_size in proportion (a multiple of 8)."""
    hidden, heads, intermediate = (config.get(key) for key in ("hidden_size", "num_attention_heads",
                                                               "intermediate_size"))
    if not all(isinstance(value, int) and value > 0 for value in (hidden, heads, intermediate)) or hidden % heads:
        raise ConfigError(f"{source}: mup-check varies the width of Llama-style configs (hidden_size a multiple of "
                          "num_attention_heads, and intermediate_size); this config is not one")
    head_dim, per_head = config.get("head_dim") or hidden // heads, hidden // heads
    if width % per_head:
        what = f"head_dim {head_dim}" if per_head == head_dim else \
            f"{per_head} (hidden_size / num_attention_heads; head_dim {head_dim} is kept)"
        raise ConfigError(f"--widths: width {width} is not a multiple of {what}: each head keeps its size, the number "
                          "of heads follows the width")
    new_heads = width // per_head
    kv_heads = config.get("num_key_value_heads") or heads
    new_kv = max(1, new_heads * kv_heads // heads)
    if new_heads % new_kv:
        raise ConfigError(f"--widths: width {width} has {new_heads} heads, which {new_kv} key-value heads (the "
                          f"config's {kv_heads} per {heads} heads) do not divide; choose multiples of "
                          f"{per_head * heads // kv_heads}")
    return {**config, "hidden_size": width, "head_dim": head_dim, "num_attention_heads": new_heads,
            "num_key_value_heads": new_kv, "intermediate_size": max(8, round(intermediate * width / hidden / 8) * 8)}


class ActivationProbe(Callback):
    """Each training step's mean |output| of the model's modules, by kind (MODULE_KINDS): forward hooks on the
    modules the engine runs, counting the forwards of training only (not evaluation's)."""

    def __init__(self):
        self.steps: list[dict] = []
        self._means: dict[str, list[torch.Tensor]] = {}

    def attach(self, engine, model: torch.nn.Module) -> None:
        roots = engine.forward_modules(model)
        named = [(name, module) for root in roots for name, module in root.named_modules()]
        for kind, suffix in MODULE_KINDS.items():
            found = [module for name, module in named if name == suffix or name.endswith("." + suffix)]
            if not found:
                raise ConfigError(f"mup-check: the model ({type(roots[0]).__name__}) has no module named *{suffix} "
                                  f"for its {kind} output; it hooks HF Llama-style models (model.embed_tokens, "
                                  "layers' self_attn.o_proj and mlp.down_proj, lm_head)")
            for module in found[:1] if kind in ("embedding", "logits") else found:
                module.register_forward_hook(self._hook(kind))

    def _hook(self, kind: str):
        def record(module, inputs, output) -> None:
            if module.training and isinstance(output, torch.Tensor):
                self._means.setdefault(kind, []).append(output.detach().abs().mean(dtype=torch.float32))
        return record

    def after_step(self, result, state, loop) -> None:
        means = {kind: torch.stack(values).mean().item() for kind, values in self._means.items()}
        loss = float(result.loss_sum) / max(float(result.counts[0]), 1.0)
        self.steps.append({"step": state.step, "loss": loss, "lr": result.lr, **means})
        self._means = {}


@dataclass
class Variants:
    folders: dict[int, Path]    # {width: a model folder}
    hidden_size: int            # the config's own width
    tokenizer_path: str | None  # where the tokenizer is read when it is not beside each config (None: it is)


def model_variants(args: PreTrainingArguments, widths: list[int], folder: Path) -> Variants:
    """A model folder under `folder` for each width: the config at that width and the tokenizer files."""
    from ..models.build import model_source

    source = model_source(args)
    if source.folder is None:
        raise ConfigError("mup-check varies the model of `model_path`; set it (a custom_model_provider_function's "
                          "model has no config.json to vary)")
    config = json.loads(Path(source.config_source).read_text(encoding="utf-8"))
    configs = {width: width_config(config, width, source.config_source) for width in widths}  # all checked first
    if source.has_weights:
        logger.warning("mup-check: %s has weights; every width starts from random weights", source.source)
    tokenizer = [] if args.tokenizer_path else \
        [path for pattern in TOKENIZER_FILES for path in source.folder.glob(pattern) if path.is_file()]
    folders = {}
    for width, variant in configs.items():
        folders[width] = folder / f"width-{width}"
        folders[width].mkdir(parents=True)
        (folders[width] / "config.json").write_text(json.dumps(variant, indent=2) + "\n", encoding="utf-8")
        for path in tokenizer:
            shutil.copy2(path, folders[width] / path.name)
    # no tokenizer file found: the run reads (and names) the model's own folder
    tokenizer_path = args.tokenizer_path or (None if tokenizer else str(source.folder))
    return Variants(folders, config["hidden_size"], tokenizer_path)


def run_overrides(args: PreTrainingArguments, overrides: list[str], steps: int, variants: Variants) -> list[str]:
    """The user's overrides with RUN_SETTINGS and `steps` in place of theirs (a parametrization's base width is the
    config's, the same for every width)."""
    settings = {**RUN_SETTINGS, "num_training_steps": str(steps)}
    if variants.tokenizer_path and not args.tokenizer_path:
        settings["tokenizer_path"] = variants.tokenizer_path
    kept = [item for item in overrides if item.split("=", 1)[0].strip() not in {*settings, "model_path"}]
    return [*kept, *(f"{key}={value}" for key, value in settings.items())]


def train_width(config: str, overrides: list[str], model: Path) -> list[dict]:
    """One run of the config's training with `model` as its model_path: each step's record."""
    from .trainer import PreTrainer

    probe = ActivationProbe()
    args = PreTrainingArguments.from_yaml(config, [*overrides, f"model_path={model}"])
    with PreTrainer(args, callbacks=[probe]) as trainer:
        trainer.train()
    return probe.steps


def coordinate_check(args: PreTrainingArguments, config: str, overrides: list[str], widths: list[int], steps: int,
                     say=print) -> dict:
    """Train each width `steps` steps (`args`: the config with `overrides`); the record: per width, its model's shape
    and each step's means by kind."""
    record = {"config": config, "parametrization": args.parametrization, "steps": steps,
              "widths": widths, "modules": list(MODULE_KINDS), "runs": []}
    with tempfile.TemporaryDirectory(prefix="pretrainer-mup-check-") as folder:
        variants = model_variants(args, widths, Path(folder))
        run_args = run_overrides(args, overrides, steps, variants)
        for width, model in variants.folders.items():
            shape = json.loads((model / "config.json").read_text(encoding="utf-8"))
            started = time.perf_counter()
            records = train_width(config, run_args, model)
            heads = shape["num_attention_heads"]
            say(f"mup-check: width {width} ({heads} head{'s' if heads > 1 else ''}, intermediate_size "
                f"{shape['intermediate_size']}): loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} in "
                f"{time.perf_counter() - started:.1f} s")
            record["runs"].append({"width": width, "model": {key: shape[key] for key in (
                "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")},
                "steps": records})
    return record
