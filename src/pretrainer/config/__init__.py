"""The run's configuration: `arguments` (the schema, its loading and checks), `openmind` (the openMind compatibility
layer), `dtypes`, and the typed parts a run is resolved into: `dims` (parallel dimensions), `sizes`, `optimization`
(optimizer and schedule) and `moe` (Mixture-of-Experts); `paths` checks the folders a run writes. Nothing writes to the
loaded arguments after `PreTrainingArguments` has checked them."""

from .arguments import ACTIVATION_CHECKPOINTING, ON_ERROR, PreTrainingArguments
from .dims import ParallelDims
from .downstream import DownstreamTask, read_downstream_tasks
from .dtypes import DTYPES, dtype_name, torch_dtype
from .errors import ConfigError, key_error
from .loading import parse_size
from .moe import MoeSettings, expert_shape
from .mtp import MtpSettings, mtp_settings
from .openmind import HOOK_KEYS, MEGATRON_KEY_TO_FIELD
from .optimization import MUON_ADJUST_LR, BranchPoint, OptimizerSettings, ScheduleSettings
from .parametrization import Parametrization, Scale
from .paths import CHECKPOINT_STATE_FILE, check_writable_folder, extra_state_file, staging_folder, write_text_whole
from .sizes import BatchSizes, global_batch_size, resolve_seq_length

__all__ = ["ACTIVATION_CHECKPOINTING", "BatchSizes", "BranchPoint", "CHECKPOINT_STATE_FILE", "ConfigError", "DTYPES",
           "DownstreamTask", "HOOK_KEYS", "MEGATRON_KEY_TO_FIELD", "MUON_ADJUST_LR", "MoeSettings", "MtpSettings",
           "ON_ERROR", "OptimizerSettings", "ParallelDims", "Parametrization", "PreTrainingArguments", "Scale",
           "ScheduleSettings", "check_writable_folder", "dtype_name", "expert_shape", "extra_state_file",
           "global_batch_size", "key_error", "mtp_settings", "parse_size", "read_downstream_tasks",
           "resolve_seq_length", "staging_folder", "torch_dtype", "write_text_whole"]
