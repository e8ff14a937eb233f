"""Downstream evaluation: in-loop multiple-choice scores against an independent scoring with transformers,
and bad task files."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from helpers import read_metrics
from pretrainer import DataError, PreTrainer, PreTrainingArguments

RECORDS = [
    {"context": "def f(x):", "choices": ["return x + 1", "print the", "import os"], "gold": 0},
    {"context": "The for statement", "choices": ["is used to iterate", "banana split", "x = 2"], "gold": 0},
    {"context": "Return the", "choices": ["value of x ", "the the the", "list"], "gold": 2},
    {"context": "", "choices": ["A module is a file", "zzz"], "gold": 0},
]


def write_task(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def independent_scores(hf_folder, records) -> dict:
    """acc, acc_norm and bpb with transformers alone: each choice forwarded on its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_folder)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, torch_dtype=torch.float32).eval()
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    acc = acc_norm = bpb = 0.0
    for record in records:
        scores = []
        for choice in record["choices"]:
            whole = tok.encode(record["context"] + " " + choice, add_special_tokens=False)
            context = tok.encode(record["context"], add_special_tokens=False) if record["context"] else []
            ids = torch.tensor([[prefix, *whole]])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
            start = 1 + len(context)
            targets = ids[0, start:]
            scores.append(float(logprobs[start - 1:].gather(1, targets[:, None]).sum()))
        gold = record["gold"]
        acc += max(range(len(scores)), key=lambda i: (scores[i], -i)) == gold
        normed = [s / len(c) for s, c in zip(scores, record["choices"])]
        acc_norm += max(range(len(normed)), key=lambda i: (normed[i], -i)) == gold
        bpb += -scores[gold] / (math.log(2) * len(record["choices"][gold].encode()))
    n = len(records)
    return {"acc": acc / n, "acc_norm": acc_norm / n, "bpb": bpb / n}


@pytest.mark.parametrize("loss_chunk_size", [0, 16])  # 16: the head hands back per-token losses in chunks
def test_in_loop_scores_equal_an_independent_scoring_of_the_export(base_config, tmp_path, loss_chunk_size):
    task = write_task(tmp_path / "tiny_task.jsonl", RECORDS)
    config = {**base_config, "downstream_evals": [task], "micro_batch_size": 1,  # small scoring batches
              "loss_chunk_size": loss_chunk_size}
    with PreTrainer(PreTrainingArguments.from_dict(config)) as trainer:
        trainer.train()
    rows = [r for r in read_metrics(config["save_dir"]) if "eval/tiny_task/acc" in r]
    assert [r["step"] for r in rows] == [3, 6]
    expected = independent_scores(tmp_path / "run" / "hf", RECORDS)
    for key, value in expected.items():
        assert rows[-1][f"eval/tiny_task/{key}"] == pytest.approx(value, abs=1e-6), key
    assert rows[0]["eval/tiny_task/bpb"] != rows[-1]["eval/tiny_task/bpb"]  # the model changed in between


@pytest.mark.parametrize("record, message", [
    ({"context": "a", "choices": ["b", "c"], "gold": 2}, "gold index 2 (field 'gold') is out of range"),
    ({"context": "a", "choices": ["b", "c"]}, "missing field 'gold'"),
    ({"context": "a", "choices": ["b"], "gold": 0}, "field 'choices' must list at least two strings"),
])
def test_a_bad_task_record_names_its_file_and_line(base_config, tmp_path, record, message):
    task = write_task(tmp_path / "bad.jsonl", [RECORDS[0], record])
    with pytest.raises(DataError, match=re.escape(f"bad.jsonl:2: {message}")):
        PreTrainer(PreTrainingArguments.from_dict({**base_config, "downstream_evals": [task]}))


def test_an_empty_task_file_is_an_error(base_config, tmp_path):
    task = write_task(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="empty.jsonl: no records to score"):
        PreTrainer(PreTrainingArguments.from_dict({**base_config, "downstream_evals": [task]}))
