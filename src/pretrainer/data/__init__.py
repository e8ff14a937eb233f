"""Data: readers for local files, tokenize-and-pack, indexed .bin/.idx, preparation, sharded sampling.

Names are loaded on first use, so the readers and `prepare` work without importing torch.
"""

import importlib

_HOMES = {
    "BatchStream": "loader", "BuiltData": "loader", "build_datasets": "loader", "build_indexed_datasets": "loader",
    "split_documents": "loader", "split_ranges": "loader",
    "parse_data_path": "loader",
    "PackedDataset": "packing", "collate_packed": "packing", "tokenize_documents": "packing",
    "DocumentMasking": "packing", "document_position_ids": "packing",
    "GPTSamples": "gpt_samples", "BlendedSamples": "gpt_samples", "IndexCache": "gpt_samples",
    "EvalBatches": "sampling", "SampleStream": "sampling",
    "DataError": "readers", "Document": "readers", "expand_paths": "readers", "read_documents": "readers",
    "record_to_text": "readers",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'pretrainer.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
