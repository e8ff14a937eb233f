"""Datasets handed over by the seed's `custom_megatron_datasets_provider_function` hook, as packed samples."""

from __future__ import annotations

import numpy as np
import torch

from ..batch import IGNORE
from ..config import ConfigError
from .builders import BuiltData


def provided_datasets(provider, sizes) -> BuiltData:
    """Call the hook with [train, valid, test] sample counts (all replicas) and check what it returns."""
    provided = provider([sizes.train_samples, sizes.eval_samples, 0])
    if not isinstance(provided, (tuple, list)) or len(provided) != 3:
        raise ConfigError("custom_megatron_datasets_provider_function must return (train, valid, test) datasets")
    train, valid, _ = provided
    if train is None:
        raise ConfigError("custom_megatron_datasets_provider_function returned no training dataset")
    return BuiltData(ProvidedSamples(train, sizes.seq_length, "train"),
                     ProvidedSamples(valid, sizes.seq_length, "valid") if valid is not None else None)


class ProvidedSamples(torch.utils.data.Dataset):
    """A dataset from custom_megatron_datasets_provider_function, as packed samples."""

    def __init__(self, dataset, seq_length: int, name: str):
        self.dataset, self.seq_length, self.name = dataset, seq_length, name
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ConfigError(f"custom_megatron_datasets_provider_function: the {name} dataset needs len() and "
                              f"[i], got {type(dataset).__name__}")
        if len(dataset) == 0:
            raise ConfigError(f"custom_megatron_datasets_provider_function: the {name} dataset is empty")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        item = self.dataset[index]
        if isinstance(item, dict) and "tokens" in item:
            inputs = torch.as_tensor(np.asarray(item["tokens"])).long()
            labels = torch.as_tensor(np.asarray(item["labels"])).long()
            if "loss_mask" in item:
                labels = labels.masked_fill(torch.as_tensor(np.asarray(item["loss_mask"])) == 0, IGNORE)
        else:
            tokens = item["text"] if isinstance(item, dict) else item
            tokens = torch.as_tensor(np.asarray(tokens)).long()
            inputs, labels = tokens[:-1], tokens[1:]
        if inputs.dim() != 1 or inputs.shape != labels.shape or len(inputs) > self.seq_length:
            raise ConfigError(f"custom_megatron_datasets_provider_function: {self.name} sample {index} has "
                              f"{tuple(inputs.shape)} inputs; expected 1-D of up to seq_length={self.seq_length} "
                              "(a sample holds seq_length+1 tokens)")
        return {"input_ids": inputs, "shift_labels": labels}
