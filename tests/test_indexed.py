"""Prepared data: Megatron-Core byte compatibility, `pretrainer prepare`, and training from .bin/.idx."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import CORPUS, QUICKSTART_MODEL, assert_resume_reproduces, files_limited_to
from launch import environment, pretrainer, run
from pretrainer import DataError, PreTrainer, PreTrainingArguments
from pretrainer.data import split_ranges
from pretrainer.data.indexed import IndexedDataset, IndexedDatasetWriter

indexed_dataset = pytest.importorskip("megatron.core.datasets.indexed_dataset")
DOCS = [[5, 6, 7], [1], list(range(100, 140)), [9, 9]]


def test_writer_is_byte_identical_to_megatron_core(tmp_path):
    ours = IndexedDatasetWriter(tmp_path / "ours", np.uint16)
    theirs = indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    import torch

    for doc in DOCS:
        ours.add_document(doc)
        theirs.add_document(torch.tensor(doc), [len(doc)])
    ours.finalize()
    theirs.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()
    read_back = indexed_dataset.IndexedDataset(str(tmp_path / "ours"))
    assert [read_back[i].tolist() for i in range(len(DOCS))] == DOCS


def test_reader_takes_megatron_files_with_multi_sequence_documents(tmp_path):
    """The reference layout: lengths [10,3,20,5,3,3,2], the last document made of two sequences."""
    import torch

    builder = indexed_dataset.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    lengths = [10, 3, 20, 5, 3, 3, 2]
    sequences = [torch.arange(n, dtype=torch.int64) + 10 * i for i, n in enumerate(lengths)]
    for seq in sequences[:5]:
        builder.add_item(seq)
        builder.end_document()
    builder.add_document(torch.cat(sequences[5:]), lengths[5:])
    builder.finalize(str(tmp_path / "m.idx"))
    assert (tmp_path / "m.bin").stat().st_size == 92
    dataset = IndexedDataset(tmp_path / "m")
    assert dataset.num_documents == 6 and dataset.document_indices.tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert dataset.sequence_pointers.tolist() == [0, 20, 26, 66, 76, 82, 88]
    start, end = dataset.document_token_range(5, 6)
    assert dataset.tokens[start:end].tolist() == torch.cat(sequences[5:]).tolist()
    from pretrainer.data import GPTSamples, IndexCache

    # GPT samples over Megatron's file: one epoch's samples, put back in stream order, tile the documents
    samples = GPTSamples(dataset, (0, 6), 5, 10, 0, IndexCache(tmp_path / "cache"))  # 46 tokens: 10 samples
    by_start = sorted(range(10), key=lambda i: int(samples.sample_order[i]))
    stream = [t for i in by_start for t in samples.tokens(i)[:-1].tolist()]
    documents = [torch.cat(sequences[:5][i:i + 1]).tolist() for i in range(5)] + [torch.cat(sequences[5:]).tolist()]
    order = samples.document_order[:6].tolist()
    assert stream[:46] == [t for d in order for t in documents[d]]


def test_truncated_pair_and_split_strings_are_clear_errors(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "d")
    for doc in DOCS:
        writer.add_document(doc)
    writer.finalize()
    with open(tmp_path / "d.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="bytes, but its index describes"):
        IndexedDataset(tmp_path / "d")
    with pytest.raises(DataError, match="does not exist"):
        IndexedDataset(tmp_path / "missing")
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("100,0,0", 7) == [(0, 7), (7, 7), (7, 7)]
    with pytest.raises(DataError, match="up to three"):
        split_ranges("1,2,3,4", 10)


def prepare(*args: str) -> subprocess.CompletedProcess:
    return run(pretrainer("prepare", *args))


def test_prepare_matches_the_tokenizer_and_megatron_reads_it(tmp_path):
    done = prepare("--input", str(CORPUS), "--tokenizer", str(QUICKSTART_MODEL), "--output-prefix",
                   str(tmp_path / "docs"), "--append-eod", "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert "documents: 1,603" in done.stdout
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_MODEL)
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    theirs = indexed_dataset.IndexedDataset(str(tmp_path / "docs_text_document"))
    assert len(theirs) == len(texts) and theirs.index.dtype == np.uint16
    for i in (0, 1, 777, len(texts) - 1):
        assert theirs[i].tolist() == tokenizer(texts[i])["input_ids"] + [tokenizer.eos_token_id]
    summary = json.loads((tmp_path / "docs_summary.json").read_text())
    assert summary["documents"] == 1603 and summary["tokens"] == int(theirs.sequence_lengths.sum())
    # Megatron-LM's own flags give the same files
    same = prepare("--input", str(CORPUS), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                   str(QUICKSTART_MODEL), "--output-prefix", str(tmp_path / "flags"), "--append-eod", "--workers", "2",
                   "--partitions", "1", "--log-interval", "1000", "--keep-sequential-samples")
    assert same.returncode == 0, same.stderr
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"flags_text_document{suffix}").read_bytes() == \
            (tmp_path / f"docs_text_document{suffix}").read_bytes()
    refused = prepare("--input", str(CORPUS), "--tokenizer-model", str(QUICKSTART_MODEL), "--output-prefix",
                      str(tmp_path / "x"), "--split-sentences")
    assert refused.returncode == 2 and "--split-sentences is not supported" in refused.stderr


def test_prepare_other_keys_and_a_bad_record_leaves_no_pair(tmp_path):
    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "a b", "title": "T1"}\n{"text": "c", "title": "T2"}\n')
    done = prepare("--input", str(records), "--tokenizer", str(QUICKSTART_MODEL), "--output-prefix",
                   str(tmp_path / "out"), "--json-keys", "text", "title")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out_title_document.idx").is_file() and (tmp_path / "out_text_document.bin").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    done = prepare("--input", str(bad), "--tokenizer", str(QUICKSTART_MODEL), "--output-prefix", str(tmp_path / "b"))
    assert done.returncode == 2 and "bad.jsonl:2: invalid JSON" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("b_", ".b_"))) == []


def test_training_from_prepared_data_resumes_exactly(base_config, tmp_path):
    prefix = tmp_path / "docs"
    assert prepare("--input", base_config["train_data"], "--tokenizer", str(QUICKSTART_MODEL), "--output-prefix",
                   str(prefix), "--append-eod").returncode == 0
    config = {**base_config, "train_data": None, "megatron_dataset_flag": True,
              "data_path": str(prefix) + "_text_document", "dataloader_config": {"split": "90,10,0"}}
    assert_resume_reproduces(config, tmp_path)
    with pytest.raises(DataError, match="leaves no training documents"):
        PreTrainer(PreTrainingArguments(**{**config, "dataloader_config": {"split": "0,100,0"}}))


def test_prepare_skip_mode_summary_chat_rows_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "in" / "a.jsonl"
    good.parent.mkdir()
    good.write_bytes(b'{"text": "first"}\n{"text": ""}\n{"text": oops}\n'
                     b'{"text": "<s>Human: hi\\n</s><s>Assistant: yo\\n</s>"}\n')
    pq.write_table(pa.table({"text": ["from parquet"]}), tmp_path / "in" / "b.parquet")
    args = ("--input", str(tmp_path / "in"), "--tokenizer", str(QUICKSTART_MODEL), "--append-eod")
    failed = prepare(*args, "--output-prefix", str(tmp_path / "f"))
    assert failed.returncode == 2 and "a.jsonl:2: empty text" in failed.stderr
    done = prepare(*args, "--output-prefix", str(tmp_path / "s"), "--on-error", "skip")
    assert done.returncode == 0, done.stderr
    assert "skipped: 2 bad record(s) (empty text: 1, invalid JSON: 1)" in done.stdout
    summary = json.loads((tmp_path / "s_summary.json").read_text())
    assert summary["documents"] == 3 and summary["skipped"] == {"empty text": 1, "invalid JSON": 1}
    assert summary["skipped_examples"][1].startswith(f"{good}:3: invalid JSON")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_MODEL)
    written = IndexedDataset(tmp_path / "s_text_document")
    chat = written[1].tolist()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert chat[:2] != [bos, bos] and chat[0] == bos and chat[-1] == eos and chat[-2] != eos  # no doubled BOS/EOS
    assert chat == tokenizer("<s>Human: hi\n</s><s>Assistant: yo\n</s>", add_special_tokens=False)["input_ids"]
    assert written[2].tolist() == tokenizer("from parquet")["input_ids"] + [eos]


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR to a Megatron-LM source tree "
                    "(its tools/preprocess_data.py; not installable from the package registry) to run this check")
def test_prepare_is_byte_identical_to_megatron_lm_preprocess_data(tmp_path):
    tree = Path(os.environ["MEGATRON_LM_DIR"])
    env = environment(None, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    theirs = run([sys.executable, "tools/preprocess_data.py", "--input", CORPUS, "--output-prefix", tmp_path / "theirs",
                  "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", QUICKSTART_MODEL, "--workers", "2",
                  "--append-eod"], cwd=tree, env=env, timeout=600)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert prepare("--input", str(CORPUS), "--tokenizer", str(QUICKSTART_MODEL), "--output-prefix",
                   str(tmp_path / "ours"), "--workers", "2", "--append-eod").returncode == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours_text_document{suffix}").read_bytes() == \
            (tmp_path / f"theirs_text_document{suffix}").read_bytes()


def test_prepare_shards_split_the_input_files_and_train_as_one_blend(tmp_path, base_config):
    for name in "abcde":
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} text {i}"}) + "\n"
                                                        for i in range(40)))
    for k in (1, 2):
        done = prepare("--input", str(tmp_path / "*.jsonl"), "--tokenizer", str(QUICKSTART_MODEL), "--output-prefix",
                       str(tmp_path / f"part{k}"), "--append-eod", "--shard", f"{k}/2")
        assert done.returncode == 0, done.stderr
    parts = [IndexedDataset(tmp_path / f"part{k}_text_document") for k in (1, 2)]
    assert [p.num_documents for p in parts] == [120, 80]  # files a, c, e and b, d
    bad = prepare("--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(QUICKSTART_MODEL), "--output-prefix",
                  str(tmp_path / "none"), "--shard", "2/2")
    assert bad.returncode == 2 and "--shard 2/2: the 1 input file(s) give part 2 nothing" in bad.stderr
    blend = [str(tmp_path / f"part{k}_text_document") for k in (1, 2)]
    args = PreTrainingArguments(**{**base_config, "train_data": None, "megatron_dataset_flag": True,
                                   "data_path": blend, "dataloader_config": {"split": "90,10,0"},
                                   "num_training_steps": 2, "save_dir": str(tmp_path / "run")})
    PreTrainer(args).train()


def test_prepare_whose_writes_fail_is_one_line_and_leaves_no_pair(tmp_path):
    from pretrainer.data.prepare import prepare

    with files_limited_to(16 * 1024), pytest.raises(DataError) as failure:  # the corpus's tokens are larger
        prepare([str(CORPUS)], str(QUICKSTART_MODEL), str(tmp_path / "docs"), ["text"], workers=1)
    assert str(failure.value) == (f"prepare: writing {tmp_path / 'docs_text_document'}.bin and .idx failed ([Errno "
                                  "27] File too large); free space there, or give an --output-prefix on a larger disk")
    assert list(tmp_path.iterdir()) == []
