"""Data: readers for local files, tokenize-and-pack, and the resumable batch stream."""

from .loader import BatchStream, BuiltData, build_datasets, build_indexed_datasets, split_documents, split_ranges
from .packing import PackedDataset, collate_packed, tokenize_documents
from .sampling import EvalBatches, SampleStream
from .readers import DataError, Document, expand_paths, read_documents, record_to_text

__all__ = ["BatchStream", "BuiltData", "DataError", "Document", "EvalBatches", "PackedDataset", "SampleStream",
           "build_datasets", "build_indexed_datasets", "collate_packed", "expand_paths", "read_documents", "record_to_text",
           "split_documents", "split_ranges", "tokenize_documents"]
