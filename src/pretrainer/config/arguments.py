"""`PreTrainingArguments`: the run's configuration (the schema, its loading and its checks).

Reads the seed's YAML schema unchanged (flat keys, `plugin_args.other_megatron_args`, `dataloader_config`, anchors,
`1e-5` strings) and adds native keys for what a pretraining run needs. Validation here is cheap and file-free; checks
that need the model or tokenizer on disk live in `pretrainer.models.preflight`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import yaml

from .downstream import DownstreamTask, read_downstream_tasks
from .dtypes import DTYPES, torch_dtype
from .errors import ConfigError, key_error
from .fault_tolerance import read_fault_tolerance
from .features import check_features
from .loading import (
    UniqueKeyLoader,
    allowed_types,
    apply_override,
    check_unique_overrides,
    coerce_scientific,
    describe_types,
    non_finite_at,
    not_finite_message,
    parse_size,
    plain,
    read_user_text,
    reads_as_not_finite,
    suggestion,
    top_level_key_lines,
)
from .mixture import Mixture, is_mixture, read_mixture
from .moe import AUX_LOSS_TYPES, DROP_POLICIES, EXPERTS_IMPLEMENTATIONS
from .mtp import DEFAULT_LOSS_COEFF, check_mtp_keys
from .openmind import apply_openmind_rules, check_given_against_megatron, megatron_args, merge_megatron_values
from .optimization import MUON_ADJUST_LR, MUON_NS_DTYPES, OPTIMIZERS, WSD_DECAY_SHAPES
from .parametrization import PARAMETRIZATIONS, check_parametrization
from .paths import staging_folder
from .seq_stages import read_seq_length_schedule
from .sizes import MAX_RUN_TOKENS, global_batch_size
from .urls import is_url, parse_url

logger = logging.getLogger(__name__)

DECAY_STYLES = ("cosine", "linear", "constant", "wsd")
TXT_MODES = ("line", "file")
ON_ERROR = ("fail", "skip")
MEMORY_CHECKS = ("error", "warn", "off")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")  # see parallel/activation_checkpoint.py
HOST_MALLOC_REUSE = ("auto", "on", "off")  # see perf/host_memory.py
ACCUMULATE_GRADIENTS = ("auto", "sharded", "unsharded")  # see run/resolve.py and plan/memory_check.py
CHECKPOINT_FAILURES = ("fatal", "warn")  # see train/remote_checkpoints.py
NEW_TOKEN_INITS = ("subtoken_mean", "mean", "normal")
ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")
DEFAULT_DATA_SPLIT = "969,30,1"  # Megatron's train,valid,test document shares
_COUNTS = ("mup_base_hidden_size", "mup_base_head_dim", "mup_base_num_layers", "num_training_steps",
           "micro_batch_size", "dp", "gradient_accumulation_steps", "log_interval", "eval_iters",
           "storage_retries", "fsdp_shard_size", "tokenize_workers", "pad_vocab_to_multiple_of",
           "context_parallel_degree", "expert_parallel_degree")
_INTERVALS = ("save_interval", "eval_interval", "exit_interval", "keep_last_checkpoints", "keep_checkpoints_every",
              "max_skipped_updates")
# Each number's range, in one table: ">= 1", "> 0", "[0, 1)" (brackets: the end is allowed, parentheses: not), and
# what to say beside it. A null (where the key takes one) is not checked; what torch, DeepSpeed or the DataLoader
# would otherwise refuse with a traceback from deep inside is refused here, naming the key.
BOUNDS: dict[str, tuple[str, str]] = {
    **{key: (">= 1", "") for key in _COUNTS}, **{key: (">= 0", "0 or null disables") for key in _INTERVALS},
    "seq_length": (">= 1", "or null: the model's context length"),
    **{key: (">= 0", "") for key in ("num_workers", "weight_decay", "adam_eps", "clip_grad")},
    **{key: ("> 0", "or null for the default") for key in ("init_method_std", "peak_tflops")},
    **{key: ("> 0", "a number of tokens, e.g. 2e9") for key in ("warmup_tokens", "wsd_decay_tokens",
                                                                 "cooldown_tokens")},
    "warmup_fraction": ("[0, 1]", "a share of the run"), "wsd_decay_fraction": ("(0, 1]", ""),
    "adam_beta1": ("[0, 1)", ""), "adam_beta2": ("[0, 1)", ""), "muon_momentum": ("[0, 1)", ""),
    "muon_ns_steps": ("[1, 99]", "5 is usual"), "muon_lr": ("> 0", "or null: lr"),
    "z_loss_coeff": (">= 0", "1e-4 is PaLM's and OLMo 2's"),
    "loss_spike_factor": ("> 1", "a step is skipped when its loss exceeds this many times the running mean; or null"),
    "spike_zscore": ("> 0", "standard deviations; 6 is OLMo-core's"), "spike_window": (">= 4", "accepted steps"),
    "rope_theta": ("> 0", ""),
    "moe_capacity_factor": ("> 0", "1.0: an even share of the tokens per expert; null: dropless"),
    **{key: (">= 0", "0 turns it off") for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff",
                                                    "moe_expert_bias_update_rate")},
}


def bound_limits(bound: str) -> tuple[float, bool, float | None, bool]:
    """(low, whether low is allowed, high or None, whether high is allowed) of a BOUNDS range."""
    if bound[0] in "[(":
        low, high = (float(end) for end in bound[1:-1].split(","))
        return low, bound[0] == "[", high, bound[-1] == "]"
    op, limit = bound.split()
    return float(limit), op == ">=", None, False


def out_of_bounds(value, bound: str) -> bool:
    low, low_allowed, high, high_allowed = bound_limits(bound)
    return not ((value >= low if low_allowed else value > low) and
                (high is None or (value <= high if high_allowed else value < high)))


# Keys whose paths may be URLs (a run's folders, its data and task files), and keys read from local disk only.
URL_KEYS = ("save_dir", "resume", "cooldown_from", "train_data", "eval_data", "data_path", "downstream_evals")
LOCAL_KEYS = ("data_cache_path", "staging_dir", "model_path", "tokenizer_path", "openmind_model_path")
PATH_FIELDS = ("path", "eval_path")  # the path items of a mixture source or a task mapping
# A run's folders (checkpoints written or read) may be object storage, but not a URL that is no such storage.
RUN_FOLDER_KEYS = ("save_dir", "resume", "cooldown_from")
NOT_RUN_FOLDERS = {"memory": "memory:// holds objects only while this process lives, so no checkpoint would "
                             "outlive the run; give a local folder or an object-storage URL (s3://bucket/run)",
                   "file": "a file:// URL is a local folder; give its path itself (e.g. /data/run)"}


def _map_paths(value, read):
    """`value` with `read` applied to each path in it: a string's words (data_path's `0.3 s3://...` blends), a
    list's items, a mapping's `path` / `eval_path`."""
    if isinstance(value, str):
        words = value.split()
        read_words = [read(word) for word in words]
        return " ".join(read_words) if read_words != words else value
    if isinstance(value, list):
        return [_map_paths(item, read) for item in value]
    if isinstance(value, dict):
        return {key: _map_paths(item, read) if key in PATH_FIELDS else item for key, item in value.items()}
    return value


# The keys whose value is one of a few names (`engine` is checked against the engine registry when the run picks its
# engine, parallel/registry.py; dtype when it is resolved, run/device.py)
CHOICES = {"lr_decay_style": DECAY_STYLES, "wsd_decay_shape": WSD_DECAY_SHAPES, "activation_checkpointing":
           ACTIVATION_CHECKPOINTING, "preflight_memory_check": MEMORY_CHECKS, "txt_mode": TXT_MODES,
           "new_token_init": NEW_TOKEN_INITS, "on_error": ON_ERROR, "export_dtype": DTYPES, "optimizer": OPTIMIZERS,
           "muon_adjust_lr": MUON_ADJUST_LR, "muon_ns_dtype": MUON_NS_DTYPES, "accumulate_gradients":
           ACCUMULATE_GRADIENTS, "checkpoint_failure": CHECKPOINT_FAILURES, "host_malloc_reuse": HOST_MALLOC_REUSE,
           "moe_aux_loss_type": AUX_LOSS_TYPES, "moe_token_drop_policy": DROP_POLICIES,
           "moe_experts_implementation": EXPERTS_IMPLEMENTATIONS, "parametrization": PARAMETRIZATIONS}


@dataclass
class PreTrainingArguments:
    # --- the seed's schema (openMind PreTrainingArguments) ---
    num_training_steps: int
    micro_batch_size: int
    dp: int
    gradient_accumulation_steps: int = 1
    seq_length: int | None = None
    megatron_dataset_flag: bool | None = None
    data_path: str | list | None = None
    save_dir: str | None = None
    save_interval: int | None = None
    eval_interval: int | None = None
    openmind_model_path: str | None = None
    dtype: str = "bf16"
    plugin_args: dict | None = None
    dataloader_config: dict | None = None
    report_to: str | None = None
    project_name: str = "accelerate-megatron"

    # --- model and data ---
    model_path: str | None = None
    sliced_weight_loading: bool = True
    tokenizer_path: str | None = None
    train_data: str | list | None = None
    mixture_schedule: list | None = None   # a mixture's weights by stage (config/mixture.py)
    eval_data: str | list | None = None
    eval_split: float | int = 0.05
    text_key: str = "text"
    txt_mode: str = "line"
    on_error: str = "fail"
    num_workers: int = 0
    tokenize_workers: int | None = None
    data_cache_path: str | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    # --- a larger tokenizer than the model's vocabulary (an extended one) ---
    pad_vocab_to_multiple_of: int = 64
    new_token_init: str = "subtoken_mean"
    allow_tokenizer_mismatch: bool = False
    trainable_parameters: str | list = "all"

    # --- longer contexts ---
    rope_scaling: dict | None = None
    rope_theta: float | None = None
    seq_length_schedule: list | None = None  # [{until_tokens, seq_length[, rope_theta, rope_scaling]}, ...]
    loss_chunk_size: int | str = "auto"
    z_loss_coeff: float = 0.0            # output z-loss: coeff x mean(logsumexp(logits)^2) over trained tokens
    mtp_num_layers: int = 0              # multi-token prediction depths (DeepSeek-V3's MTP; config/mtp.py)
    mtp_loss_coeff: float = DEFAULT_LOSS_COEFF  # the MTP loss's weight: coeff / depths x the sum of the depths' losses
    context_parallel_degree: int = 1
    fault_tolerance: dict | None = None  # replica groups kept in step by torchft (config/fault_tolerance.py)

    # --- Mixture-of-Experts (config/moe.py; only for a model with experts) ---
    moe_aux_loss_coeff: float | None = None          # load-balancing loss weight; null: router_aux_loss_coef
    moe_aux_loss_type: str | None = None             # seq (default) | micro_batch
    moe_z_loss_coeff: float | None = None            # router z-loss weight; null: 0 (off)
    moe_expert_bias_update_rate: float | None = None  # aux-loss-free balancing step; null: 0 (off)
    moe_experts_implementation: str | None = None    # auto (default) | eager | batched_mm | grouped_mm
    moe_capacity_factor: float | None = None         # null: dropless
    moe_token_drop_policy: str | None = None         # probs (default) | position
    expert_parallel_degree: int = 1                  # ep: each rank holds experts / ep of every MoE layer (fsdp)

    # --- optimisation ---
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_steps: int | None = None
    warmup_fraction: float | None = None
    warmup_tokens: float | None = None     # warmup in trained tokens (instead of warmup_steps / warmup_fraction)
    lr_decay_style: str = "cosine"
    wsd_decay_fraction: float = 0.2
    wsd_decay_tokens: float | None = None  # wsd: the decay's length in tokens (instead of wsd_decay_fraction)
    wsd_decay_shape: str = "linear"        # wsd (and cooldown branches): linear | cosine | 1-sqrt
    cooldown_from: str | None = None       # a checkpoint folder: start a cooldown branch there
    cooldown_tokens: float | None = None   # the branch's decay length in tokens (num_training_steps derived)
    override_schedule: bool = False        # resume although the schedule's keys changed since the checkpoint
    override_mixture: bool = False         # resume (or branch) although the mixture's weights changed
    override_mtp: bool = False             # resume with fewer mtp_num_layers than the checkpoint's (drops depths)
    batch_size_schedule: list | None = None  # [[tokens, sequences], ...]: a global batch that grows in stages
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    optimizer: str = "adamw"             # adamw | muon (Muon for hidden matrices, AdamW for the rest)
    muon_lr: float | None = None         # the Muon groups' peak lr; null: lr
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"
    muon_ns_dtype: str = "auto"          # auto (bf16 for bf16 runs, else fp32) | bf16 | fp32
    muon_params: list | None = None      # name globs forced onto Muon
    adamw_params: list | None = None     # name globs kept on AdamW
    clip_grad: float | None = 1.0
    init_method_std: float | None = None
    parametrization: str = "sp"                # sp | mup | completep (config/parametrization.py)
    mup_base_hidden_size: int | None = None    # the width the hyperparameters were tuned at
    mup_base_head_dim: int | None = None       # the base's head_dim; null: the model's (widened by adding heads)
    mup_base_num_layers: int | None = None     # completep: the depth they were tuned at
    seed: int = 42

    # --- loop, evaluation, checkpoints ---
    eval_iters: int = 20
    downstream_evals: list | None = None   # multiple-choice task files scored during training (config/downstream.py)
    log_interval: int = 1
    resume: str = "auto"
    exit_interval: int | None = None
    async_checkpoint: bool = False
    keep_last_checkpoints: int | None = None
    keep_checkpoints_every: int | None = None
    checkpoint_checksums: bool = True
    checkpoint_failure: str = "fatal"      # a checkpoint that cannot be uploaded: stop the run, or warn and go on
    storage_retries: int = 4              # tries of each object-storage operation before it counts as failed
    staging_dir: str | None = None        # the local folder a save_dir URL's files are written in first
    export_hf: bool = True
    export_dtype: str | None = None
    export_max_shard_size: str | int = "5GB"
    write_report: bool = True
    engine: str = "auto"
    device: str = "auto"
    activation_checkpointing: str = "none"
    compile: bool = False
    host_malloc_reuse: str | bool = "auto"  # auto | on | off (true/false read as on/off)
    preflight_memory_check: str | bool = "error"
    device_memory: str | int | None = None
    max_skipped_updates: int = 10
    loss_spike_factor: float | None = None
    spike_zscore: float | None = None      # skip an update whose loss or grad norm is this many std above the mean
    spike_window: int = 128                # accepted steps in spike_zscore's rolling mean and deviation
    distributed_timeout_minutes: float = 30.0
    peak_tflops: float | None = None
    deepspeed: str | dict | None = None
    fsdp_reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    fsdp_shard_size: int | None = None
    accumulate_gradients: str = "auto"   # sharded | unsharded | auto (engines that shard gradients)

    def __post_init__(self) -> None:
        # which keys the user set, and where (from_dict records the file's keys and lines; built directly, the
        # keys that differ from their default count as set)
        self.given_keys = frozenset(f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default)
        self.key_origins: dict[str, str] = {}
        self._coerce_scientific_strings()
        self._check_types()
        apply_openmind_rules(self)
        self.from_plugin_args = merge_megatron_values(self)
        self.given_keys |= self.from_plugin_args
        self._check_types()
        self._check_values()

    # ------------------------------------------------------------------ loading
    @staticmethod
    def from_yaml(config_path: str | Path | None, overrides: Sequence[str] = ()) -> "PreTrainingArguments":
        """Load a YAML file (the seed's schema or native keys), then apply `key=value` overrides."""
        if config_path is None:
            raise ConfigError("no config file given: pass a YAML path (e.g. --pretrain_config_file config.yaml)")
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        text = read_user_text(path, "config file")
        try:
            data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass refusing duplicate keys)
        except ConfigError as exc:
            raise ConfigError(f"{path}, {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got {type(data).__name__}")
        return PreTrainingArguments.from_dict(data or {}, overrides, source=str(path),
                                              key_lines=top_level_key_lines(text))

    @staticmethod
    def from_dict(data: dict, overrides: Sequence[str] = (), source: str = "config",
                  key_lines: dict[str, int] | None = None) -> "PreTrainingArguments":
        data = dict(data)
        names = {f.name for f in dataclasses.fields(PreTrainingArguments)}
        check_unique_overrides(overrides)
        for item in overrides:
            apply_override(data, item, names)
        key_lines = key_lines or {}

        given = {item.split("=", 1)[0].strip().split(".")[0]: item for item in overrides}

        def where(key: str) -> str:  # an override is the command line's, whatever the file says of its key
            if key in given:
                return f"{source}, override {given[key].split('=', 1)[0].strip()}=..."
            return f"{source}, line {key_lines[key]}" if key in key_lines else source

        for key in data:
            if key not in names:
                raise ConfigError(f"{where(key)}: unknown key {key!r}{suggestion(key, names)}")
        missing = [f.name for f in dataclasses.fields(PreTrainingArguments)
                   if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise ConfigError(f"{source}: required key(s) missing: {', '.join(missing)}")
        try:
            args = PreTrainingArguments(**data)
            check_given_against_megatron(data, args)
        except ConfigError as exc:
            key = getattr(exc, "key", None)
            raise ConfigError(f"{source if key is None else where(key)}: {exc}") from None
        args.given_keys |= frozenset(data)
        args.key_origins = {key: where(key) for key in data}
        for key in args.from_plugin_args - set(data):  # read from plugin_args.other_megatron_args
            args.key_origins[key] = where("plugin_args")
        return args

    def default_of(self, key: str):
        return next(f.default for f in dataclasses.fields(self) if f.name == key)

    def origin_of(self, key: str) -> str:
        """Where the user set `key` (`FILE, line N`, `FILE, override KEY=...`), for messages after loading."""
        return self.key_origins.get(key, "")

    # ------------------------------------------------------------ seed methods
    def get_mixed_precision(self) -> str:
        return "no" if self.dtype == "fp32" else self.dtype

    def get_torch_dtype(self):
        return torch_dtype(self.dtype)

    def get_distributed_train_args(self) -> dict:
        return dict(self.plugin_args or {})

    def update_distributed_train_args(self, extra_args: dict) -> None:
        if self.plugin_args is None:
            self.plugin_args = {}
        self.plugin_args.update(extra_args)

    def get_dataloader_config(self) -> dict:
        return dict(self.dataloader_config or {})

    # --------------------------------------------------------------- derived
    @property
    def batch_size(self) -> int:
        """The seed's global batch: micro_batch_size x gradient_accumulation_steps x dp."""
        return global_batch_size(self.micro_batch_size, self.gradient_accumulation_steps, self.dp)

    @property
    def megatron_args(self) -> dict:
        """`plugin_args.other_megatron_args` (empty when unset)."""
        return megatron_args(self.plugin_args)

    @property
    def data_split(self) -> str:
        """Train/valid/test document shares of prepared data: dataloader_config.split, the seed's
        other_megatron_args.split, or Megatron's default."""
        return str(self.get_dataloader_config().get("split") or self.megatron_args.get("split") or DEFAULT_DATA_SPLIT)

    @property
    def remote_save_dir(self) -> str | None:
        """`save_dir` when it is an object-storage URL."""
        return self.save_dir if is_url(self.save_dir) else None

    @property
    def run_dir(self) -> Path | None:
        """The local folder the run writes in: `save_dir`, or for a URL the staging folder mirrored to it."""
        if self.save_dir is None:
            return None
        return staging_folder(self.save_dir, self.staging_dir) if self.remote_save_dir else Path(self.save_dir)

    @property
    def resolved_model_path(self) -> str | None:
        return self.model_path or self.openmind_model_path

    @property
    def resolved_tokenizer_path(self) -> str | None:
        return self.tokenizer_path or self.resolved_model_path

    @property
    def resolved_train_data(self) -> list[str]:
        """Training files: `train_data`, or the seed's `data_path` when it names JSON-style files."""
        value = self.train_data if self.train_data is not None else (
            None if self.megatron_dataset_flag else self.data_path)
        if value is None:
            return []
        if is_mixture(value):  # every source's files
            return [path for source in self.mixture.sources for path in source.paths]
        return [value] if isinstance(value, str) else list(value)

    @property
    def mixture(self) -> Mixture | None:
        """The named, weighted sources of `train_data`, or of `data_path` (prepared prefixes, with
        megatron_dataset_flag), and `mixture_schedule`; None for plain files or prefixes."""
        value, key = self.train_data, "train_data"
        if not is_mixture(value) and is_mixture(self.data_path) and (self.megatron_dataset_flag or value is None):
            value, key = self.data_path, "data_path"
        return read_mixture(value, self.mixture_schedule, key)

    @property
    def resolved_eval_data(self) -> list[str]:
        if self.eval_data is None:
            return []
        return [self.eval_data] if isinstance(self.eval_data, str) else list(self.eval_data)

    @property
    def downstream_tasks(self) -> tuple[DownstreamTask, ...]:
        return read_downstream_tasks(self.downstream_evals)

    def warmup_steps_resolved(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_fraction is not None:
            return int(round(self.warmup_fraction * self.num_training_steps))
        return 0

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.plugin_args:
            out["plugin_args"] = plain(self.plugin_args)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]

    # ------------------------------------------------------------ validation
    def _coerce_scientific_strings(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            coerced = coerce_scientific(value)
            if isinstance(value, str) and coerced is not value:
                logger.warning("config key %r: string %r read as the number %s", f.name, value, coerced)
            setattr(self, f.name, coerced)

    def _check_types(self) -> None:
        """Each key's type, and every number in it (nested ones too) finite: no key documents NaN or inf."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            allowed = allowed_types(f.type)
            if value is None and type(None) in allowed:
                continue
            found = non_finite_at(value, f.name)
            if found is not None:
                raise key_error(f.name, not_finite_message(*found))
            if float in allowed and isinstance(value, int) and not isinstance(value, bool):
                setattr(self, f.name, float(value) if int not in allowed else value)
                continue
            if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
                finite = "; a finite number is needed" if reads_as_not_finite(value) else ""  # `z_loss_coeff=nan`
                raise key_error(f.name, f"expected {describe_types(allowed)}, got {value!r} "
                                f"({type(value).__name__}){finite}")

    def _check_values(self) -> None:
        for key, (bound, hint) in BOUNDS.items():
            value = getattr(self, key)
            if value is not None and out_of_bounds(value, bound):
                within = f"must be {bound}" if bound[0] not in "[(" else f"must be in {bound}"
                raise key_error(key, f"{key} {within}, got {value}" + (f" ({hint})" if hint else ""))
        self._check_choices()
        self._check_sizes()
        self._check_long_context()
        self._check_optimization()
        self._check_loop()
        self._check_path_lists()
        self._read_paths()
        check_features(self)
        check_parametrization(self)
        mixture = self.mixture  # read once here, so a mistake fails at load
        own_eval = [source.name for source in (mixture.sources if mixture else ()) if source.eval_paths]
        if own_eval and (self.eval_data is not None or self.megatron_dataset_flag):
            why = "eval_data replaces every source's held-out set" if self.eval_data is not None else \
                "prepared prefixes are evaluated on their valid split"
            raise key_error("eval_data" if self.eval_data is not None else "data_path",
                            f"source(s) {', '.join(own_eval)} give an eval_path, but {why}; remove one of them")
        read_downstream_tasks(self.downstream_evals)

    def _read_paths(self) -> None:
        """Every key's paths through the one URL parser (config/urls.py), so a string means the same everywhere
        (docs/remote-storage.md, 'URLs and clients')."""
        for key in URL_KEYS + LOCAL_KEYS:
            def read(text: str, key=key) -> str:
                try:
                    url = parse_url(text)
                except ConfigError as exc:
                    raise key_error(key, str(exc)) from None
                if url is not None and key in RUN_FOLDER_KEYS and url.split("://")[0] in NOT_RUN_FOLDERS:
                    raise key_error(key, f"{text}: {NOT_RUN_FOLDERS[url.split('://')[0]]}")
                if url is not None and key in LOCAL_KEYS:
                    raise key_error(key, f"{text} is a URL ({url.split('://')[0]}://); object storage is read for a "
                                    "run's data, tasks and folders (save_dir, resume, cooldown_from), not here: give "
                                    "a local path, or mount the bucket (s3fs-fuse, gcsfuse, blobfuse2) and give the "
                                    "mount's path")
                return url or text
            setattr(self, key, _map_paths(getattr(self, key), read))

    def _check_path_lists(self) -> None:
        """Each item of a list of files is a path, glob or folder (a string), not a nested list or mapping;
        `data_path` may also hold Megatron's blend weights (numbers)."""
        for name, numbers in (("train_data", False), ("eval_data", False), ("data_path", True)):
            value = getattr(self, name)
            if name in ("train_data", "data_path") and is_mixture(value):  # named sources: config/mixture.py
                continue
            for index, item in enumerate(value if isinstance(value, list) else ()):
                if not (isinstance(item, str) and item.strip()) and not (
                        numbers and isinstance(item, (int, float)) and not isinstance(item, bool)):
                    raise key_error(name, f"{name}[{index}] is {item!r} ({type(item).__name__}); each item is a "
                                    "path, a glob or a folder" + (" (or a blend weight)" if numbers else "")
                                    + ", e.g. [data/a.jsonl, 'data/b/*.txt']")

    def _check_choices(self) -> None:
        if isinstance(self.preflight_memory_check, bool):  # YAML reads a bare `off` as false (and `on` as true)
            self.preflight_memory_check = "error" if self.preflight_memory_check else "off"
        if isinstance(self.host_malloc_reuse, bool):
            self.host_malloc_reuse = "on" if self.host_malloc_reuse else "off"
        if self.export_dtype is not None:
            self.export_dtype = self.export_dtype.lower()
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise key_error(name, f"{name} {value!r} is not one of {', '.join(allowed)}")
        if isinstance(self.trainable_parameters, list) and not (
                self.trainable_parameters and all(isinstance(p, str) and p for p in self.trainable_parameters)):
            raise key_error("trainable_parameters", "trainable_parameters is all, embeddings, or a non-empty list of "
                             "glob patterns over parameter names (e.g. ['model.embed_tokens.*', 'lm_head.*'])")
        if self.resume not in ("auto", "none") and not self.resume:
            raise key_error("resume", "resume is 'auto', 'none' or a checkpoint folder")

    def _check_sizes(self) -> None:
        if self.device_memory is not None:  # e.g. 20GB; read here so a typo fails at load, not at the check
            try:
                parse_size(self.device_memory, "device_memory")
            except ConfigError as exc:
                raise key_error("device_memory", str(exc)) from None
        if not _is_shard_size(self.export_max_shard_size):
            raise key_error("export_max_shard_size", f"export_max_shard_size {self.export_max_shard_size!r}: give a "
                             "number of bytes or a size in KB, MB, GB or TB (powers of 1000, as save_pretrained)")
        if isinstance(self.eval_split, float) and not 0 <= self.eval_split < 1:
            raise key_error("eval_split", "eval_split is a fraction in [0, 1) of the documents or a count >= 0")
        if isinstance(self.eval_split, int) and self.eval_split < 0:
            raise key_error("eval_split", "eval_split must be >= 0")

    def _check_optimization(self) -> None:
        given = [k for k in ("warmup_steps", "warmup_fraction", "warmup_tokens") if getattr(self, k) is not None]
        if len(given) > 1:
            raise key_error(given[1], f"set one of warmup_steps, warmup_fraction and warmup_tokens, not {given[0]} "
                            f"and {given[1]}")
        self._check_wsd()
        self._check_batch_ramp()
        if self.warmup_steps_resolved() > self.num_training_steps:
            raise key_error("warmup_steps", f"warmup ({self.warmup_steps_resolved()} steps) is longer than "
                             f"num_training_steps ({self.num_training_steps}); give fewer warmup_steps, or "
                            "warmup_fraction (a share of the run, which scales with it)")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise key_error("min_lr", f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        for name in ("muon_params", "adamw_params"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, list) and all(isinstance(p, str) and p for p in value)):
                raise key_error(name, f"{name} is a list of glob patterns over parameter names (e.g. "
                                 f"['model.layers.*.mlp.*']), got {value!r}")

    def _check_batch_ramp(self) -> None:
        stages = self.batch_size_schedule
        if stages is None:
            return
        example = "e.g. [[0, 64], [2e6, 128], [8e6, 256]] (from token 0, 64 sequences per step; ...)"
        if not (isinstance(stages, list) and stages and all(
                isinstance(stage, (list, tuple)) and len(stage) == 2 and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in stage) for stage in stages)):
            raise key_error("batch_size_schedule", f"batch_size_schedule is a list of [tokens, sequences] pairs, "
                            f"{example}; got {stages!r}")
        starts = [float(start) for start, _ in stages]
        if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
            raise key_error("batch_size_schedule", f"the stages' tokens must start at 0 and increase, got "
                            f"{[start for start, _ in stages]}; {example}")
        if any(seqs < 1 or seqs != int(seqs) for _, seqs in stages):
            raise key_error("batch_size_schedule", f"each stage's sequences per step must be a whole number >= 1, "
                            f"got {[seqs for _, seqs in stages]}")
        unreachable = next((index for index, (start, _) in enumerate(stages) if start > MAX_RUN_TOKENS), None)
        if unreachable is not None:
            raise key_error("batch_size_schedule", f"batch_size_schedule[{unreachable}] starts at token "
                            f"{stages[unreachable][0]:.3g}, beyond what a run's 64-bit token counts reach "
                            f"({MAX_RUN_TOKENS:.3g}): it would never start; {example}")
        self.batch_size_schedule = [[int(start), int(seqs)] for start, seqs in stages]

    def _check_wsd(self) -> None:
        if (self.cooldown_from is None) != (self.cooldown_tokens is None):
            given, missing = ("cooldown_from", "cooldown_tokens") if self.cooldown_tokens is None else \
                ("cooldown_tokens", "cooldown_from")
            raise key_error(missing, f"{given} needs {missing}: a cooldown branch starts at a checkpoint "
                            "(cooldown_from=RUN/checkpoints/step-N) and decays over a number of tokens "
                            "(cooldown_tokens=T)")
        if self.wsd_decay_tokens is not None and self.wsd_decay_fraction != 0.2:
            raise key_error("wsd_decay_tokens", "set wsd_decay_tokens or wsd_decay_fraction, not both")

    def _check_loop(self) -> None:
        check_mtp_keys(self.mtp_num_layers, self.mtp_loss_coeff)
        longest = datetime.timedelta.max.total_seconds() / 60  # what a process group's timeout can hold
        if not 0 < self.distributed_timeout_minutes <= longest:
            raise key_error("distributed_timeout_minutes", f"distributed_timeout_minutes must be > 0 and at most "
                            f"{longest:.3g} (a timedelta's limit), got {self.distributed_timeout_minutes:g}")

    @property
    def replica_settings(self):
        """`fault_tolerance` read (config/fault_tolerance.py); None without one."""
        return read_fault_tolerance(self.fault_tolerance)

    @property
    def seq_stages(self):
        """`seq_length_schedule` read (config/seq_stages.py); None without one."""
        return read_seq_length_schedule(self.seq_length_schedule, ROPE_TYPES)

    def _check_seq_stages(self) -> None:
        stages = self.seq_stages
        if stages is None:
            return
        top = [key for key in ("rope_scaling", "rope_theta") if getattr(self, key) is not None]
        if top and stages.sets_rope:
            raise key_error(top[0], f"{top[0]} is set for the whole run and seq_length_schedule's stages set RoPE "
                            "too; set it in the stages only (a stage without RoPE keys trains with the model's own)")
        if self.batch_size_schedule is not None and any(stage.sequences is not None for stage in stages.stages):
            raise key_error("seq_length_schedule", "a stage names sequences and batch_size_schedule is set: both "
                            "set the global batch; use one of them")

    def _check_long_context(self) -> None:
        self._check_seq_stages()
        settings = self.replica_settings
        if settings is not None and (self.batch_size_schedule is not None or any(
                stage.sequences is not None for stage in (self.seq_stages.stages if self.seq_stages else ()))):
            raise key_error("fault_tolerance", "fault_tolerance with a batch ramp (batch_size_schedule, or stages "
                            "naming sequences) is not available; remove one of them")
        spike = [key for key in ("loss_spike_factor", "spike_zscore") if getattr(self, key)]
        if settings is not None and spike:
            raise key_error(spike[0], f"{spike[0]} with fault_tolerance is not available: each replica group would "
                            "judge its own loss and skip updates the others apply; remove one of them")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_TYPES:
                raise key_error("rope_scaling", f"rope_scaling needs rope_type, one of {', '.join(ROPE_TYPES)} (got "
                                 f"{kind!r}); e.g. rope_scaling: {{rope_type: yarn, factor: 4.0}}")
            factor = self.rope_scaling.get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
                raise key_error("rope_scaling", f"rope_scaling.factor must be a number >= 1 (the new length over the "
                                 f"original), got {factor!r}")
        if self.context_parallel_degree > 1 and self.reset_attention_mask:
            raise key_error("context_parallel_degree", "context_parallel_degree > 1 cannot split sequences whose "
                             "attention stops at document boundaries (reset_attention_mask: true); use one of them "
                             "(reset_position_ids alone works)")
        chunk = self.loss_chunk_size
        if isinstance(chunk, str) and chunk != "auto" or isinstance(chunk, int) and chunk < 0:
            raise key_error("loss_chunk_size", f"loss_chunk_size is auto, 0 (off) or a number of tokens per chunk, "
                             f"got {chunk!r}")


def _is_shard_size(value) -> bool:
    """A size `save_pretrained`'s `max_shard_size` takes: bytes, or `5GB`, `500MB` (its units)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value > 0
    return re.fullmatch(r"\s*\d+(\.\d+)?\s*[KMGT]B\s*", str(value), flags=re.IGNORECASE) is not None
