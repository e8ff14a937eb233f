"""GPT-style samples over prepared data: index correctness against a plain reference, caching, blending,
weight-list errors, document masking, and training from a blend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import assert_resume_reproduces
from pretrainer import DataError
from pretrainer.data import (
    BlendedSamples,
    DocumentMasking,
    GPTSamples,
    IndexCache,
    document_position_ids,
    parse_data_path,
)
from pretrainer.data.indexed import IndexedDataset, IndexedDatasetWriter


def write_prefix(folder, documents, name="d"):
    writer = IndexedDatasetWriter(folder / name, np.uint16)
    for doc in documents:
        writer.add_document(doc)
    writer.finalize()
    return IndexedDataset(folder / name)


def reference_samples(documents, seq_length, num_samples, seed):
    """The definition, in plain Python: epochs of seeded document orders, concatenated; sample k is
    tokens [kS, kS + S + 1); samples starting in epoch e are shuffled among themselves by (seed, e, 1)."""
    tokens_per_epoch = sum(len(d) for d in documents)
    stream, epoch = [], 0
    while len(stream) < num_samples * seq_length + tokens_per_epoch + seq_length + 1:
        for doc in np.random.default_rng([seed, epoch]).permutation(len(documents)):
            stream.extend(documents[doc])
        epoch += 1
    order, epoch = [], 0
    while len(order) < num_samples:
        lo, hi = -(-epoch * tokens_per_epoch // seq_length), -(-(epoch + 1) * tokens_per_epoch // seq_length)
        order.extend(lo + np.random.default_rng([seed, epoch, 1]).permutation(hi - lo))
        epoch += 1
    return [stream[k * seq_length:k * seq_length + seq_length + 1] for k in order[:num_samples]]


@pytest.mark.parametrize("seq_length,num_samples", [(7, 40), (5, 3), (50, 9)])  # 50 > tokens per epoch
def test_samples_match_the_plain_definition(tmp_path, seq_length, num_samples):
    rng = np.random.default_rng(0)
    documents = [list(rng.integers(3, 900, size=n)) for n in (5, 0, 13, 1, 8, 21, 2)]  # includes an empty one
    dataset = write_prefix(tmp_path, documents)
    samples = GPTSamples(dataset, (0, len(documents)), seq_length, num_samples, 11, IndexCache(tmp_path / "c"))
    expected = reference_samples(documents, seq_length, num_samples, 11)
    assert [samples.tokens(i).tolist() for i in range(num_samples)] == expected
    item = samples[0]
    assert item["input_ids"].tolist() == expected[0][:-1] and item["shift_labels"].tolist() == expected[0][1:]


def test_index_is_cached_memory_mapped_and_stable_when_extended(tmp_path):
    documents = [list(range(i, i + 3 + i % 5)) for i in range(30)]
    dataset = write_prefix(tmp_path, documents)
    cache = IndexCache(tmp_path / "cache")
    first = GPTSamples(dataset, (3, 30), 8, 50, 1, cache)
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len([f for f in files if f.endswith(".npy")]) == 3
    again = GPTSamples(dataset, (3, 30), 8, 50, 1, cache)
    assert isinstance(again.sample_order, np.memmap) and sorted(p.name for p in (tmp_path / "cache").iterdir()) == files
    longer = GPTSamples(dataset, (3, 30), 8, 400, 1, cache)  # a longer run: more epochs, same first samples
    assert [longer.tokens(i).tolist() for i in range(50)] == [first.tokens(i).tolist() for i in range(50)]
    other_seed = GPTSamples(dataset, (3, 30), 8, 50, 2, cache)
    assert [other_seed.tokens(i).tolist() for i in range(50)] != [first.tokens(i).tolist() for i in range(50)]


def test_empty_split_is_a_clear_error(tmp_path):
    dataset = write_prefix(tmp_path, [[1, 2, 3], [4, 5]])
    with pytest.raises(DataError, match=r"valid split, documents 2\.\.2\).*cannot give any sample"):
        GPTSamples(dataset, (2, 2), 4, 10, 0, IndexCache(tmp_path / "c"), "valid")


def test_blend_follows_the_weights_at_every_prefix(tmp_path):
    parts = [write_prefix(tmp_path, [[d * 100 + i for i in range(40)]] * 5, name=f"p{d}") for d in range(3)]
    weights = [0.5, 0.3, 0.2]
    cache = IndexCache(tmp_path / "c")
    samples = [GPTSamples(p, (0, 5), 4, 200, 0, cache, "train") for p in parts]
    blend = BlendedSamples(samples, [5, 3, 2], 300, cache, "train", {"test": 1})
    owners = np.asarray(blend.dataset_index)
    for n in range(1, 301):
        counts = np.bincount(owners[:n], minlength=3)
        assert np.all(np.abs(counts - n * np.asarray(weights)) <= 1.0), (n, counts)
    assert blend[0]["input_ids"][0].item() // 100 == owners[0]
    # each dataset's samples are used in order, none twice
    for d in range(3):
        used = np.asarray(blend.dataset_sample_index)[owners == d]
        assert used.tolist() == list(range(len(used)))


@pytest.mark.parametrize("raw,message", [
    ("0.7 a 0.3", "alternates weight and prefix"),
    (["a", "0.5", "b", "0.5"], "alternates weight and prefix"),
    ("0.5 a x b", "alternates weight and prefix"),
    ("0 a 0 b", "positive sum"),
    ("", "empty"),
])
def test_weight_lists_of_the_wrong_shape_are_clear_errors(raw, message):
    with pytest.raises(DataError, match=message):
        parse_data_path(raw)


def test_data_path_forms():
    assert parse_data_path("0.7 web 0.3 code") == (["web", "code"], [0.7, 0.3])
    assert parse_data_path([1, "web", 2, "code"]) == (["web", "code"], [1.0, 2.0])
    assert parse_data_path("web") == (["web"], None)
    assert parse_data_path(["web", "code"]) == (["web", "code"], None)


def test_position_ids_restart_after_each_eos():
    ids = torch.tensor([[5, 6, 1, 7, 8, 9, 1, 4], [1, 1, 3, 3, 3, 3, 3, 3]])
    assert document_position_ids(ids, eod_token_id=1).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0],
                                                                   [0, 0, 0, 1, 2, 3, 4, 5]]


def test_document_attention_masking_equals_separate_documents(tiny_model):
    """With reset_attention_mask, a packed window's logits equal each document run on its own; with
    positions reset alone, the second document still sees the first (different logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pretrainer.batch import forward_head  # the training forward (no KV cache)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model)).eval()
    first, second = [0, 50, 60, 70, 1], [0, 80, 90, 1]
    window = torch.tensor([first + second])
    with torch.no_grad():
        def logits(batch: dict) -> torch.Tensor:
            return forward_head(model, batch, takes_call=False).logits[0]

        alone = [logits({"input_ids": torch.tensor([d])}) for d in (first, second)]
        masked = logits(DocumentMasking(1, attention=True).apply({"input_ids": window}))
        positions_only = logits(DocumentMasking(1, attention=False).apply({"input_ids": window}))
    torch.testing.assert_close(masked, torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(positions_only[len(first):], alone[1], atol=1e-4)


def test_training_from_a_weighted_blend_with_document_masking_resumes_exactly(base_config, tmp_path):
    tokens = np.random.default_rng(3).integers(3, 4000, size=6000)
    prefixes = []
    for name, chunk in (("web", tokens[:4000]), ("code", tokens[4000:])):
        dataset_docs = [list(c) + [1] for c in np.array_split(chunk, 40)]
        write_prefix(tmp_path, dataset_docs, name)
        prefixes.append(str(tmp_path / name))
    config = {**base_config, "train_data": None, "megatron_dataset_flag": True,
              "data_path": f"0.7 {prefixes[0]} 0.3 {prefixes[1]}", "dataloader_config": {"split": "90,10,0"},
              "reset_position_ids": True, "reset_attention_mask": True}
    assert_resume_reproduces(config, tmp_path)
    assert len(list((tmp_path / "cache" / "pretrainer_indices").glob("*-train-blend-dataset_index.npy"))) == 1


def test_a_zero_weight_prefix_is_left_out_of_the_blend(base_config, tmp_path):
    from pretrainer import PreTrainingArguments
    from pretrainer.config import BatchSizes
    from pretrainer.data import build_indexed_datasets

    write_prefix(tmp_path, [[7] * 500 + [1]], "a")  # one document: all of it in the train part
    write_prefix(tmp_path, [[9] * 50 + [1]] * 10, "b")
    args = PreTrainingArguments(**{**base_config, "train_data": None, "megatron_dataset_flag": True,
                                   "data_path": f"1 {tmp_path / 'a'} 0 {tmp_path / 'b'}",
                                   "dataloader_config": {"split": "60,40,0"}})
    data = build_indexed_datasets(args, BatchSizes.of(args, args.seq_length, 1))
    assert data.eval is None  # only b, weight 0, has validation documents: no blend of nothing
    assert len(data.train) == 6 * 2 * 2
    assert all(set(data.train[i]["input_ids"].tolist()) <= {7, 1} for i in range(len(data.train)))
