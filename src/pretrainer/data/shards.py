"""`pretrainer prepare --sharded` and `--ray`: one `.bin/.idx` shard per input file in `PREFIX_{key}_document/`, each
with a completion record written last, and a manifest once every file has its shard (docs/data.md, 'A corpus on a
cluster').

A file is the unit of work, of retry and of resume: a rerun skips every file whose record matches the input (size,
modification time) and whose shard still has the checksums the record holds. Shards are named by the file's place in
the input list, so the manifest lists them in file order whoever wrote them and in whatever order they finished: the
token stream is the one-machine `prepare`'s, document for document.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import write_text_whole
from .encode import encode_in_process
from .indexed import IndexedDatasetWriter, remove_stale_partial_files
from .prepare import MAX_EXAMPLES, PrepareJob, PrepareSummary, prepare_job, shard_files, texts_of
from .readers import DataError

MANIFEST = "manifest.json"
RECORD = ".done.json"


@dataclass(frozen=True)
class ShardTask:
    index: int    # the file's place in the input list: the shard's name and its place in the token stream
    source: str   # the input file
    key: str      # the record field tokenized
    folder: str   # PREFIX_{key}_document/

    def path(self, suffix: str) -> Path:
        return Path(self.folder) / f"shard-{self.index:05d}{suffix}"


def prepare_sharded(inputs: list[str], tokenizer: str, output_prefix: str, json_keys: list[str],
                    append_eod: bool = False, workers: int = 1, txt_mode: str = "line", progress: bool = True,
                    on_error: str = "fail", shard: str | None = None, ray_address: str | None = None) -> PrepareSummary:
    """Every input file (or part `shard` of them) into its shard, locally with `workers` processes or as tasks on the
    Ray cluster at `ray_address`; the manifest is written by the run that completes the last shard."""
    all_files, job = prepare_job(inputs, tokenizer, output_prefix, append_eod, txt_mode, on_error, None)
    chosen = set(map(str, shard_files(all_files, shard) if shard is not None else all_files))
    summary, start = PrepareSummary(), time.perf_counter()
    for key in json_keys:
        folder = Path(f"{output_prefix}_{key}_document")
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_partial_files(folder)  # of tasks killed on this machine before they finished
        tasks = [ShardTask(i, str(f), key, str(folder)) for i, f in enumerate(all_files)]
        records = {t.index: r for t in tasks if (r := finished(t, job)) is not None}
        todo = [t for t in tasks if t.source in chosen and t.index not in records]
        summary.files_reused += sum(t.source in chosen for t in tasks) - len(todo)
        if todo:  # shards are about to change: no manifest may describe the folder meanwhile
            (folder / MANIFEST).unlink(missing_ok=True)
        if ray_address is not None:
            from .ray_prepare import run_on_ray
            done = run_on_ray(tokenize_file, todo, job, ray_address, progress)
        else:
            done = run_locally(todo, job, workers)
        for task, record in done:
            records[task.index] = record
            summary.files_tokenized += 1
        for record in (records[t.index] for t in tasks if t.source in chosen):
            summary.documents += record["documents"]
            summary.tokens += record["tokens"]
            for reason, count in record["skipped"].items():
                summary.skipped[reason] = summary.skipped.get(reason, 0) + count
            summary.skipped_examples += record["skipped_examples"][:MAX_EXAMPLES - len(summary.skipped_examples)]
        if len(records) == len(tasks) and not any(r["documents"] for r in records.values()):
            raise DataError(f"--input {' '.join(inputs)}: no documents to write for key {key!r}"
                            + (" (every record was skipped)" if summary.skipped else ""))
        if len(records) == len(tasks):
            write_manifest(folder, [records[t.index] for t in tasks], job)
            summary.manifests.append(str(folder / MANIFEST))
        else:
            summary.waiting.append(f"{folder}: {len(tasks) - len(records)} of {len(tasks)} files have no shard yet")
    summary.seconds = time.perf_counter() - start
    return summary


def run_locally(tasks: list[ShardTask], job: PrepareJob, workers: int):
    """(task, record) as each shard completes, from a pool of `workers` processes."""
    import multiprocessing

    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with context.Pool(max(1, workers)) as pool:
        yield from zip(tasks, pool.imap(_run, [(t, job) for t in tasks]))


def _run(arguments) -> dict:
    return tokenize_file(*arguments)


def tokenize_file(task: ShardTask, job: PrepareJob) -> dict:
    """One input file into its shard; the completion record is written last (the shard counts only then)."""
    summary = PrepareSummary()
    writer = IndexedDatasetWriter(task.path(""), job.settings.dtype)
    try:
        texts = texts_of([Path(task.source)], task.key, job, summary.skip if job.on_error == "skip" else None)
        documents, tokens = encode_in_process(writer, texts, job.settings)
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    record = {"shard": task.path("").name, "source": task.source, **_identity(task.source),
              "job": fingerprint(job, task.key), "documents": documents, "tokens": tokens,
              "skipped": summary.skipped, "skipped_examples": summary.skipped_examples,
              "bin_sha256": sha256(task.path(".bin")), "idx_sha256": sha256(task.path(".idx"))}
    write_text_whole(task.path(RECORD), json.dumps(record, indent=1))
    return record


def finished(task: ShardTask, job: PrepareJob) -> dict | None:
    """The task's record when its shard is complete and current: the same input file, unchanged, tokenized the same
    way (a record that skipped bad records does not count under --on-error fail), its checksums holding."""
    try:
        record = json.loads(task.path(RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if record.get("source") != task.source or any(record.get(k) != v for k, v in _identity(task.source).items()):
        return None
    if record.get("job") != fingerprint(job, task.key) or (record.get("skipped") and job.on_error == "fail"):
        return None
    files = {suffix: task.path(f".{suffix}") for suffix in ("bin", "idx")}
    holds = all(path.is_file() and sha256(path) == record.get(f"{suffix}_sha256") for suffix, path in files.items())
    return record if holds else None


def write_manifest(folder: Path, records: list[dict], job: PrepareJob) -> None:
    shards = [{k: r[k] for k in ("shard", "source", "documents", "tokens", "bin_sha256", "idx_sha256")}
              for r in records]
    manifest = {"format": "pretrainer-shards", "version": 1, "dtype": job.settings.dtype.__name__,
                "documents": sum(r["documents"] for r in records), "tokens": sum(r["tokens"] for r in records),
                "shards": shards}
    write_text_whole(folder / MANIFEST, json.dumps(manifest, indent=1))


def read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        return manifest if manifest.get("format") == "pretrainer-shards" else {}
    except (OSError, ValueError) as exc:
        raise DataError(f"data_path {folder}: {MANIFEST} cannot be read ({exc}); prepare the corpus again") from None


def fingerprint(job: PrepareJob, key: str) -> str:
    """What decides a shard's tokens besides its input: the tokenizer, the special tokens added, the token type, how
    records are read and the field."""
    settings = job.settings
    parts = [hashlib.sha256(settings.tokenizer_json.encode()).hexdigest(), settings.bos, settings.eos,
             settings.dtype.__name__, settings.policy, job.txt_mode, job.special.bos, job.special.eos, key]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _identity(source: str) -> dict:
    stat = Path(source).stat()
    return {"source_bytes": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()
