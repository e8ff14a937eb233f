"""`prepare --sharded --merge`: the shards a manifest lists streamed into one `.bin/.idx` pair (docs/data.md, 'A corpus
on a cluster'), for tools that read a single Megatron pair.

Memory stays flat whatever the corpus: the `.bin`s are copied in blocks, and the `.idx`'s three arrays (lengths,
pointers, document indices) are written one after the other, each a pass over the shards' indices, one shard at a
time. The pair is the one the one-machine `prepare` writes for the same files, byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from .errors import DataError
from .indexed import DTYPE_CODES, MAGIC, VERSION, IndexedDataset, _partial_suffix
from .shard_store import MANIFEST, read_manifest, sha256

BLOCK = 1 << 22  # bytes copied, or document indices written, at a time


def merge_shards(folder: Path) -> Path:
    """`{folder}.bin` and `{folder}.idx` from the shards `folder/manifest.json` lists, each checked against the
    manifest's checksums as it is read; returns the pair's prefix."""
    manifest = read_manifest(folder)
    if not manifest:
        raise DataError(f"--merge {folder}: no {MANIFEST} of `prepare --sharded` there")
    shards = [folder / s["shard"] for s in manifest["shards"]]
    dtype = getattr(np, manifest["dtype"])
    prefix = Path(str(folder))
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    tmp_bin, tmp_idx = (p.with_name(f".{p.name}{_partial_suffix()}") for p in (bin_path, idx_path))
    try:
        with open(tmp_bin, "wb") as out:
            sizes = [_copy_checked(Path(f"{shard}.bin"), out, entry["bin_sha256"])
                     for shard, entry in zip(shards, manifest["shards"])]
        documents = manifest["documents"]
        with open(tmp_idx, "wb") as out:
            out.write(MAGIC + struct.pack("<QBQQ", VERSION, DTYPE_CODES[dtype], documents, documents + 1))
            for shard, entry in zip(shards, manifest["shards"]):  # the lengths, checking each index on the way
                if sha256(Path(f"{shard}.idx")) != entry["idx_sha256"]:
                    raise DataError(f"--merge: {shard}.idx changed since {folder / MANIFEST} was written; run "
                                    "the same prepare command again")
                out.write(IndexedDataset(shard).sequence_lengths.tobytes())
            offset = 0
            for shard, size in zip(shards, sizes):
                out.write((IndexedDataset(shard).sequence_pointers + offset).tobytes())
                offset += size
            for start in range(0, documents + 1, BLOCK):
                out.write(np.arange(start, min(start + BLOCK, documents + 1), dtype=np.int64).tobytes())
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)  # last: the pair is complete once the .idx exists
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    return prefix


def _copy_checked(source: Path, out, expected: str) -> int:
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
            out.write(block)
            size += len(block)
    if digest.hexdigest() != expected:
        raise DataError(f"--merge: {source} changed since its manifest was written; run the same prepare command "
                        "again")
    return size

