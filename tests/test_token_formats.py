"""Corpora tokenized by other toolchains (datatrove's `.ds` shards, dolma's `.npy` arrays) sample and train as the same
text prepared by `pretrainer prepare`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from helpers import CORPUS, QUICKSTART_MODEL
from pretrainer import DataError, PreTrainer, PreTrainingArguments
from pretrainer.data.builders import build_indexed_datasets
from pretrainer.data.prepare import prepare
from pretrainer.data.remote import local_prefix
from pretrainer.data.token_formats import open_prepared

BOS, EOS = 0, 1  # the quickstart tokenizer's <s> and </s>


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """90 documents of the shipped corpus in three JSON-lines files."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:90]
    for part in range(3):
        (folder / f"part-{part}.jsonl").write_text("\n".join(lines[part::3]) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def prepared_here(corpus, tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("here") / "docs"
    prepare([str(corpus)], str(QUICKSTART_MODEL), str(prefix), ["text"], append_eod=True, progress=False)
    return f"{prefix}_text_document"


def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(QUICKSTART_MODEL)


def datatrove_tokenize(corpus: Path, out: Path) -> Path:
    """datatrove's own DocumentTokenizer over the corpus, its documents kept in order; the tokenizer adds <s> and </s>
    as `prepare --append-eod` does."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    vocab = Tokenizer.from_file(str(QUICKSTART_MODEL / "tokenizer.json"))
    vocab.post_processor = TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", BOS), ("</s>", EOS)])
    vocab.save(str(out.parent / "bos-eos-tokenizer.json"))
    LocalPipelineExecutor(pipeline=[
        JsonlReader(str(corpus)),
        DocumentTokenizer(str(out), tokenizer_name_or_path=str(out.parent / "bos-eos-tokenizer.json"),
                          shuffle_documents=False),
    ], tasks=1, logging_dir=str(out.parent / "logs")).run()
    return out


def dolma_files(corpus: Path, out: Path, header: bool) -> Path:
    """The corpus as dolma writes it: each document's ids and its EOS back to back in uint16 arrays, two files
    (raw memory maps as dolma's, or `.npy` files with a header)."""
    vocab = Tokenizer.from_file(str(QUICKSTART_MODEL / "tokenizer.json"))
    texts = [json.loads(line)["text"] for f in sorted(corpus.glob("*.jsonl")) for line in f.read_text().splitlines()]
    docs = [vocab.encode(text).ids + [EOS] for text in texts]
    out.mkdir()
    for part, chunk in enumerate((docs[:40], docs[40:])):
        tokens = np.array([t for doc in chunk for t in doc], dtype=np.uint16)
        path = out / f"part-0-{part:05d}.npy"
        np.save(path, tokens) if header else tokens.tofile(path)
    return out


def samples(args_keys: dict, base_config: dict, data_path) -> list:
    args = PreTrainingArguments(**{**base_config, "train_data": None, "megatron_dataset_flag": True,
                                   "data_path": data_path, "dataloader_config": {"split": "90,10,0"}, **args_keys})
    from pretrainer.config import BatchSizes
    sizes = BatchSizes.of(args, args.seq_length, 1)
    built = build_indexed_datasets(args, sizes, tokenizer=tokenizer())
    return [built.train[i]["input_ids"].tolist() for i in range(len(built.train))] + \
        [built.eval[i]["input_ids"].tolist() for i in range(len(built.eval))]


def test_datatrove_and_dolma_corpora_sample_as_the_same_text_prepared_here(corpus, prepared_here, base_config,
                                                                          tmp_path):
    shards = datatrove_tokenize(corpus, tmp_path / "datatrove")
    assert len(list(shards.glob("*.ds"))) == 1 and list(shards.glob("*.ds.index"))
    expected = samples({}, base_config, prepared_here)
    assert len(expected) > 20
    assert samples({}, base_config, str(shards)) == expected
    for header in (False, True):
        assert samples({}, base_config, str(dolma_files(corpus, tmp_path / f"dolma-{header}", header))) == expected
    def mixture(first: str) -> list:
        return samples({}, base_config, [{"name": "a", "path": first, "weight": 0.5},
                                         {"name": "b", "path": prepared_here, "weight": 0.5}])
    assert mixture(str(shards)) == mixture(prepared_here)
    here = open_prepared(prepared_here)
    there = open_prepared(shards, tokenizer())
    assert there.num_documents == here.num_documents == 90
    assert there[89].tolist() == here[89].tolist() and there[0][:1].tolist() == [BOS]


def test_training_on_a_dolma_folder_gives_the_losses_of_the_prepared_text(corpus, prepared_here, base_config,
                                                                          tmp_path):
    def losses(data_path, name) -> list:
        args = PreTrainingArguments(**{**base_config, "train_data": None, "megatron_dataset_flag": True,
                                       "data_path": data_path, "dataloader_config": {"split": "90,10,0"},
                                       "num_training_steps": 3, "eval_interval": 0, "save_interval": 0,
                                       "save_dir": str(tmp_path / name)})
        PreTrainer(args).train()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    dolma = dolma_files(corpus, tmp_path / "dolma", header=False)
    assert losses(str(dolma), "dolma") == losses(prepared_here, "here")


def test_datatrove_and_dolma_corpora_in_object_storage_sample_as_the_local_ones(corpus, prepared_here, base_config,
                                                                                s3_server, tmp_path, monkeypatch):
    """A folder of token files, or one file, at an s3:// URL (moto's S3 server): copied into the local cache on first
    use, datatrove's index and metadata with it."""
    monkeypatch.setenv("PRETRAINER_CACHE_DIR", str(tmp_path / "cache"))
    shards = datatrove_tokenize(corpus, tmp_path / "datatrove")
    dolma = dolma_files(corpus, tmp_path / "dolma", header=True)
    (dolma / "manifest.json").write_text('{"tool": "another one"}')  # not a manifest of prepare --sharded
    for folder in (shards, dolma):
        for path in folder.iterdir():
            s3_server.fs.put_file(str(path), f"bucket/{folder.name}/{path.name}")
    # a subfolder's files are not the folder's (as on local disk)
    s3_server.fs.put_file(str(next(dolma.glob("*.npy"))), "bucket/dolma/older/part-0-00000.npy")
    assert samples({}, base_config, str(dolma)) == samples({}, base_config, prepared_here)
    expected = samples({}, base_config, prepared_here)
    assert samples({}, base_config, "s3://bucket/datatrove") == expected
    assert samples({}, base_config, "s3://bucket/dolma/") == expected
    first = sorted(dolma.glob("*.npy"))[0].name
    assert open_prepared(local_prefix(f"s3://bucket/dolma/{first}"), tokenizer()).num_documents == 40
    with pytest.raises(DataError, match="no Megatron prefix .* datatrove .ds or dolma .npy token files there"):
        local_prefix("s3://bucket/nothing-here")


def test_bad_token_files_are_named(corpus, tmp_path):
    shards = datatrove_tokenize(corpus, tmp_path / "datatrove")
    (shard,) = shards.glob("*.ds")
    Path(f"{shard}.index").rename(tmp_path / "index")
    with pytest.raises(DataError, match=rf"{shard.name}.index beside it, so its document boundaries are unknown"):
        open_prepared(shards, tokenizer())
    (tmp_path / "index").rename(f"{shard}.index")
    with open(shard, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match=r"bytes, but .*\.ds\.index ends at \d+ tokens of 2 bytes; the pair is "
                                        "truncated"):
        open_prepared(shards, tokenizer())
    (tmp_path / "big").mkdir()
    np.array([9000, 5, EOS], dtype=np.uint16).tofile(tmp_path / "big" / "a.npy")
    with pytest.raises(DataError, match="the dolma files hold token id 9000, but the run's tokenizer has 4096 tokens"):
        open_prepared(tmp_path / "big", tokenizer())
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "a.npy").write_bytes(b"\x05")
    with pytest.raises(DataError, match="1 bytes is not a whole number of uint16 tokens"):
        open_prepared(odd, tokenizer())
    with pytest.raises(DataError, match="dolma token files mark documents with the tokenizer's EOS"):
        open_prepared(tmp_path / "big", None)
    np.array([7, 8, 9], dtype=np.uint16).tofile(odd / "a.npy")
    with pytest.raises(DataError, match=r"no EOS \(id 1\) in its 3 tokens, so it holds no document boundaries"):
        open_prepared(odd, tokenizer())
    np.save(odd / "b.npy", np.array([7, EOS], dtype=np.uint32))
    np.array([7, EOS], dtype=np.uint16).tofile(odd / "a.npy")
    with pytest.raises(DataError, match=r"the dolma files mix token types \(uint16, uint32\)"):
        open_prepared(odd, tokenizer())
    (odd / "c.ds").write_bytes(b"")
    with pytest.raises(DataError, match="holds both datatrove .ds and dolma .npy files"):
        open_prepared(odd, tokenizer())
    with pytest.raises(DataError, match="a folder without datatrove .ds or dolma .npy token files; a corpus prepared "
                                        "here or by Megatron is named by its prefix"):
        open_prepared(corpus, tokenizer())
