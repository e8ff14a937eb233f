"""Training data in object storage: a real S3-compatible server (moto's server mode) on 127.0.0.1, the real
client stack (s3fs, botocore). `train_data: s3://bucket/corpus/*.jsonl.zst` trains with the losses of the same
files on local disk; a changed object is tokenized again, an unchanged one is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import train_losses
from pretrainer import PreTrainer, PreTrainingArguments

s3fs = pytest.importorskip("s3fs", reason="the s3 extra (s3fs) is part of make setup-test")


def zst_corpus(source: Path, folder: Path, parts: int = 2) -> list[Path]:
    """The corpus's lines in `parts` zstd-compressed JSONL files."""
    import zstandard

    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for index in range(parts):
        path = folder / f"part-{index}.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress("".join(lines[index::parts]).encode()))
        out.append(path)
    return out


def test_s3_training_data_trains_like_local_files_and_a_changed_object_is_tokenized_again(
        s3_server, base_config, small_corpus, tmp_path, pretrainer_log):
    files = zst_corpus(small_corpus, tmp_path / "corpus")
    for path in files:
        s3_server.fs.put(str(path), f"bucket/corpus/{path.name}")
    config = {**base_config, "export_hf": False, "save_interval": 0, "data_cache_path": str(tmp_path / "cache")}
    PreTrainer(PreTrainingArguments(**{**config, "train_data": str(tmp_path / "corpus" / "*.jsonl.zst"),
                                       "save_dir": str(tmp_path / "local")})).train()
    remote = {**config, "train_data": "s3://bucket/corpus/*.jsonl.zst"}
    PreTrainer(PreTrainingArguments(**{**remote, "save_dir": str(tmp_path / "remote")})).train()
    local, fetched = train_losses(tmp_path / "local"), train_losses(tmp_path / "remote")
    assert fetched == pytest.approx(local, rel=1e-6) and len(fetched) == 6
    assert pretrainer_log.take().count("tokenizing 2 file(s)") == 2  # the local files, then the objects
    PreTrainer(PreTrainingArguments(**{**remote, "save_dir": str(tmp_path / "again")})).train()
    log = pretrainer_log.take()
    assert "reusing the tokenized store" in log and "tokenizing 2 file(s)" not in log
    other = zst_corpus(small_corpus, tmp_path / "other", 3)[0]  # other lines under the same name
    s3_server.fs.put(str(other), "bucket/corpus/part-1.jsonl.zst")
    PreTrainer(PreTrainingArguments(**{**remote, "save_dir": str(tmp_path / "changed")})).train()
    assert "tokenizing 2 file(s)" in pretrainer_log.take()
    assert train_losses(tmp_path / "changed") != pytest.approx(local, rel=1e-6)


def test_a_missing_object_names_the_url(s3_server, base_config, tmp_path):
    from pretrainer.data import DataError

    with pytest.raises(DataError, match=r"train_data: pattern 's3://bucket/nothing/\*\.jsonl' matches no object"):
        PreTrainer(PreTrainingArguments(**{**base_config, "train_data": "s3://bucket/nothing/*.jsonl"}))


def test_prepared_prefixes_and_task_files_by_url_are_copied_once_and_train_like_local_ones(
        s3_server, base_config, tmp_path, pretrainer_log):
    """A `.bin/.idx` prefix and a task file in the bucket: copied into the local cache on first use (read at
    random offsets, and whole at every evaluation), with the losses and scores of the local files; the next run
    reuses the copies; a replaced object is copied again."""
    from helpers import QUICKSTART_MODEL, TASK_RECORDS, assert_same_downstream_scores, write_task
    from pretrainer.data.prepare import prepare

    prefix = tmp_path / "docs"
    prepare([base_config["train_data"]], str(QUICKSTART_MODEL), str(prefix), ["text"], append_eod=True,
            progress=False)
    task = write_task(tmp_path / "tiny_task.jsonl", TASK_RECORDS)
    for suffix in (".bin", ".idx"):
        s3_server.fs.put(f"{prefix}_text_document{suffix}", f"bucket/prepared/docs_text_document{suffix}")
    s3_server.fs.put(task, "bucket/tasks/tiny_task.jsonl")
    config = {**base_config, "train_data": None, "megatron_dataset_flag": True, "export_hf": False,
              "save_interval": 0, "dataloader_config": {"split": "90,10,0"}}
    local = {**config, "data_path": f"{prefix}_text_document", "downstream_evals": [task],
             "save_dir": str(tmp_path / "local")}
    remote = {**config, "data_path": "s3://bucket/prepared/docs_text_document",
              "downstream_evals": ["s3://bucket/tasks/tiny_task.jsonl"], "save_dir": str(tmp_path / "remote")}
    PreTrainer(PreTrainingArguments(**local)).train()
    pretrainer_log.take()
    PreTrainer(PreTrainingArguments(**remote)).train()
    assert pretrainer_log.take().count("into the local cache") == 3  # .bin, .idx, the task file
    assert train_losses(tmp_path / "remote") == pytest.approx(train_losses(tmp_path / "local"), rel=1e-6)
    assert_same_downstream_scores(tmp_path / "remote", tmp_path / "local", 1e-6)
    PreTrainer(PreTrainingArguments(**{**remote, "save_dir": str(tmp_path / "again")})).train()
    assert "into the local cache" not in pretrainer_log.take()
    s3_server.fs.pipe_file("bucket/tasks/tiny_task.jsonl", Path(task).read_bytes() + b"\n")  # a new version
    PreTrainer(PreTrainingArguments(**{**remote, "save_dir": str(tmp_path / "changed")})).train()
    assert pretrainer_log.take().count("into the local cache") == 1
