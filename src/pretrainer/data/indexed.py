"""Megatron-Core's indexed dataset on disk (`PREFIX.bin` + `PREFIX.idx`), written and read byte-compatibly.

`.bin` holds the token ids of all sequences back to back (no header). `.idx` (little-endian): magic
`MMIDIDX\\0\\0`, version 1 (u64), dtype code (u8), sequence count N (u64), document-index length D (u64),
then int32[N] sequence lengths, int64[N] byte pointers into `.bin`, int64[D] document indices (sequence
boundaries of documents, starting at 0). One document is one sequence here.

The writer streams tokens to hidden temporary files and renames them into place only in `finalize`, the
`.idx` last, so an interrupted write never leaves a pair that looks complete.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from pathlib import Path

import numpy as np

from .errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
               np.uint16: 8}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# A write that failed for want of room (a full disk, a file-size limit, a quota), not a broken disk.
NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def optimal_dtype(vocab_size: int):
    """Megatron's rule: uint16 below 65,500 tokens, int32 otherwise."""
    return np.uint16 if vocab_size < 65500 else np.int32


def paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def _partial_suffix(pid: int | None = None) -> str:
    return f".tmp-{socket.gethostname()}-{pid or os.getpid()}"


def remove_stale_partial_files(folder: Path) -> int:
    """Delete the temporary files that writers on this machine left when killed (their process is gone);
    returns how many. Files of live writers, and of writers on other machines, are left alone."""
    removed = 0
    for path in folder.glob(f".*{_partial_suffix(pid=1)[:-1]}*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_exists(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class IndexedDatasetWriter:
    def __init__(self, prefix: str | Path, dtype=np.uint16):
        self.bin_path, self.idx_path = paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self._tmp_bin = self.bin_path.with_name(f".{self.bin_path.name}{_partial_suffix()}")
        self._tmp_idx = self.idx_path.with_name(f".{self.idx_path.name}{_partial_suffix()}")
        self._bin = open(self._tmp_bin, "wb")
        self.lengths: list[np.ndarray] = []  # one int32 array per batch of documents

    def add_document(self, tokens) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self.add_documents(array.tobytes(order="C"), np.array([len(array)], dtype=np.int32))

    def add_documents(self, tokens: bytes, lengths: np.ndarray) -> None:
        """Several documents at once: their tokens back to back in this writer's dtype, and their lengths."""
        self._bin.write(tokens)
        self.lengths.append(np.asarray(lengths, dtype=np.int32))

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int32)
        itemsize = np.dtype(self.dtype).itemsize
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, DTYPE_CODES[self.dtype], len(lengths), len(documents)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(documents.tobytes(order="C"))
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)  # last: the pair is complete once the .idx exists

    def abort(self) -> None:
        self._bin.close()
        for tmp in (self._tmp_bin, self._tmp_idx):
            tmp.unlink(missing_ok=True)


class IndexedTokens:
    """What the samplers read: `tokens` (sliceable), `dtype`, per sequence its length and byte pointer, and the
    sequence boundaries of documents. IndexedDataset reads them from a `.idx`; token_formats.py from other formats."""

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def document_token_range(self, first: int, last: int) -> tuple[int, int]:
        """Token offsets [start, end) of documents [first, last) in `tokens`."""
        itemsize = np.dtype(self.dtype).itemsize
        seq_first, seq_last = int(self.document_indices[first]), int(self.document_indices[last])
        if seq_first == seq_last:
            return 0, 0
        start = int(self.sequence_pointers[seq_first]) // itemsize
        end = int(self.sequence_pointers[seq_last - 1]) // itemsize + int(self.sequence_lengths[seq_last - 1])
        return start, end

    def __getitem__(self, sequence: int) -> np.ndarray:
        start = int(self.sequence_pointers[sequence]) // np.dtype(self.dtype).itemsize
        return np.asarray(self.tokens[start:start + int(self.sequence_lengths[sequence])])


class IndexedDataset(IndexedTokens):
    """Read-only view: `tokens` is the whole `.bin` as a memory-mapped array."""

    def __init__(self, prefix: str | Path):
        self.bin_path, self.idx_path = paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError(f"data_path {prefix}: {path} does not exist (prepare data with `pretrainer "
                                "prepare`, which writes PREFIX.bin and PREFIX.idx)")
        raw = self.idx_path.read_bytes()
        if raw[:9] != MAGIC:
            raise DataError(f"{self.idx_path}: not a Megatron indexed-dataset index (bad magic)")
        version, code, count, doc_count = struct.unpack_from("<QBQQ", raw, 9)
        if version != VERSION:
            raise DataError(f"{self.idx_path}: index version {version}, expected {VERSION}")
        if code not in CODE_DTYPES:
            raise DataError(f"{self.idx_path}: unknown dtype code {code}")
        self.dtype = CODE_DTYPES[code]
        self.sequence_lengths = np.frombuffer(raw, np.int32, count, 34)  # after the 34-byte header
        self.sequence_pointers = np.frombuffer(raw, np.int64, count, 34 + 4 * count)
        self.document_indices = np.frombuffer(raw, np.int64, doc_count, 34 + 12 * count)
        if doc_count == 0 or self.document_indices[-1] != count:
            raise DataError(f"{self.idx_path}: document indices do not end at the sequence count")
        itemsize = np.dtype(self.dtype).itemsize
        expected = int(self.sequence_lengths.astype(np.int64).sum()) * itemsize
        if self.bin_path.stat().st_size != expected:
            raise DataError(f"{self.bin_path}: {self.bin_path.stat().st_size} bytes, but its index describes "
                            f"{expected}; the pair is from different runs or truncated — prepare it again")
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if expected else np.zeros(0, self.dtype)

    def describe(self) -> dict:
        """What the sample-index cache is keyed by: a re-prepared dataset gets new indices."""
        idx_stat = self.idx_path.stat()
        return {"bin": str(self.bin_path.resolve()), "idx_bytes": idx_stat.st_size,
                "idx_mtime_ns": idx_stat.st_mtime_ns}
