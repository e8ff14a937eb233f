"""Downstream evaluation: in-loop multiple-choice scores against an independent scoring with transformers,
and bad task files."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import fast_config
from helpers import TASK_RECORDS, read_metrics, write_task
from launch import pretrainer, run, run_ok
from pretrainer import DataError, PreTrainer, PreTrainingArguments


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


@dataclass
class TrainedRun:
    save_dir: Path
    task: str
    rows: list[dict]       # metrics.jsonl rows with the task's scores
    expected: dict         # the independent scoring of the run's export


@pytest.fixture(scope="module")
def trained(tiny_model, small_corpus, tmp_path_factory) -> dict[int, TrainedRun]:
    """The fast test run with the task scored at steps 3 and 6, with the plain head and with a chunked loss
    head (loss_chunk_size 16: the head hands back per-token losses in chunks)."""
    runs = {}
    for loss_chunk_size in (0, 16):
        root = tmp_path_factory.mktemp(f"downstream-chunk{loss_chunk_size}")
        task = write_task(root / "tiny_task.jsonl", TASK_RECORDS)
        config = {**fast_config(tiny_model, small_corpus, root / "run"), "downstream_evals": [task],
                  "micro_batch_size": 1, "loss_chunk_size": loss_chunk_size}  # micro-batch 1: small scoring batches
        with PreTrainer(PreTrainingArguments.from_dict(config)) as trainer:
            trainer.train()
        rows = [r for r in read_metrics(root / "run") if "eval/tiny_task/acc" in r]
        runs[loss_chunk_size] = TrainedRun(root / "run", task, rows, independent_scores(root / "run" / "hf",
                                                                                         TASK_RECORDS))
    return runs


@pytest.mark.parametrize("loss_chunk_size", [0, 16])
def test_in_loop_scores_equal_an_independent_scoring_of_the_export(trained, loss_chunk_size):
    done = trained[loss_chunk_size]
    assert [r["step"] for r in done.rows] == [3, 6]
    for key, value in done.expected.items():
        assert done.rows[-1][f"eval/tiny_task/{key}"] == pytest.approx(value, abs=1e-6), key
    assert done.rows[0]["eval/tiny_task/bpb"] != done.rows[-1]["eval/tiny_task/bpb"]  # the model changed


def test_the_report_charts_each_task_against_tokens(trained):
    from pretrainer.train.report import write_report

    done = trained[0]
    page = write_report(done.save_dir).read_text()
    chart = (done.save_dir / "report" / "downstream_tiny_task.svg").read_text()
    assert "Downstream: tiny_task" in chart and "tokens trained on" in chart and chart.count("<polyline") == 2
    assert page.count("<svg") == 6
    assert f"tiny_task at step 6: acc / acc_norm / bpb</th><td>{done.rows[-1]['eval/tiny_task/acc']:.4f} / " in page


def test_evaluate_scores_a_checkpoint_and_an_export_as_the_loop_did(trained, tmp_path):
    """`pretrainer evaluate SAVE_DIR` rebuilds the model from its newest checkpoint's config.yaml; an HF folder
    is read as it is."""
    from pretrainer.train.offline import evaluate

    done = trained[0]
    out = tmp_path / "scores.json"
    shown = run_ok(pretrainer("evaluate", done.save_dir, "--tasks", done.task, "--output", out))
    assert "tiny_task: acc " in shown.stdout and "(4 records)" in shown.stdout
    for scores in (json.loads(out.read_text()),
                   evaluate(done.save_dir / "hf", [done.task], ["dtype=fp32", "seq_length=32", "micro_batch_size=1"])):
        assert scores["tiny_task"]["records"] == 4
        for key, value in done.expected.items():
            assert scores["tiny_task"][key] == pytest.approx(value, abs=1e-6), key


HARNESS_TASKS = {
    "tiny_mc": {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{gold}}", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]},
    "tiny_text": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                  "metric_list": [{"metric": "bits_per_byte"}]},
}


def test_lm_eval_harness_runs_its_tasks_on_a_checkpoint(trained, small_corpus, tmp_path, monkeypatch):
    """lm-evaluation-harness with `--model pretrainer` on the run's save_dir: its multiple-choice accuracy is
    the loop's; its rolling log-likelihood (windows of seq_length) is that of transformers on the export."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from pretrainer.train.harness import PretrainerLM

    done = trained[0]
    texts = [json.loads(line)["text"][:400] for line in small_corpus.read_text().splitlines()[:3]]
    text_file = write_task(tmp_path / "texts.jsonl", [{"text": t} for t in texts])
    for name, spec in HARNESS_TASKS.items():
        data = done.task if name == "tiny_mc" else text_file
        (tmp_path / f"{name}.yaml").write_text(json.dumps({"task": name, "dataset_path": "json", "test_split": "test",
                                                           "dataset_kwargs": {"data_files": {"test": data}}, **spec}))
    model = PretrainerLM(path=str(done.save_dir))
    results = lm_eval.simple_evaluate(model=model, tasks=list(HARNESS_TASKS), task_manager=TaskManager(
        include_path=str(tmp_path)), bootstrap_iters=0)["results"]
    assert results["tiny_mc"]["acc,none"] == pytest.approx(done.expected["acc"], abs=1e-9)
    assert results["tiny_mc"]["acc_norm,none"] == pytest.approx(done.expected["acc_norm"], abs=1e-9)
    expected_bits = sum(rolling_loglikelihood(done.save_dir / "hf", t, window=32) for t in texts) / -math.log(2)
    total_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert results["tiny_text"]["bits_per_byte,none"] == pytest.approx(expected_bits / total_bytes, rel=1e-6)
    with pytest.raises(NotImplementedError, match="--model hf"):
        model.generate_until([])


def rolling_loglikelihood(hf_folder, text: str, window: int) -> float:
    """A text's log-likelihood with transformers, after the BOS: `window` tokens predicted at a time, each
    window's inputs the `window` tokens before its targets (the last, shorter one keeps a full window)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_folder)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, torch_dtype=torch.float32).eval()
    ids = [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]
    total = 0.0
    for first in range(1, len(ids), window):  # ids[first:end] are predicted
        end = min(first + window, len(ids))
        inputs = torch.tensor([ids[max(0, end - 1 - window):end - 1]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(inputs).logits[0, -(end - first):].double(), dim=-1)
        total += float(logprobs.gather(1, torch.tensor(ids[first:end])[:, None]).sum())
    return total


@pytest.mark.parametrize("record, message", [
    ({"context": "a", "choices": ["b", "c"], "gold": 2}, "gold index 2 (field 'gold') is out of range"),
    ({"context": "a", "choices": ["b", "c"]}, "missing field 'gold'"),
    ({"context": "a", "choices": ["b"], "gold": 0}, "field 'choices' must list at least two strings"),
])
def test_a_bad_task_record_names_its_file_and_line(base_config, tmp_path, record, message):
    task = write_task(tmp_path / "bad.jsonl", [TASK_RECORDS[0], record])
    with pytest.raises(DataError, match=re.escape(f"bad.jsonl:2: {message}")):
        PreTrainer(PreTrainingArguments.from_dict({**base_config, "downstream_evals": [task]}))


def test_evaluate_names_a_bad_task_file_and_exits_2(tiny_model, tmp_path):
    bad = write_task(tmp_path / "bad.jsonl", [TASK_RECORDS[0], {"context": "a", "choices": ["b", "c"], "gold": 5}])
    done = run(pretrainer("evaluate", tiny_model, "--tasks", bad, "dtype=fp32", "seq_length=32"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == \
        f"pretrainer: error: {bad}:2: gold index 5 (field 'gold') is out of range for 2 choices (choices task record)"
    nothing = run(pretrainer("evaluate", tmp_path, "--tasks", bad))
    assert nothing.returncode == 2
    assert "neither a run's save_dir (with checkpoints/) nor an HF model folder (with config.json)" in nothing.stderr


def test_an_empty_task_file_is_an_error(base_config, tmp_path):
    task = write_task(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="empty.jsonl: no records to score"):
        PreTrainer(PreTrainingArguments.from_dict({**base_config, "downstream_evals": [task]}))
