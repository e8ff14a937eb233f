"""Data: readers for local files, tokenize-and-pack, indexed .bin/.idx, preparation, dataset builders,
streams of micro-batches, and `assemble_data`, the entry point the loop calls.

Names are loaded on first use, so the readers and `prepare` work without importing torch.
"""

import importlib

_HOMES = {
    "DataPlacement": "assemble", "RunData": "assemble", "assemble_data": "assemble",
    "build_datasets": "builders", "build_indexed_datasets": "builders", "split_indices": "builders",
    "split_ranges": "builders", "parse_data_path": "builders", "mixture_plan": "builders",
    "PackedDataset": "packing", "collate_packed": "packing", "DocumentMasking": "packing",
    "document_position_ids": "packing",
    "GPTSamples": "gpt_samples", "BlendedSamples": "gpt_samples", "IndexCache": "gpt_samples",
    "BatchStream": "streams", "EvalBatches": "streams", "SampleStream": "streams",
    "DataError": "errors", "expand_paths": "readers", "read_documents": "readers",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'pretrainer.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
