"""Training data in object storage: a real S3-compatible server (moto's server mode) on 127.0.0.1, the real
client stack (s3fs, botocore). `train_data: s3://bucket/corpus/*.jsonl.zst` trains with the losses of the same
files on local disk; a changed object is tokenized again, an unchanged one is not."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import train_losses
from launch import listening_port
from pretrainer import PreTrainer, PreTrainingArguments

s3fs = pytest.importorskip("s3fs", reason="the s3 extra (s3fs) is part of make setup-test")
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on a free local port, for the module; the environment points the clients at it."""
    port = listening_port()
    server = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        for _ in range(100):  # until it answers
            try:
                fs.mkdir("bucket")
                break
            except Exception:
                time.sleep(0.1)
        else:
            server.kill()
            pytest.fail(f"moto_server did not start on {endpoint}")
        yield fs
    server.terminate()
    server.wait(timeout=10)


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
        s3_server.put(str(path), f"bucket/corpus/{path.name}")
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
    s3_server.put(str(other), "bucket/corpus/part-1.jsonl.zst")
    PreTrainer(PreTrainingArguments(**{**remote, "save_dir": str(tmp_path / "changed")})).train()
    assert "tokenizing 2 file(s)" in pretrainer_log.take()
    assert train_losses(tmp_path / "changed") != pytest.approx(local, rel=1e-6)


def test_a_missing_object_names_the_url(s3_server, base_config, tmp_path):
    from pretrainer.data import DataError

    with pytest.raises(DataError, match=r"train_data: pattern 's3://bucket/nothing/\*\.jsonl' matches no object"):
        PreTrainer(PreTrainingArguments(**{**base_config, "train_data": "s3://bucket/nothing/*.jsonl"}))
