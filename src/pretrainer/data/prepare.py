"""`pretrainer prepare`: tokenize a corpus once into Megatron-compatible `PREFIX_{key}_document.bin/.idx`.

Documents are encoded by `encode`'s worker processes (records read and written in order) with its `prepare` policy: as
the model's tokenizer encodes a text (its special tokens, e.g. a Llama BOS, included), with the EOS appended when
`append_eod` is set, as Megatron-LM's preprocess_data.py does. Unlike that tool, a text that already starts with the BOS
(`<s>Human: ...` rows) does not get a second one, and one that already ends with the EOS does not get another.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ON_ERROR, ConfigError, check_writable_folder
from .encode import EncodeSettings, encode_into
from .indexed import NO_ROOM, IndexedDatasetWriter, optimal_dtype
from .readers import BytesRead, DataError, Document, SpecialTokens, expand_paths, read_documents
from .remote import is_url

logger = logging.getLogger(__name__)

MAX_EXAMPLES = 10  # bad records quoted in the summary in skip mode


@dataclass
class PrepareSummary:
    outputs: list[str] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    skipped: dict = field(default_factory=dict)  # reason -> count
    skipped_examples: list = field(default_factory=list)  # the first bad records' messages
    seconds: float = 0.0
    files_tokenized: int = 0  # sharded: files tokenized by this run
    files_reused: int = 0     # sharded: files whose shard an earlier run completed
    manifests: list[str] = field(default_factory=list)  # sharded: the corpora complete after this run
    waiting: list[str] = field(default_factory=list)    # sharded: the corpora other parts (--shard) still owe

    def skip(self, exc: DataError) -> None:
        self.skipped[exc.reason] = self.skipped.get(exc.reason, 0) + 1
        if len(self.skipped_examples) < MAX_EXAMPLES:
            self.skipped_examples.append(str(exc))

    def lines(self) -> list[str]:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{reason}: {count:,}" for reason, count in Counter(self.skipped).most_common())
        lines = [f"documents: {self.documents:,}", f"tokens: {self.tokens:,} ({rate:,.0f} tokens/s)",
                 f"skipped: {skipped:,} bad record(s)" + (f" ({reasons})" if reasons else "")]
        lines += [f"  e.g. {example}" for example in self.skipped_examples]
        if self.files_tokenized or self.files_reused:
            lines.append(f"files: {self.files_tokenized:,} tokenized, {self.files_reused:,} already complete")
        return lines + [f"wrote {o}.bin/.idx" for o in self.outputs] + [f"wrote {m}" for m in self.manifests] + \
            [f"not complete yet: {w}" for w in self.waiting]


def tokenizer_file(path: str | Path) -> Path:
    path = Path(path)
    candidate = path if path.is_file() else path / "tokenizer.json"
    if not candidate.is_file():
        raise DataError(f"--tokenizer {path}: no tokenizer.json (a fast Hugging Face tokenizer) found")
    return candidate


def special_token_strings(tokenizer_json: Path) -> dict:
    """bos/eos token strings from the tokenizer folder's tokenizer_config.json / special_tokens_map.json."""
    found = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the later file wins
        path = tokenizer_json.parent / name
        if path.is_file():
            config = json.loads(path.read_text(encoding="utf-8"))
            for key in ("bos_token", "eos_token"):
                value = config.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if value:
                    found[key] = value
    return found


@dataclass(frozen=True)
class PrepareJob:
    """What every part of one `prepare` shares: how records are read and how texts are encoded."""
    settings: EncodeSettings
    special: SpecialTokens
    txt_mode: str = "line"
    on_error: str = "fail"


def prepare_job(inputs: list[str], tokenizer: str, output_prefix: str, append_eod: bool, txt_mode: str,
                on_error: str, shard: str | None) -> tuple[list, PrepareJob]:
    """The input files (part `shard` of them) and the job, every argument checked before any work."""
    if on_error not in ON_ERROR:
        raise DataError(f"--on-error {on_error!r}: choose one of {', '.join(ON_ERROR)}")
    files = expand_paths(inputs, "--input")
    if shard is not None:
        files = shard_files(files, shard)
    try:
        if not is_url(output_prefix):  # a folder in object storage is checked by its shard store
            check_writable_folder(Path(output_prefix).parent, "--output-prefix")
    except ConfigError as exc:
        raise DataError(str(exc)) from None
    tokenizer_json = tokenizer_file(tokenizer)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_json))
    dtype = optimal_dtype(vocab.get_vocab_size(with_added_tokens=True))
    strings = special_token_strings(tokenizer_json)
    bos = vocab.token_to_id(strings["bos_token"]) if "bos_token" in strings else None
    eod = vocab.token_to_id(strings["eos_token"]) if "eos_token" in strings else None
    if append_eod and eod is None:
        raise DataError(f"--tokenizer {tokenizer_json.parent}: no eos_token in tokenizer_config.json or "
                        "special_tokens_map.json, so --append-eod has nothing to append")
    settings = EncodeSettings(tokenizer_json.read_text(encoding="utf-8"), bos, eod if append_eod else None, dtype,
                              policy="prepare")
    special = SpecialTokens(strings.get("bos_token", ""), strings.get("eos_token", ""))
    return files, PrepareJob(settings, special, txt_mode, on_error)


def texts_of(files: list, key: str, job: PrepareJob, on_bad, meter=None):
    """The texts of `key` in the files' records, in order; bad records (empty texts too) raise or go to `on_bad`."""
    documents = (non_empty(doc, on_bad) for doc in read_documents(files, key, job.txt_mode, on_bad, job.special, meter))
    return (doc.text for doc in documents if doc is not None)


def prepare(inputs: list[str], tokenizer: str, output_prefix: str, json_keys: list[str], append_eod: bool = False,
            workers: int = 1, txt_mode: str = "line", progress: bool = True, on_error: str = "fail",
            shard: str | None = None) -> PrepareSummary:
    files, job = prepare_job(inputs, tokenizer, output_prefix, append_eod, txt_mode, on_error, shard)
    summary = PrepareSummary()
    on_bad = summary.skip if on_error == "skip" else None
    start = time.perf_counter()
    for key in json_keys:
        prefix = f"{output_prefix}_{key}_document"
        writer = IndexedDatasetWriter(prefix, job.settings.dtype)
        try:
            meter = BytesRead(files)
            written, tokens = encode_into(writer, texts_of(files, key, job, on_bad, meter), job.settings, workers,
                                          progress, description=key, meter=meter)
            summary.documents += written
            summary.tokens += tokens
            if written == 0:
                raise DataError(f"--input {' '.join(inputs)}: no documents to write for key {key!r}"
                                + (" (every record was skipped)" if summary.skipped else ""))
            writer.finalize()
        except OSError as exc:  # a full or failing disk: one line, what to do instead
            writer.abort()
            raise DataError(f"prepare: writing {prefix}.bin and .idx failed ({exc})" + (
                "; free space there, or give an --output-prefix on a larger disk" if exc.errno in NO_ROOM else "")
            ) from None
        except BaseException:
            writer.abort()  # no .bin/.idx pair that looks complete
            raise
        summary.outputs.append(prefix)
    summary.seconds = time.perf_counter() - start
    return summary


def shard_files(files: list, shard: str) -> list:
    """Part K of N (`"K/N"`, K from 1) of the input files, dealt round-robin in their sorted order."""
    try:
        k, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise DataError(f"--shard {shard!r}: give K/N, e.g. 1/4 for the first of four parts") from None
    if not 1 <= k <= n:
        raise DataError(f"--shard {shard}: K must be between 1 and N")
    part = files[k - 1::n]
    if not part:
        raise DataError(f"--shard {shard}: the {len(files)} input file(s) give part {k} nothing; use fewer parts")
    return part


def non_empty(doc: Document, on_bad) -> Document | None:
    """An empty or whitespace-only text is a bad record (it would be a document of special tokens only)."""
    if doc.text.strip():
        return doc
    exc = DataError(f"{doc.where}: empty text", "empty text")
    if on_bad is None:
        raise exc
    on_bad(exc)
    return None


def write_summary(summary: PrepareSummary, output_prefix: str) -> str:
    """`PREFIX_summary.json` beside the output (in object storage too); returns where."""
    text, name = json.dumps(summary.__dict__, indent=2), f"{output_prefix}_summary.json"
    if is_url(output_prefix):
        from ..storage import RemoteFolder, StorageError

        parent, _, base = name.rpartition("/")
        try:
            RemoteFolder(parent).put_text(base, text)
        except StorageError as exc:
            raise DataError(f"--output-prefix {output_prefix}: {exc}") from None
    else:
        Path(name).write_text(text)
    return name
