"""The run's configuration: the schema and its loading (`arguments`), the openMind compatibility layer
(`openmind`), the dtype table (`dtypes`), the resolved run plan (`run_plan`), and the check of the folders a run
writes (`paths`)."""

from .arguments import DEFAULT_DATA_SPLIT, NEW_TOKEN_INITS, ON_ERROR, PreTrainingArguments
from .dtypes import DTYPES, dtype_name, torch_dtype
from .errors import ConfigError, key_error
from .loading import parse_size
from .openmind import HOOK_KEYS, MEGATRON_KEY_TO_FIELD, megatron_args
from .paths import check_writable_folder
from .run_plan import RunPlan, global_batch_size, resolve_run_plan, resolve_seq_length

__all__ = ["DEFAULT_DATA_SPLIT", "DTYPES", "HOOK_KEYS", "MEGATRON_KEY_TO_FIELD", "NEW_TOKEN_INITS", "ON_ERROR",
           "ConfigError", "PreTrainingArguments", "RunPlan", "check_writable_folder", "dtype_name", "global_batch_size",
           "key_error", "megatron_args", "parse_size", "resolve_run_plan", "resolve_seq_length", "torch_dtype"]
