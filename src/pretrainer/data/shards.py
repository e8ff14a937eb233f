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
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .encode import encode_in_process
from .indexed import IndexedDatasetWriter
from .prepare import MAX_EXAMPLES, PrepareJob, PrepareSummary, prepare_job, shard_files, texts_of
from .readers import DataError
from .remote import RemoteFile, is_url
from .shard_store import MANIFEST, RECORD, read_manifest, sha256, shard_store

__all__ = ["MANIFEST", "RECORD", "ShardTask", "prepare_sharded", "read_manifest", "tokenize_file"]


@dataclass(frozen=True)
class ShardTask:
    index: int                # the file's place in the input list: the shard's name and its place in the stream
    file: Path | RemoteFile   # the input file
    key: str                  # the record field tokenized
    folder: str               # PREFIX_{key}_document/, a path or a URL

    @property
    def source(self) -> str:
        return str(self.file)

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


def prepare_sharded(inputs: list[str], tokenizer: str, output_prefix: str, json_keys: list[str],
                    append_eod: bool = False, workers: int = 1, txt_mode: str = "line", progress: bool = True,
                    on_error: str = "fail", shard: str | None = None, ray_address: str | None = None,
                    merge: bool = False) -> PrepareSummary:
    """Every input file (or part `shard` of them) into its shard, locally with `workers` processes or as tasks on the
    Ray cluster at `ray_address`; the manifest is written by the run that completes the last shard, and with `merge`
    the shards are then streamed into one `PREFIX_{key}_document.bin/.idx` pair."""
    if not is_url(output_prefix):  # Ray workers start in other folders: every path the same from anywhere
        output_prefix = os.path.abspath(output_prefix)
    all_files, job = prepare_job(inputs, tokenizer, output_prefix, append_eod, txt_mode, on_error, None)
    all_files = [f if isinstance(f, RemoteFile) else f.absolute() for f in all_files]
    chosen = set(map(str, shard_files(all_files, shard) if shard is not None else all_files))
    summary, start = PrepareSummary(), time.perf_counter()
    for key in json_keys:
        store = shard_store(f"{output_prefix}_{key}_document")
        store.begin()
        tasks = [ShardTask(i, f, key, store.location) for i, f in enumerate(all_files)]
        found = store.records([t.name for t in tasks])
        records = {t.index: r for t in tasks if (r := current(t, found.get(t.name), job, store)) is not None}
        todo = [t for t in tasks if t.source in chosen and t.index not in records]
        summary.files_reused += sum(t.source in chosen for t in tasks) - len(todo)
        if todo:  # shards are about to change: no manifest may describe the folder meanwhile
            store.remove_manifest()
        if ray_address is not None:
            from .ray_prepare import run_on_ray
            done = run_on_ray(tokenize_file, todo, job, ray_address, progress)
        else:
            done = run_locally(todo, job, workers)
        for task, record in done:
            if ray_address is not None and not store.present(task.name, record):
                raise DataError(f"--ray: the shard of {task.source} was written where this machine does not see it "
                                f"({store.location}); give an --output-prefix on a file system every node shares, "
                                "or an s3:// URL")
            records[task.index] = record
            summary.files_tokenized += 1
        _count(summary, [records[t.index] for t in tasks if t.source in chosen])
        with store.finishing():  # parts (--shard) finishing at once take turns: the last sees every record
            if len(records) < len(tasks):  # other parts may have finished theirs meanwhile
                found = store.records([t.name for t in tasks if t.index not in records])
                records.update({t.index: r for t in tasks if t.index not in records
                                and (r := current(t, found.get(t.name), job, store)) is not None})
            if len(records) == len(tasks) and not any(r["documents"] for r in records.values()):
                raise DataError(f"--input {' '.join(inputs)}: no documents to write for key {key!r}"
                                + (" (every record was skipped)" if summary.skipped else ""))
            if len(records) < len(tasks):
                summary.waiting.append(f"{store.location}: {len(tasks) - len(records)} of {len(tasks)} files have "
                                       "no shard yet")
                continue
            store.write_manifest(manifest_text([records[t.index] for t in tasks], job))
        summary.manifests.append(f"{store.location}/{MANIFEST}")
        if merge:
            from .merge import merge_shards
            merge_shards(Path(store.location))
            summary.outputs.append(store.location)
    summary.seconds = time.perf_counter() - start
    return summary


def _count(summary: PrepareSummary, records: list[dict]) -> None:
    for record in records:
        summary.documents += record["documents"]
        summary.tokens += record["tokens"]
        for reason, count in record["skipped"].items():
            summary.skipped[reason] = summary.skipped.get(reason, 0) + count
        summary.skipped_examples += record["skipped_examples"][:MAX_EXAMPLES - len(summary.skipped_examples)]


def run_locally(tasks: list[ShardTask], job: PrepareJob, workers: int):
    """(task, record) as each shard completes, from a pool of `workers` processes."""
    import multiprocessing

    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with context.Pool(max(1, workers)) as pool:
        yield from zip(tasks, pool.imap(_run, [(t, job) for t in tasks]))


def _run(arguments) -> dict:
    return tokenize_file(*arguments)


def tokenize_file(task: ShardTask, job: PrepareJob) -> dict:
    """One input file into its shard; the completion record is published last (the shard counts only then)."""
    summary, store = PrepareSummary(), shard_store(task.folder)
    prefix = store.writer_prefix(task.name)
    writer = IndexedDatasetWriter(prefix, job.settings.dtype)
    try:
        texts = texts_of([task.file], task.key, job, summary.skip if job.on_error == "skip" else None)
        documents, tokens = encode_in_process(writer, texts, job.settings)
        writer.finalize()
    except BaseException:
        writer.abort()
        store.discard(prefix)
        raise
    files = {suffix: Path(f"{prefix}.{suffix}") for suffix in ("bin", "idx")}
    record = {"shard": task.name, "source": task.source, **_identity(task.file), "job": fingerprint(job, task.key),
              "documents": documents, "tokens": tokens, "skipped": summary.skipped,
              "skipped_examples": summary.skipped_examples,
              **{f"{suffix}_sha256": sha256(path) for suffix, path in files.items()},
              **{f"{suffix}_bytes": path.stat().st_size for suffix, path in files.items()}}
    store.publish(task.name, record, prefix)
    return record


def current(task: ShardTask, record: dict | None, job: PrepareJob, store) -> dict | None:
    """The task's record when its shard is complete and current: the same input file, unchanged, tokenized the same
    way (a record that skipped bad records does not count under --on-error fail), its files holding."""
    if record is None or record.get("source") != task.source:
        return None
    if any(record.get(k) != v for k, v in _identity(task.file).items()):
        return None
    if record.get("job") != fingerprint(job, task.key) or (record.get("skipped") and job.on_error == "fail"):
        return None
    return record if store.holds(task.name, record) else None


def manifest_text(records: list[dict], job: PrepareJob) -> str:
    fields = ("shard", "source", "documents", "tokens", "bin_sha256", "idx_sha256", "bin_bytes", "idx_bytes")
    shards = [{k: r[k] for k in fields} for r in records]
    manifest = {"format": "pretrainer-shards", "version": 1, "dtype": job.settings.dtype.__name__,
                "documents": sum(r["documents"] for r in records), "tokens": sum(r["tokens"] for r in records),
                "shards": shards}
    return json.dumps(manifest, indent=1)


def fingerprint(job: PrepareJob, key: str) -> str:
    """What decides a shard's tokens besides its input: the tokenizer, the special tokens added, the token type, how
    records are read and the field."""
    settings = job.settings
    parts = [hashlib.sha256(settings.tokenizer_json.encode()).hexdigest(), settings.bos, settings.eos,
             settings.dtype.__name__, settings.policy, job.txt_mode, job.special.bos, job.special.eos, key]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _identity(file: Path | RemoteFile) -> dict:
    """What says an input file is the one a record was made from: its size and modification time, or an object's
    version (ETag)."""
    if isinstance(file, RemoteFile):
        return {"source_bytes": file.size, "source_version": file.version}
    stat = file.stat()
    return {"source_bytes": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}
