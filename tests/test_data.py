"""Readers, templates, tokenize-and-pack, eval split and the resumable stream, on real files and tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from helpers import EXAMPLES, QUICKSTART_MODEL
from pretrainer.data import (
    BatchStream,
    DataError,
    EvalBatches,
    PackedDataset,
    SampleStream,
    collate_packed,
    expand_paths,
    read_documents,
    split_indices,
)
from pretrainer.data.assemble import DataPlacement
from pretrainer.data.token_store import open_store, store_spec

ONE_PROCESS = DataPlacement(0, 1, True, lambda: None)


def tokenized(tmp_path, tokenizer, rows: list[str]):
    """The token store of a jsonl file holding `rows` (through the training pipeline's tokenization)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    return open_store(store_spec([path], tokenizer, "text", "line"), tmp_path / "cache", "train_data", tokenizer,
                      ONE_PROCESS)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(QUICKSTART_MODEL)


def docs(path, **kw):
    return list(read_documents(expand_paths([str(path)]), **kw))


def test_formats_json_array_jsonl_csv_txt(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": "one"}, {"text": "two"}]))
    (tmp_path / "b.jsonl").write_text('{"text": "three"}\n\n{"text": "four"}\n')
    (tmp_path / "c.csv").write_text('text,other\n"five, with comma",x\n"six\nlines",y\n')
    (tmp_path / "d.txt").write_text("seven\neight\n")
    assert [d.text for d in docs(tmp_path / "a.json")] == ["one", "two"]
    assert [d.text for d in docs(tmp_path / "b.jsonl")] == ["three", "four"]
    assert [d.text for d in docs(tmp_path / "c.csv")] == ["five, with comma", "six\nlines"]
    assert [d.text for d in docs(tmp_path / "d.txt")] == ["seven", "eight"]
    assert [d.text for d in docs(tmp_path / "d.txt", txt_mode="file")] == ["seven\neight\n"]
    assert len(docs(tmp_path)) == 2 + 2 + 2 + 2  # a directory reads every supported file
    assert len(list(read_documents(expand_paths([str(tmp_path / "*.json*")])))) == 4
    long = "x" * 200_000  # longer than the csv module's default field limit (128 KiB)
    (tmp_path / "long.csv").write_text(f"text\n{long}\n")
    assert [d.text for d in docs(tmp_path / "long.csv")] == [long]


def test_alpaca_records_use_the_alpaca_template():
    records = docs(EXAMPLES / "data" / "python_topics_alpaca.json")
    raw = json.loads((EXAMPLES / "data" / "python_topics_alpaca.json").read_text())
    assert len(records) == len(raw)
    first = records[0].text
    assert "### Instruction:\n" + raw[0]["instruction"] in first
    assert first.endswith("### Response:\n" + raw[0]["output"])


def test_chat_rows_get_no_doubled_bos_and_no_extra_eos(tokenizer, tmp_path):
    rows = docs(EXAMPLES / "data" / "python_topics_chat.csv")
    assert rows[0].text.startswith("<s>Human: ")
    stream = tokenized(tmp_path, tokenizer, [row.text for row in rows[:2]]).tokens
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert stream[0] == bos and stream[1] != bos
    first_end = int(np.flatnonzero(stream == eos)[1])  # each row holds two turns, each closed by </s>
    assert stream[first_end + 1] == bos and stream[first_end + 2] != bos
    assert stream[-1] == eos and stream[-2] != eos


def test_parquet_and_chat_messages_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = [{"role": "user", "content": "What is a tuple?"}, {"role": "assistant", "content": "An immutable list."}]
    pq.write_table(pa.table({"text": ["alpha", "beta"], "n": [1, 2]}), tmp_path / "t.parquet", row_group_size=1)
    pq.write_table(pa.table({"messages": [chat]}), tmp_path / "m.parquet")
    (tmp_path / "m.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    assert [(d.text, d.where.split(": ")[-1]) for d in docs(tmp_path / "t.parquet")] == [("alpha", "row 0"),
                                                                                          ("beta", "row 1")]
    expected = "<s>Human: What is a tuple?\n</s><s>Assistant: An immutable list.\n</s>"
    assert docs(tmp_path / "m.parquet")[0].text == docs(tmp_path / "m.jsonl")[0].text == expected
    # the same conversation as a Human/Assistant CSV row reads as the same text
    (tmp_path / "c.csv").write_text('text\n"<s>Human: What is a tuple?\n</s><s>Assistant: An immutable list.\n</s>"\n')
    assert docs(tmp_path / "c.csv")[0].text == expected
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: messages\[0\] must be an object with string"):
        docs(tmp_path / "bad.jsonl")


def test_skip_mode_reports_each_bad_record_and_keeps_the_rest(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "good one"}\n{"text": oops}\n{"title": "no text"}\n{"text": 5}\n'
                     b'{"text": "bad \xff byte"}\n{"text": "good two"}\n')
    bad = []
    kept = docs(path, on_bad=bad.append)
    assert [d.text for d in kept] == ["good one", "good two"]
    assert [e.reason for e in bad] == ["invalid JSON", "missing field", "wrong field type", "not UTF-8"]
    assert [str(e).split(": ")[0] for e in bad] == [f"{path}:{n}" for n in (2, 3, 4, 5)]
    (tmp_path / "gaps.txt").write_text("one\n\n   \ntwo\n")
    assert [d.where.rsplit(":", 1)[1] for d in docs(tmp_path / "gaps.txt")] == ["1", "4"]  # blank lines: no documents


def test_plain_documents_get_bos_and_eos_between_them(tokenizer, tmp_path):
    store = tokenized(tmp_path, tokenizer, ["hello world", "", "second doc"])
    assert store.num_documents == 3 and store.sequence_lengths[1] == 0  # an empty text: an empty document
    stream = np.asarray(store.tokens)
    hello = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    second = tokenizer("second doc", add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert stream.tolist() == [bos, *hello, eos, bos, *second, eos]


def test_packing_keeps_every_token_as_a_target_once(tokenizer):
    stream = np.arange(1000, dtype=np.uint16) % 4096
    dataset = PackedDataset(stream, seq_length=64)
    assert len(dataset) == 16  # ceil(999 / 64)
    targets = torch.cat([dataset[i]["shift_labels"] for i in range(len(dataset))])
    inputs = torch.cat([dataset[i]["input_ids"] for i in range(len(dataset))])
    assert targets.tolist() == stream[1:].tolist()
    assert inputs.tolist() == stream[:-1].tolist()
    batch = collate_packed([dataset[14], dataset[15]], pad_token_id=2)
    assert batch["input_ids"].shape == (2, 64)
    assert batch["attention_mask"][1].sum() == len(dataset[15]["input_ids"])
    assert (batch["shift_labels"][1, len(dataset[15]["input_ids"]):] == -100).all()
    full = collate_packed([dataset[0], dataset[1]], pad_token_id=2)
    assert "attention_mask" not in full  # full windows need no mask


def test_eval_split_on_tiny_inputs_does_not_crash():
    train, held = split_indices(1, 0.05, seed=1)
    assert train.tolist() == [0] and held.tolist() == []
    train, held = split_indices(2, 0.5, seed=1)
    assert len(train) == 1 and len(held) == 1
    train, held = split_indices(2, 10, seed=1)  # a count larger than the data leaves one for training
    assert len(train) == 1 and len(held) == 1


def test_packed_windows_over_chosen_documents_read_their_concatenation():
    tokens = np.arange(100, dtype=np.uint16)
    starts, lengths = np.array([0, 10, 40, 70]), np.array([10, 0, 20, 5])  # doc 1 empty; gaps between others
    dataset = PackedDataset(tokens, seq_length=4, documents=(starts, lengths))
    expected = [*range(0, 10), *range(40, 60), *range(70, 75)]
    assert dataset.num_tokens == 35 and len(dataset) == 9  # ceil(34 / 4)
    assert torch.cat([dataset[i]["shift_labels"] for i in range(len(dataset))]).tolist() == expected[1:]
    assert torch.cat([dataset[i]["input_ids"] for i in range(len(dataset))]).tolist() == expected[:-1]
    adjacent = PackedDataset(tokens, seq_length=4, documents=(np.array([20, 30]), np.array([10, 10])))
    assert adjacent[0]["input_ids"].tolist() == [20, 21, 22, 23]


@pytest.mark.parametrize("content, suffix, message", [
    ('{"text": "ok"}\n{"text": broken}\n', ".jsonl", r"bad\.jsonl:2: invalid JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n', ".jsonl", r"bad\.jsonl:2: record has no 'text' field .* 'body'"),
    ('{"text": 5}\n', ".jsonl", r"bad\.jsonl:1: field 'text' must be a string"),
    ("body\nx\n", ".csv", r"bad\.csv:1: CSV header has no 'text' column"),
    ('[{"text": "a"}, 7]', ".json", r"bad\.json: record 1: expected an object"),
])
def test_bad_records_name_file_and_line(tmp_path, content, suffix, message):
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        docs(path)


def test_undecodable_bytes_and_missing_or_unsupported_files(tmp_path):
    path = tmp_path / "bin.txt"
    path.write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(DataError, match=r"bin\.txt:2: not valid UTF-8"):
        docs(path)
    with pytest.raises(DataError, match="does not exist"):
        expand_paths([str(tmp_path / "missing.jsonl")])
    (tmp_path / "x.xlsx").write_bytes(b"")
    with pytest.raises(DataError, match="unsupported type .xlsx"):
        expand_paths([str(tmp_path / "x.xlsx")])
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable parquet file"):
        docs(tmp_path / "broken.parquet")
    with pytest.raises(DataError, match="matches no file"):
        expand_paths([str(tmp_path / "*.zzz")])


def ids(batch) -> list[list[int]]:
    return batch["input_ids"].tolist()


def test_sample_stream_resumes_at_the_exact_next_sample_across_epochs():
    dataset = PackedDataset(np.arange(200, dtype=np.uint16), seq_length=8)  # 25 windows
    make = lambda: SampleStream(dataset, 3, 0, seed=5)  # noqa: E731
    reference = [ids(next(s)) for s in [make()] for _ in range(20)]  # 60 samples: more than two epochs
    first = make()
    head = [ids(next(first)) for _ in range(11)]
    assert first.state_dict() == {"samples": 33} and first.epoch == 1
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + [ids(next(resumed)) for _ in range(9)] == reference
    epoch0 = [row for batch in reference for row in batch][:25]
    epoch1 = [row for batch in reference for row in batch][25:50]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1  # every window once per epoch, reshuffled


def test_ranks_split_each_global_batch_and_can_resume_on_another_world_size():
    dataset = PackedDataset(np.arange(400, dtype=np.uint16), seq_length=8)
    single = SampleStream(dataset, 4, 0, seed=1)
    ranks = [SampleStream(dataset, 2, 0, seed=1, rank=r, world_size=2) for r in range(2)]
    for _ in range(15):
        assert ids(next(single)) == ids(next(ranks[0])) + ids(next(ranks[1]))
    assert single.state_dict() == ranks[0].state_dict() == ranks[1].state_dict()
    resumed = SampleStream(dataset, 4, 0, seed=1)
    resumed.load_state_dict(ranks[1].state_dict())  # 2 ranks -> 1 process
    assert ids(next(resumed)) == ids(next(single))


def test_eval_batches_cover_the_same_windows_on_any_world_size():
    dataset = PackedDataset(np.arange(90, dtype=np.uint16), seq_length=8)  # 12 windows, last one short
    one = [b for b in EvalBatches(dataset, 4, 0)]
    two = [list(EvalBatches(dataset, 3, 0, rank=r, world_size=2)) for r in range(2)]
    assert len(two[0]) == len(two[1]) == 2  # same number of forwards on every rank
    targets = lambda batches: sorted(t for b in batches for row in b["shift_labels"].tolist()  # noqa: E731
                                     for t in row if t != -100)
    assert targets(one) == targets(two[0] + two[1]) == list(range(1, 90))


def test_batch_stream_resumes_a_shuffled_user_dataloader_exactly():
    data = [{"input_ids": torch.tensor([i])} for i in range(10)]
    make = lambda: BatchStream(torch.utils.data.DataLoader(data, batch_size=3, shuffle=True), seed=5)  # noqa: E731
    reference = [next(s)["input_ids"].tolist() for s in [make()] for _ in range(9)]  # 4 batches per epoch
    first = make()
    head = [next(first)["input_ids"].tolist() for _ in range(5)]
    assert first.state_dict() == {"epoch": 1, "offset": 1}
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + [next(resumed)["input_ids"].tolist() for _ in range(4)] == reference
    assert reference[0] != reference[4]  # epochs are reshuffled


def test_gzip_and_zstd_inputs_read_like_plain_files(tmp_path):
    import gzip

    import zstandard

    (tmp_path / "plain").mkdir()
    (tmp_path / "packed").mkdir()
    files = {"a.jsonl": '{"text": "one"}\n{"text": "two"}\n', "b.csv": 'text\n"three, 3"\n',
             "c.txt": "four\nfive\n"}
    for name, content in files.items():
        (tmp_path / "plain" / name).write_text(content)
    (tmp_path / "packed" / "a.jsonl.gz").write_bytes(gzip.compress(files["a.jsonl"].encode()))
    (tmp_path / "packed" / "b.csv.zst").write_bytes(zstandard.ZstdCompressor().compress(files["b.csv"].encode()))
    (tmp_path / "packed" / "c.txt.gz").write_bytes(gzip.compress(files["c.txt"].encode()))
    plain = [d.text for d in docs(tmp_path / "plain")]
    packed = [d.text for d in docs(tmp_path / "packed")]
    assert packed == plain == ["one", "two", "three, 3", "four", "five"]
    (tmp_path / "x.bin.gz").write_bytes(gzip.compress(b"x"))
    with pytest.raises(DataError, match=r"unsupported type \.bin\.gz"):
        expand_paths([str(tmp_path / "x.bin.gz")])


def test_token_store_is_reused_and_rebuilt_when_its_inputs_or_tokenizer_change(tokenizer, tmp_path, caplog):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(50)))
    root = tmp_path / "cache"

    def store(tok=tokenizer):
        return open_store(store_spec([path], tok, "text", "line"), root, "train_data", tok, ONE_PROCESS, workers=2)

    first = store()
    folders = sorted(p.name for p in root.iterdir())
    with caplog.at_level("INFO", logger="pretrainer.data.token_store"):
        again = store()
    assert "reusing the tokenized store" in caplog.text and sorted(p.name for p in root.iterdir()) == folders
    assert np.array_equal(first.tokens, again.tokens) and first.num_documents == 50
    with open(path, "a") as f:  # a changed input: another store
        f.write(json.dumps({"text": "one more"}) + "\n")
    assert store().num_documents == 51 and len(list(root.iterdir())) == 2
    extended = AutoTokenizer.from_pretrained(QUICKSTART_MODEL)
    extended.add_tokens(["zzqx"])  # a changed tokenizer: another store
    store(extended)
    assert len(list(root.iterdir())) == 3


def test_a_damaged_or_interrupted_token_store_is_rebuilt(tokenizer, tmp_path, caplog):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"text {i} " * 20}) + "\n" for i in range(200)))
    root = tmp_path / "cache"
    spec = store_spec([path], tokenizer, "text", "line")
    good = np.asarray(open_store(spec, root, "train_data", tokenizer, ONE_PROCESS).tokens).copy()
    folder = root / spec.key()
    with open(folder / "tokens.bin", "r+b") as f:  # truncated on disk
        f.truncate(100)
    with caplog.at_level("WARNING", logger="pretrainer.data.token_store"):
        rebuilt = open_store(spec, root, "train_data", tokenizer, ONE_PROCESS)
    assert "is damaged" in caplog.text and np.array_equal(rebuilt.tokens, good)
    # a build that fails half-way (a bad record near the end) leaves no store that looks complete
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text() + '{"text": oops}\n')
    bad_spec = store_spec([bad], tokenizer, "text", "line")
    with pytest.raises(DataError, match=r"bad\.jsonl:201: invalid JSON"):
        open_store(bad_spec, root, "train_data", tokenizer, ONE_PROCESS)
    assert not any((root / bad_spec.key()).glob("manifest.json")) and not any((root / bad_spec.key()).glob("*.idx"))


def test_on_error_skip_leaves_bad_records_out_of_the_store_and_counts_them(tokenizer, tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "good one"}\n{"text": oops}\n{"title": "no text"}\n{"text": "good two"}\n')
    with pytest.raises(DataError, match=r"mixed\.jsonl:2: invalid JSON"):
        open_store(store_spec([path], tokenizer, "text", "line"), tmp_path / "cache", "train_data", tokenizer,
                   ONE_PROCESS)
    spec = store_spec([path], tokenizer, "text", "line", on_error="skip")
    with caplog.at_level("WARNING", logger="pretrainer.data.token_store"):
        store = open_store(spec, tmp_path / "cache", "train_data", tokenizer, ONE_PROCESS)
    assert store.num_documents == 2
    assert "skipped 2 bad record(s) (on_error: skip; invalid JSON: 1, missing field: 1)" in caplog.text
    manifest = json.loads((tmp_path / "cache" / spec.key() / "manifest.json").read_text())
    assert manifest["skipped"] == 2 and manifest["skipped_examples"][0].startswith(f"{path}:2: invalid JSON")


def test_a_tokenizer_without_a_fast_backend_is_encoded_in_process_with_the_same_tokens(tokenizer, tmp_path):
    import dataclasses

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i} of the corpus"}) + "\n" for i in range(30)) +
                    json.dumps({"text": ""}) + "\n")
    spec = store_spec([path], tokenizer, "text", "line")
    workers = open_store(spec, tmp_path / "a", "train_data", tokenizer, ONE_PROCESS)
    # What store_spec makes for a tokenizer with no serializable backend: no worker JSON, a vocabulary key.
    here = dataclasses.replace(spec, encode=dataclasses.replace(spec.encode, tokenizer_json=""),
                               tokenizer_fingerprint=json.dumps(sorted(tokenizer.get_vocab().items())))
    assert here.key() != spec.key()
    in_process = open_store(here, tmp_path / "b", "train_data", tokenizer, ONE_PROCESS)
    assert np.array_equal(in_process.sequence_lengths, workers.sequence_lengths)
    assert np.array_equal(in_process.tokens, workers.tokens) and in_process.sequence_lengths[-1] == 0


def test_a_build_killed_mid_way_leaves_no_complete_looking_store_and_the_next_run_cleans_up(tokenizer, tmp_path,
                                                                                             caplog):
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:  # ~40 MB: the build runs for seconds
        for i in range(40_000):
            f.write(json.dumps({"text": f"document {i} " + "some words of the corpus " * 40}) + "\n")
    root = tmp_path / "cache"
    build = ("import sys; from transformers import AutoTokenizer; from pretrainer.data.assemble import DataPlacement; "
             "from pretrainer.data.token_store import open_store, store_spec; "
             f"t = AutoTokenizer.from_pretrained({str(QUICKSTART_MODEL)!r}); "
             f"open_store(store_spec([__import__('pathlib').Path({str(path)!r})], t, 'text', 'line'), "
             f"__import__('pathlib').Path({str(root)!r}), 'train_data', t, DataPlacement(0, 1, True, lambda: None))")
    process = subprocess.Popen([sys.executable, "-c", build])
    spec = store_spec([path], tokenizer, "text", "line")
    folder = root / spec.key()
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size > 1_000_000 for p in folder.glob(".tokens.bin.tmp-*")):
        assert process.poll() is None and time.monotonic() < deadline, "the build ended before it could be killed"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (folder / "manifest.json").exists() and not (folder / "tokens.idx").exists()
    with caplog.at_level("INFO", logger="pretrainer.data.token_store"):
        store = open_store(spec, root, "train_data", tokenizer, ONE_PROCESS, workers=2)
    assert "removed the partial files of an interrupted build" in caplog.text
    assert store.num_documents == 40_000 and (folder / "manifest.json").is_file()
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "tokens.bin", "tokens.idx"]


def test_the_quickstart_batches_are_its_documents_tokenized_directly_and_packed_in_order(tokenizer):
    """The token store changes nothing in what is trained on: the quickstart's train and eval windows equal
    the documents encoded one by one with the tokenizer (BOS + text + EOS), concatenated in order."""
    from pretrainer import PreTrainingArguments
    from pretrainer.data import build_datasets

    args = PreTrainingArguments.from_yaml(EXAMPLES / "quickstart.yaml",
                                          [f"train_data={EXAMPLES / 'data/python_docs.jsonl'}"])
    built = build_datasets(args, tokenizer, args.seq_length, ONE_PROCESS)
    texts = [d.text for d in read_documents(expand_paths(args.resolved_train_data))]
    train_ids, eval_ids = split_indices(len(texts), args.eval_split, args.seed)

    def stream(ids):
        tokens = []
        for i in ids:
            body = tokenizer(texts[i], add_special_tokens=False)["input_ids"]
            if body:
                tokens += [tokenizer.bos_token_id] + body + [tokenizer.eos_token_id]
        return torch.tensor(tokens)

    length = args.seq_length
    for dataset, ids in ((built.train, train_ids), (built.eval, eval_ids)):
        expected = stream(ids)
        assert len(dataset) == -(-(len(expected) - 1) // length)
        for index in range(len(dataset)):
            window = expected[index * length:index * length + length + 1]
            assert torch.equal(dataset[index]["input_ids"], window[:-1])
            assert torch.equal(dataset[index]["shift_labels"], window[1:])


def test_bytes_read_follow_the_files_on_disk_for_plain_and_compressed_inputs(tmp_path):
    import gzip

    from pretrainer.data.readers import BytesRead

    random = np.random.default_rng(0)  # hex noise: the .gz stays large enough to be read in many chunks
    rows = "".join(json.dumps({"text": random.bytes(200).hex()}) + "\n" for i in range(4000))
    plain, packed = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    plain.write_text(rows)
    packed.write_bytes(gzip.compress(rows.encode()))
    meter = BytesRead([plain, packed])
    assert meter.total == plain.stat().st_size + packed.stat().st_size and meter.done == 0
    seen = []
    for number, _ in enumerate(read_documents([plain, packed], meter=meter)):
        if number % 500 == 0:
            seen.append(meter.done)
    assert seen == sorted(seen) and 0 < seen[1] < plain.stat().st_size < seen[-1] < meter.total
    assert meter.done == meter.total
