"""pretrainer: pretrain and continue pretraining causal language models from a YAML config."""

from .config import ConfigError, PreTrainingArguments
from .data.readers import DataError
from .utils import get_pretrain_config_file

__version__ = "0.1.0"

__all__ = ["Callback", "ConfigError", "DataError", "PreTrainer", "PreTrainingArguments", "StepResult", "TrainState",
           "add_model_config_to_megatron_parser", "get_pretrain_config_file", "parse_llama_config"]


def __getattr__(name: str):
    # The trainer (torch, transformers) loads on first use, so `pretrainer prepare` and its workers start without it.
    if name == "PreTrainer":
        from .train import PreTrainer

        return PreTrainer
    if name in ("Callback", "StepResult", "TrainState"):
        from .run import callbacks

        return getattr(callbacks, name)
    if name in ("add_model_config_to_megatron_parser", "parse_llama_config"):
        from .models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'pretrainer' has no attribute {name!r}")
