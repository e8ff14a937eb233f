"""pretrainer: pretrain and continue pretraining causal language models from a YAML config."""

from .config import ConfigError, PreTrainingArguments
from .data import DataError
from .train import PreTrainer
from .utils import get_pretrain_config_file

__version__ = "0.1.0"

__all__ = ["ConfigError", "DataError", "PreTrainer", "PreTrainingArguments", "get_pretrain_config_file"]
