"""Read documents from local json / jsonl / csv / txt / parquet files.

Each record becomes one document's text, with its file and line kept for error messages. Record templates: a `text`
field (name configurable), alpaca records (`instruction` / `input` / `output`), chat records (`messages`: a list of
`{"role", "content"}`), and rows already written as `<s>Human: ...</s><s>Assistant: ...</s>` (plain text; the tokenizer
step makes sure no `<s>` is doubled).

Every file type is read as a stream of `(where, record)` pairs, where a record that could not even be parsed arrives as
a `DataError`. `read_documents` turns them into documents and either raises on the first bad one or hands it to an
`on_bad` callback (the `--on-error skip` mode).
"""

from __future__ import annotations

import contextlib
import csv
import glob
import gzip
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .errors import DataError
from .remote import expand_remote, is_url

SUPPORTED_SUFFIXES = (".json", ".jsonl", ".csv", ".txt", ".parquet")
COMPRESSED_SUFFIXES = (".gz", ".zst")  # e.g. docs.jsonl.gz, rows.csv.zst

# The usual alpaca prompt layout, so alpaca records read as the same text other tools train on.
ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
# Chat turns are written in the Human/Assistant row form, so a `messages` record and the same conversation
# as a CSV row train on identical tokens.
CHAT_ROLE_NAMES = {"user": "Human", "human": "Human", "assistant": "Assistant", "gpt": "Assistant",
                   "system": "System"}


@dataclass(frozen=True)
class Document:
    text: str
    where: str  # "path:line", "path: record N" (or "path" for a whole-file document)


class BytesRead:
    """How far reading has got through the input files, in their bytes on disk (compressed bytes for .gz and
    .zst), for a progress bar's ETA. Files parsed whole (a JSON array, a CSV, parquet) count when read."""

    def __init__(self, files: list[Path]):
        self.total = sum(p.stat().st_size for p in files)
        self._finished = 0
        self._reading = None  # the raw file being read

    def watch(self, raw) -> None:
        self._reading = raw

    def file_done(self, path: Path) -> None:
        self._finished += path.stat().st_size
        self._reading = None

    @property
    def done(self) -> int:
        position = 0
        raw = self._reading
        if raw is not None:
            try:
                position = raw.tell()
            except (OSError, ValueError):  # closed meanwhile
                pass
        return min(self.total, self._finished + position)


@dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's BOS/EOS strings, used to write chat turns."""
    bos: str = "<s>"
    eos: str = "</s>"


def expand_paths(patterns: list[str], what: str = "train_data") -> list[Path]:
    """Files named directly, by glob, or as a directory (its supported files, sorted); a URL names objects in
    object storage (data/remote.py's RemoteFile, read as a stream)."""
    files: list[Path] = []
    for pattern in patterns:
        if is_url(pattern):
            files.extend(expand_remote(pattern, what, lambda p: record_format(p) in SUPPORTED_SUFFIXES))
            continue
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


def read_documents(files: list[Path], text_key: str = "text", txt_mode: str = "line",
                   on_bad: Callable[[DataError], None] | None = None,
                   special: SpecialTokens = SpecialTokens(), meter: BytesRead | None = None) -> Iterator[Document]:
    """Documents of all files in order. A bad record raises, or goes to `on_bad` and is left out. `meter`
    follows the bytes read."""
    for path in files:
        for where, record in _records(path, text_key, txt_mode, meter):
            try:
                if isinstance(record, DataError):
                    raise record
                text = record if isinstance(record, str) else record_to_text(record, where, text_key, special)
            except DataError as exc:
                if on_bad is None:
                    raise
                on_bad(exc)
                continue
            yield Document(text, where)
        if meter is not None:
            meter.file_done(path)


def read_records(path: Path) -> Iterator[tuple[str, object]]:
    """(file:line, record) of a json, jsonl or parquet file (.gz/.zst too); an unreadable line comes as a DataError."""
    if record_format(path) not in (".json", ".jsonl", ".parquet"):
        raise DataError(f"{path}: records are read from .json, .jsonl or .parquet files")
    return _records(path, "text", "line", None)


def _records(path: Path, text_key: str, txt_mode: str, meter: BytesRead | None) -> Iterator[tuple[str, object]]:
    kind = record_format(path)
    if kind == ".txt":
        return _txt_records(path, txt_mode, meter)
    if kind == ".csv":
        return _csv_records(path, text_key, meter)
    if kind == ".parquet":
        return _parquet_records(path)
    return _json_records(path, meter)


def record_to_text(record, where: str, text_key: str, special: SpecialTokens = SpecialTokens()) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with a {text_key!r} field, got {type(record).__name__}",
                        "not an object")
    if text_key in record:
        text = record[text_key]
        if not isinstance(text, str):
            raise DataError(f"{where}: field {text_key!r} must be a string, got {type(text).__name__}",
                            "wrong field type")
        return text
    if "instruction" in record:
        fields = {k: record.get(k) or "" for k in ("instruction", "input", "output")}
        for key, value in fields.items():
            if not isinstance(value, str):
                raise DataError(f"{where}: alpaca field {key!r} must be a string, got {type(value).__name__}",
                                "wrong field type")
        template = ALPACA_WITH_INPUT if fields["input"] else ALPACA_NO_INPUT
        return template.format(**fields) + fields["output"]
    if "messages" in record:
        return messages_to_text(record["messages"], where, special)
    keys = ", ".join(repr(k) for k in list(record)[:8]) or "none"
    raise DataError(f"{where}: record has no {text_key!r} field and is not an alpaca (instruction/input/output) "
                    f"or chat (messages) record; its keys: {keys}. Set `text_key` to the field holding the text.",
                    "missing field")


def messages_to_text(messages, where: str, special: SpecialTokens) -> str:
    """`[{"role": "user", "content": ...}, ...]` as `<s>Human: ...\\n</s><s>Assistant: ...\\n</s>`."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects",
                        "bad messages")
    turns = []
    for number, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(f"{where}: messages[{number}] must be an object with string 'role' and 'content'",
                            "bad messages")
        role = CHAT_ROLE_NAMES.get(message["role"].lower(), message["role"].capitalize())
        turns.append(f"{special.bos}{role}: {message['content']}\n{special.eos}")
    return "".join(turns)


def _txt_records(path: Path, mode: str, meter: BytesRead | None) -> Iterator[tuple[str, object]]:
    if mode == "file":
        try:
            yield str(path), _read_text(path, meter)
        except DataError as exc:
            yield str(path), exc
        return
    for number, line in _lines(path, meter):
        if isinstance(line, DataError) or line.strip():  # blank lines separate documents; they are none
            yield f"{path}:{number}", line if isinstance(line, DataError) else line.rstrip("\r\n")


def _csv_records(path: Path, text_key: str, meter: BytesRead | None) -> Iterator[tuple[str, object]]:
    text = _read_text(path, meter)  # a CSV field may span lines, so the file is parsed whole
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))  # a document may pass csv's 128 KiB default
    reader = csv.DictReader(text.splitlines(keepends=True))
    if reader.fieldnames is None:
        return
    if text_key not in reader.fieldnames and not {"instruction", "messages"} & set(reader.fieldnames):
        raise DataError(f"{path}:1: CSV header has no {text_key!r} column (columns: {', '.join(reader.fieldnames)}); "
                        "set `text_key` to the column holding the text")
    for row in reader:
        yield f"{path}:{reader.line_num}", row


def _json_records(path: Path, meter: BytesRead | None) -> Iterator[tuple[str, object]]:
    if _first_char(path) == "[":  # a JSON array is parsed whole; JSON lines stream one line at a time
        try:
            records = json.loads(_read_text(path, meter))
        except DataError as exc:
            yield str(path), exc
            return
        except json.JSONDecodeError as exc:
            yield f"{path}:{exc.lineno}", DataError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg}); the whole "
                                                    "array is unreadable", "invalid JSON")
            return
        for index, record in enumerate(records):
            yield f"{path}: record {index}", record
        return
    for number, line in _lines(path, meter):
        where = f"{path}:{number}"
        if isinstance(line, DataError):
            yield where, line
            continue
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            yield where, DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})", "invalid JSON")


def _parquet_records(path: Path) -> Iterator[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet files needs the pyarrow package "
                        "(pip install pyarrow, or pip install 'pretrainer[parquet]')") from None
    try:
        table = pq.ParquetFile(path if isinstance(path, Path) else path.open("rb"))
    except Exception as exc:  # pyarrow raises its own error types for a corrupt or non-parquet file
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None
    index = 0
    for batch in table.iter_batches(batch_size=1024):  # row groups stream; memory stays bounded
        for record in batch.to_pylist():
            yield f"{path}: row {index}", record
            index += 1


@contextlib.contextmanager
def _open_binary(path: Path, meter: BytesRead | None = None):
    """The file's bytes, decompressed on the fly for .gz and .zst; `meter` watches the file on disk."""
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst files needs the zstandard package (pip install zstandard)") \
                from None
    with path.open("rb") as raw:  # a Path, or a RemoteFile's stream
        if meter is not None:
            meter.watch(raw)
        if path.suffix == ".gz":
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                yield f
        elif path.suffix == ".zst":
            with io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=False)) as f:
                yield f
        else:
            yield raw


def _lines(path: Path, meter: BytesRead | None = None) -> Iterator[tuple[int, str | DataError]]:
    """Numbered lines, decoded one at a time (memory stays flat whatever the file size)."""
    with _open_binary(path, meter) as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield number, DataError(f"{path}:{number}: not valid UTF-8 (byte {exc.start} of the line)",
                                        "not UTF-8")


def _first_char(path: Path) -> str:
    with _open_binary(path) as f:
        head = f.read(4096).decode("utf-8-sig", errors="ignore").lstrip()
    return head[:1]


def _read_text(path: Path, meter: BytesRead | None = None) -> str:
    with _open_binary(path, meter) as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 (byte offset {exc.start})", "not UTF-8") from None
