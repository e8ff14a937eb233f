"""Corpora tokenized by other toolchains, read as the indexed dataset the samplers use (docs/data.md, 'Corpora
tokenized elsewhere'): datatrove's `.ds` shards and dolma/OLMo's `.npy` token arrays, beside Megatron's `.bin/.idx`.

Every format becomes one sequence per document, documents in file order (files in sorted name order), so a corpus
samples exactly as the same text prepared by `pretrainer prepare` into one `.bin/.idx` pair would. Files are memory
mapped; nothing but the document boundaries is held in memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .indexed import IndexedDataset, IndexedTokens
from .readers import DataError
from .shard_store import MANIFEST, is_sharded, read_manifest

SCAN_TOKENS = 1 << 24  # tokens read at a time when a pass over a file is needed (flat memory)


def open_prepared(path: str | Path, tokenizer=None):
    """The corpus at `path`: a Megatron prefix, the folder `prepare --sharded` wrote, a datatrove `.ds` file or
    folder of them, a dolma `.npy` file or folder of them. `tokenizer` (the run's) checks the ids against its
    vocabulary and gives dolma's EOS."""
    path = Path(path)
    if is_sharded(path):
        return _checked(sharded_corpus(path), tokenizer)
    datatrove, dolma = _files(path, ".ds"), _files(path, ".npy")
    if datatrove and dolma:
        raise DataError(f"data_path {path}: holds both datatrove .ds and dolma .npy files; give each corpus its own "
                        "folder (and data_path entry)")
    if path.is_dir() and not datatrove and not dolma:
        raise DataError(f"data_path {path}: a folder without datatrove .ds or dolma .npy token files; a corpus "
                        "prepared here or by Megatron is named by its prefix (PREFIX for PREFIX.bin and PREFIX.idx)")
    if datatrove:
        return _checked(datatrove_corpus(datatrove, tokenizer), tokenizer)
    if dolma:
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise DataError(f"data_path {path}: dolma token files mark documents with the tokenizer's EOS; give a "
                            "model_path (or tokenizer) whose tokenizer has an eos_token")
        return _checked(dolma_corpus(dolma, tokenizer.eos_token_id, len(tokenizer)), tokenizer)
    return IndexedDataset(path)


def _files(path: Path, suffix: str) -> list[Path]:
    if path.is_file() and path.suffix == suffix:
        return [path]
    return sorted(path.glob(f"*{suffix}")) if path.is_dir() else []


class TokenFiles(IndexedTokens):
    """Token files of one dtype read as one corpus: the IndexedDataset interface over several memory maps."""

    def __init__(self, files: list[Path], arrays: list[np.ndarray], lengths: list[np.ndarray], fmt: str):
        self.files, self.format = files, fmt
        kinds = sorted({a.dtype.name for a in arrays})
        if len(kinds) > 1:
            raise DataError(f"data_path {files[0].parent}: the {fmt} files mix token types ({', '.join(kinds)}); "
                            "tokenize the corpus with one tokenizer and token size")
        self.dtype = arrays[0].dtype.type
        self.tokens = _Concatenated(arrays)
        self.sequence_lengths = np.concatenate(lengths).astype(np.int64)
        itemsize = np.dtype(self.dtype).itemsize
        starts = np.zeros(len(self.sequence_lengths), dtype=np.int64)
        np.cumsum(self.sequence_lengths[:-1], out=starts[1:])
        self.sequence_pointers = starts * itemsize  # bytes, as in a Megatron index
        self.document_indices = np.arange(len(self.sequence_lengths) + 1, dtype=np.int64)
        self.bin_path = files[0]

    def describe(self) -> dict:
        """What the sample-index cache is keyed by: every file, its size and its modification time."""
        return {"files": [str(f.resolve()) for f in self.files], "bytes": [f.stat().st_size for f in self.files],
                "mtime_ns": [f.stat().st_mtime_ns for f in self.files]}


class _Concatenated:
    """Slices of several arrays as if they were one; a slice never crosses a file (documents do not)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.starts = np.concatenate([[0], np.cumsum([len(a) for a in arrays], dtype=np.int64)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, window: slice) -> np.ndarray:
        file = int(np.searchsorted(self.starts, window.start, side="right")) - 1
        offset = int(self.starts[file])
        return self.arrays[file][window.start - offset:window.stop - offset]


def sharded_corpus(folder: Path) -> TokenFiles:
    """The shards `prepare --sharded` (or `--ray`) wrote, in the manifest's order: one corpus."""
    manifest = read_manifest(folder)
    shards = [IndexedDataset(folder / entry["shard"]) for entry in manifest.get("shards", [])]
    if not shards:
        raise DataError(f"data_path {folder}: {MANIFEST} lists no shards; prepare the corpus again")
    counts = [(s.num_documents, entry["documents"]) for s, entry in zip(shards, manifest["shards"])]
    if any(held != listed for held, listed in counts):
        raise DataError(f"data_path {folder}: its shards hold other documents than {MANIFEST} lists; a shard was "
                        "replaced after the manifest was written: run the same `prepare --sharded` again")
    return TokenFiles([s.bin_path for s in shards], [s.tokens for s in shards], [s.sequence_lengths for s in shards],
                      "pretrainer-shards")


def datatrove_corpus(files: list[Path], tokenizer=None) -> TokenFiles:
    """datatrove's DocumentTokenizer output: tokens in `X.ds`, each document's end (uint64, in tokens) in `X.ds.index`,
    the token size in `X.ds.metadata` ("tokenizer|size"; else 4 bytes only for vocabularies over 65,536)."""
    arrays, lengths = [], []
    for file in files:
        index = Path(f"{file}.index")
        if not index.is_file():
            raise DataError(f"data_path {file}: no {index.name} beside it, so its document boundaries are unknown "
                            "(datatrove writes it unless save_index=False); tokenize with save_index=True")
        size = _datatrove_token_size(file, tokenizer)
        ends = np.fromfile(index, dtype="<u8").astype(np.int64)
        if np.any(np.diff(ends, prepend=0) < 0):
            raise DataError(f"data_path {file}: {index.name} is not a list of increasing document ends; it is damaged "
                            "or not datatrove's index")
        if file.stat().st_size != (int(ends[-1]) if len(ends) else 0) * size:
            raise DataError(f"data_path {file}: {file.stat().st_size} bytes, but {index.name} ends at "
                            f"{int(ends[-1]) if len(ends) else 0} tokens of {size} bytes; the pair is truncated or "
                            "from different runs")
        arrays.append(np.memmap(file, dtype="<u4" if size == 4 else "<u2", mode="r") if len(ends) else
                      np.zeros(0, "<u4" if size == 4 else "<u2"))
        lengths.append(np.diff(ends, prepend=0))
    return TokenFiles(files, arrays, lengths, "datatrove")


def _datatrove_token_size(file: Path, tokenizer) -> int:
    metadata = Path(f"{file}.metadata")
    if metadata.is_file():
        first = metadata.read_text(encoding="utf-8").splitlines()[0]
        size = first.rsplit("|", 1)[-1]
        if size not in ("2", "4"):
            raise DataError(f"data_path {file}: {metadata.name} names token size {size!r}; expected 2 or 4")
        return int(size)
    return 4 if tokenizer is not None and len(tokenizer) > 65536 else 2


def dolma_corpus(files: list[Path], eos_id: int, vocab_size: int) -> TokenFiles:
    """dolma/OLMo token arrays: raw uint16 (uint32 for vocabularies over 65,536) memory maps, or `.npy` files with a
    header; each document ends with the EOS (a tail without one is a last document)."""
    dtype = np.uint32 if vocab_size > 65536 else np.uint16
    arrays, lengths = [], []
    for file in files:
        array = _dolma_array(file, dtype)
        ends = np.concatenate([np.flatnonzero(array[i:i + SCAN_TOKENS] == eos_id) + i + 1
                               for i in range(0, len(array), SCAN_TOKENS)] or [np.zeros(0, np.int64)])
        if len(array) and len(ends) == 0:
            raise DataError(f"data_path {file}: no EOS (id {eos_id}) in its {len(array)} tokens, so it holds no "
                            "document boundaries; dolma ends every document with the tokenizer's EOS: give the "
                            "tokenizer it was tokenized with (model_path)")
        if len(array) and ends[-1] != len(array):  # a last document without its EOS
            ends = np.append(ends, len(array))
        arrays.append(array)
        lengths.append(np.diff(ends, prepend=0))
    return TokenFiles(files, arrays, lengths, "dolma")


def _dolma_array(file: Path, dtype) -> np.ndarray:
    with open(file, "rb") as f:
        has_header = f.read(6) == b"\x93NUMPY"
    if has_header:
        array = np.load(file, mmap_mode="r")
        if array.ndim != 1 or array.dtype.kind != "u":
            raise DataError(f"data_path {file}: a {array.ndim}-d {array.dtype} array; token files are 1-d unsigned "
                            "integers")
        return array
    itemsize = np.dtype(dtype).itemsize
    if file.stat().st_size % itemsize:
        raise DataError(f"data_path {file}: {file.stat().st_size} bytes is not a whole number of "
                        f"{np.dtype(dtype).name} tokens")
    return np.memmap(file, dtype=dtype, mode="r") if file.stat().st_size else np.zeros(0, dtype)


def _checked(corpus: TokenFiles, tokenizer) -> TokenFiles:
    """Refuses ids the run's tokenizer does not have (another tokenizer, or the wrong token size), in one line."""
    if tokenizer is not None:
        top = max((int(a[i:i + SCAN_TOKENS].max()) for a in corpus.tokens.arrays
                   for i in range(0, len(a), SCAN_TOKENS)), default=-1)
        if top >= len(tokenizer):
            raise DataError(f"data_path {corpus.files[0].parent}: the {corpus.format} files hold token id {top}, but "
                            f"the run's tokenizer has {len(tokenizer)} tokens; they were tokenized with another "
                            "tokenizer (or another token size): give that tokenizer's model_path, or tokenize again")
    if corpus.num_documents == 0:
        raise DataError(f"data_path {corpus.files[0]}: no documents in {len(corpus.files)} {corpus.format} file(s)")
    return corpus
