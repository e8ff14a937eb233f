"""Read documents from local json / jsonl / csv / txt files.

Each record becomes one document's text, with its file and line kept for error
messages. Record templates: a `text` field (name configurable), alpaca records
(`instruction` / `input` / `output`), and rows already written as
`<s>Human: ...</s><s>Assistant: ...</s>` (plain text; the tokenizer step makes
sure no `<s>` is doubled).
"""

from __future__ import annotations

import csv
import gzip
import io
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SUPPORTED_SUFFIXES = (".json", ".jsonl", ".csv", ".txt")
COMPRESSED_SUFFIXES = (".gz", ".zst")  # e.g. docs.jsonl.gz, rows.csv.zst

# The usual alpaca prompt layout, so alpaca records read as the same text other tools train on.
ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


class DataError(ValueError):
    """Bad input data; the message names the file and line."""


@dataclass(frozen=True)
class Document:
    text: str
    where: str  # "path:line" (or "path" for a whole-file document)


def expand_paths(patterns: list[str], what: str = "train_data") -> list[Path]:
    """Files named directly, by glob, or as a directory (its supported files, sorted)."""
    files: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if record_format(p) in SUPPORTED_SUFFIXES and p.is_file())
            if not found:
                raise DataError(f"{what}: directory {path} holds no {'/'.join(SUPPORTED_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif glob.has_magic(pattern):
            found = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not found:
                raise DataError(f"{what}: pattern {pattern!r} matches no file")
            files.extend(found)
        else:
            raise DataError(f"{what}: file {pattern} does not exist")
    for path in files:
        if record_format(path) not in SUPPORTED_SUFFIXES:
            raise DataError(f"{what}: {path} has an unsupported type {''.join(path.suffixes) or '(no suffix)'}; "
                            f"supported: {', '.join(SUPPORTED_SUFFIXES)}, optionally compressed "
                            f"({', '.join(COMPRESSED_SUFFIXES)})")
    return files


def record_format(path: Path) -> str:
    """The record suffix, looking through a compression suffix (`a.jsonl.gz` -> `.jsonl`)."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSED_SUFFIXES:
        return suffixes[-2] if len(suffixes) > 1 else ""
    return path.suffix


def read_documents(files: list[Path], text_key: str = "text", txt_mode: str = "line") -> Iterator[Document]:
    for path in files:
        kind = record_format(path)
        if kind == ".txt":
            yield from _read_txt(path, txt_mode)
        elif kind == ".csv":
            yield from _read_csv(path, text_key)
        else:
            yield from _read_json(path, text_key)


def record_to_text(record, where: str, text_key: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with a {text_key!r} field, got {type(record).__name__}")
    if text_key in record:
        text = record[text_key]
        if not isinstance(text, str):
            raise DataError(f"{where}: field {text_key!r} must be a string, got {type(text).__name__}")
        return text
    if "instruction" in record:
        fields = {k: record.get(k) or "" for k in ("instruction", "input", "output")}
        for key, value in fields.items():
            if not isinstance(value, str):
                raise DataError(f"{where}: alpaca field {key!r} must be a string, got {type(value).__name__}")
        template = ALPACA_WITH_INPUT if fields["input"] else ALPACA_NO_INPUT
        return template.format(**fields) + fields["output"]
    keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
    raise DataError(f"{where}: record has no {text_key!r} field and is not an alpaca record "
                    f"(instruction/input/output); its keys: {keys}. Set `text_key` to the field holding the text.")


def _read_txt(path: Path, mode: str) -> Iterator[Document]:
    if mode == "file":
        yield Document(_read_text(path), str(path))
        return
    for number, line in _lines(path):
        yield Document(line.rstrip("\r\n"), f"{path}:{number}")


def _read_csv(path: Path, text_key: str) -> Iterator[Document]:
    text = _read_text(path)
    reader = csv.DictReader(text.splitlines(keepends=True))
    if reader.fieldnames is None:
        return
    if text_key not in reader.fieldnames and "instruction" not in reader.fieldnames:
        raise DataError(f"{path}:1: CSV header has no {text_key!r} column (columns: {', '.join(reader.fieldnames)}); "
                        "set `text_key` to the column holding the text")
    for row in reader:
        yield Document(record_to_text(row, f"{path}:{reader.line_num}", text_key), f"{path}:{reader.line_num}")


def _read_json(path: Path, text_key: str) -> Iterator[Document]:
    if _first_char(path) == "[":  # a JSON array is parsed whole; JSON lines stream one line at a time
        text = _read_text(path)
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
        for index, record in enumerate(records):
            where = f"{path}: record {index}"
            yield Document(record_to_text(record, where, text_key), where)
        return
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        yield Document(record_to_text(record, f"{path}:{number}", text_key), f"{path}:{number}")


def _open_binary(path: Path):
    """The file's bytes, decompressed on the fly for .gz and .zst."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst files needs the zstandard package (pip install zstandard)") \
                from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Numbered lines, decoded one at a time (memory stays flat whatever the file size)."""
    with _open_binary(path) as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{number}: not valid UTF-8 (byte {exc.start} of the line)") from None


def _first_char(path: Path) -> str:
    with _open_binary(path) as f:
        head = f.read(4096).decode("utf-8-sig", errors="ignore").lstrip()
    return head[:1]


def _read_text(path: Path) -> str:
    with _open_binary(path) as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 (byte offset {exc.start})") from None
