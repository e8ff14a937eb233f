"""Model and tokenizer: cheap checks first (`preflight`), then one materialisation of the model.

`model_path` may be an HF folder with weights (loaded with `from_pretrained`), a folder with only `config.json`, or a
`config.json` file (random init with the config's init std). A random-init model is built on the meta device; the engine
materialises it once, after sharding where it shards, so no rank holds two copies (or, when sharded, the whole model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, Parametrization
from . import mpt_attention
from .hf_conversions import conversions_of
from .hf_weights import CheckpointTensors, attach_checkpoint, pending_checkpoint
from .init import materialize_modules
from .mtp import CONFIG_KEY, add_mtp_layers, depth_prefixes
from .rope import apply_rope_settings
from .vocab_growth import RowGrower, VocabGrowth, grow_embeddings, plan_growth

logger = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")


@dataclass
class ModelSpec:
    config: object          # transformers PretrainedConfig
    tokenizer: object       # transformers tokenizer
    has_weights: bool
    source: str             # the model folder (or the hook that built the model)
    config_source: str      # where the config came from, for messages
    growth: VocabGrowth | None = None  # the vocabulary grows to a larger (extended) tokenizer


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from and its config, read (RoPE settings applied) before anything heavy."""
    config: object          # transformers PretrainedConfig
    source: str             # the model folder (or the hook that built the model)
    config_source: str      # where the config came from, for messages
    has_weights: bool
    folder: Path | None     # the folder beside the config (its tokenizer), None for a provided model


def model_source(args, config=None) -> ModelSource:
    """The model's config: from `model_path` (a folder or a config.json), or `config`, the config of a model
    built elsewhere (custom_model_provider_function: no model path needed)."""
    from transformers import AutoConfig

    path_value = args.resolved_model_path
    if config is not None and not path_value:
        return ModelSource(config, "custom_model_provider_function", "the provided model's config", True, None)
    if not path_value:
        raise ConfigError("no model given: set `model_path` (or the seed's `openmind_model_path`) to an HF model "
                          "folder or a config.json")
    path = Path(path_value)
    if not path.exists():
        raise ConfigError(f"model_path {path} does not exist")
    config_file = path if path.is_file() else path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model_path {path}: no config.json found; point it at an HF model folder or a config.json")
    try:
        config = AutoConfig.from_pretrained(str(config_file))
    except Exception as exc:  # transformers raises several types for bad configs
        raise ConfigError(f"{config_file}: cannot be read as a model config: {exc}") from None
    has_weights = path.is_dir() and any(any(path.glob(p)) for p in WEIGHT_PATTERNS)
    apply_rope_settings(config, args.rope_scaling, args.rope_theta, str(config_file))
    return ModelSource(config, str(path), str(config_file), has_weights, config_file.parent)


def preflight(args, source: ModelSource | None = None, vocab_multiple: int = 1) -> ModelSpec:
    """Resolve and check the model config and tokenizer without building the model. A tokenizer larger than the
    model's vocabulary plans its growth (padded to a multiple of `pad_vocab_to_multiple_of` and of `vocab_multiple`,
    the tensor-parallel degree)."""
    source = source or model_source(args)
    if source.folder is None:
        if not args.tokenizer_path:
            raise ConfigError("the model comes from custom_model_provider_function: set `tokenizer_path` too")
        tokenizer = load_tokenizer(args.tokenizer_path, Path(args.tokenizer_path))
        return ModelSpec(source.config, tokenizer, True, source.source, source.config_source)
    tokenizer = load_tokenizer(args.resolved_tokenizer_path, Path(source.source))
    growth = plan_growth(source.config, tokenizer, args, source.folder, source.config_source, vocab_multiple)
    return ModelSpec(source.config, tokenizer, source.has_weights, source.source, source.config_source, growth)


def load_tokenizer(tokenizer_path: str | None, model_path: Path):
    from transformers import AutoTokenizer

    if not tokenizer_path:
        raise ConfigError("no tokenizer given: set `tokenizer_path` (or put the tokenizer in the model folder)")
    tpath = Path(tokenizer_path)
    if tpath.is_file() and tpath.name == "config.json":
        tpath = tpath.parent
    if not tpath.exists():
        raise ConfigError(f"tokenizer_path {tpath} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tpath))
    except Exception as exc:
        in_model_folder = tpath in (model_path, model_path.parent)
        hint = "; set `tokenizer_path` to a tokenizer folder" if in_model_folder else ""
        raise ConfigError(f"no usable tokenizer in {tpath}: {exc}{hint}") from None
    return tokenizer


def build_model(args, spec: ModelSpec, read_slices: bool = False) -> torch.nn.Module:
    """The model in fp32 master weights: loaded on CPU from weights, or on the meta device from a config, for an
    engine to place, materialise (`init.materialize`) and cast. With `read_slices` a safetensors checkpoint is not
    loaded here: the meta model gets the files' reader, and each rank reads its own slices (docs/loading.md)."""
    from transformers import AutoModelForCausalLM

    config = spec.config
    config.use_cache = False
    if args.init_method_std is not None and hasattr(config, "initializer_range"):
        config.initializer_range = args.init_method_std
    if read_slices and reads_checkpoint_in_slices(args, spec):
        model = _model_reading_slices(args, spec)
    elif spec.has_weights:
        logger.info("loading weights from %s", spec.source)
        try:
            model = AutoModelForCausalLM.from_pretrained(spec.source, config=config, dtype=torch.float32)
        except Exception as exc:  # transformers, safetensors and torch raise many kinds for a damaged folder
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"model_path {spec.source}: its weights cannot be loaded ({reason}); check the "
                              "weight files (a download cut short?), or point model_path at a config.json to start "
                              "from random weights") from None
        if spec.growth is not None:
            grow_embeddings(model, spec.growth, spec.tokenizer, args.new_token_init, args.init_method_std, args.seed)
    else:
        if spec.growth is not None:  # random weights: the larger vocabulary is built directly
            config.vocab_size = spec.growth.new_size
            logger.info("vocabulary: %d rows for the tokenizer's %d tokens (random init)", spec.growth.new_size,
                        spec.growth.tokens)
        logger.info("building %s from its config on the meta device (init std %s)", config.model_type,
                    getattr(config, "initializer_range", "default"))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    mpt_attention.install(model)
    return model


def add_multi_token_prediction(model: torch.nn.Module, depths: int, spec: ModelSpec | None, seed: int,
                               parametrization: Parametrization | None = None) -> None:
    """`mtp_num_layers` depths appended before an engine lays the model out: read from the model folder's files
    where they hold them (docs/multi-token-prediction.md, 'HF folders in and out'), the rest initialised."""
    config = model.config
    held = int(getattr(config, CONFIG_KEY, 0) or 0)
    folder = Path(spec.source) if spec is not None and spec.has_weights and Path(spec.source).is_dir() else None
    if depths < held and folder is not None:
        logger.warning("%s holds multi-token prediction weights for %d depth(s) (%s); mtp_num_layers is %d, so %s "
                       "neither trained nor exported; set mtp_num_layers: %d to keep them", folder, held, CONFIG_KEY,
                       depths, "they are" if depths == 0 else "the deeper ones are", held)
    if not depths:
        if held:
            setattr(config, CONFIG_KEY, 0)
        return
    layers = add_mtp_layers(model, depths)
    added = {id(p) for layer in layers for p in layer.parameters()}
    main_is_real = not any(p.is_meta for p in model.parameters() if id(p) not in added)
    reader = pending_checkpoint(model)
    if reader is None and folder is not None and any(folder.glob("*.safetensors")):
        reader = CheckpointTensors.open(folder, model)
    prefixes = depth_prefixes(model)
    read = [k for k, prefix in enumerate(prefixes, 1)
            if reader is not None and reader.locate(prefix + "eh_proj.weight")]
    logger.info("multi-token prediction: %d depth(s)%s%s", depths,
                f"; depth(s) {', '.join(map(str, read))} read from {folder}" if read else "",
                f"; depth(s) {', '.join(str(k) for k in range(1, depths + 1) if k not in read)} initialised"
                if len(read) < depths else "")
    if main_is_real:
        if reader is not None:
            reader.check(model, within=tuple(prefixes))
        materialize_modules(model, layers, torch.device("cpu"), seed, reader, parametrization)


def _model_reading_slices(args, spec: ModelSpec) -> torch.nn.Module:
    """The model on the meta device with the checkpoint's reader attached (filled when an engine materialises
    it); a grown vocabulary is built at its new size and grown from the files as they are read."""
    from transformers import AutoModelForCausalLM

    config = spec.config
    if spec.growth is not None:
        config.vocab_size = spec.growth.new_size
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    checkpoint = CheckpointTensors.open(spec.source, model)
    if spec.growth is not None:
        grower = RowGrower(config, spec.growth, spec.tokenizer, args.new_token_init, args.init_method_std, args.seed)
        checkpoint.grow_vocabulary(grower, model)
        logger.info("vocabulary: %d -> %d rows (%d tokens, the rest padding); new rows: %s, grown as the slices "
                    "are read", spec.growth.old_size, spec.growth.new_size, spec.growth.tokens, grower.describe())
    logger.info("weights: %s (%d safetensors file(s)) is read as the engine lays the model out, each rank reading "
                "only what it holds", spec.source, len(set(checkpoint.files.values())))
    _keep_generation_config(model, Path(spec.source))
    # What from_pretrained records: the conversions the files needed (none: save_pretrained then writes the
    # tensors in the same order as for a loaded model, so the export is the same bytes; per-expert tensors are
    # written back per expert).
    model._weight_conversions = checkpoint.conversions.used(checkpoint.files)
    attach_checkpoint(model, checkpoint)
    return model


def reads_checkpoint_in_slices(args, spec: ModelSpec) -> bool:
    """Whether an engine that can read its own slices of the checkpoint will (safetensors files whose names are
    the model's, or converted by renamings and per-expert stacking only; `sliced_weight_loading` on)."""
    return bool(spec.has_weights and args.sliced_weight_loading and Path(spec.source).is_dir()
                and any(Path(spec.source).glob("*.safetensors"))
                and conversions_of(spec.config) is not None)


def _keep_generation_config(model, folder: Path) -> None:
    """A folder's generation_config.json, as `from_pretrained` would have read it (export writes it back)."""
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(folder))


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
