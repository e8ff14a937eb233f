"""Data mixtures (`train_data` as named, weighted sources; `mixture_schedule`): token shares within 1% of the
weights at every logged step although the sources' documents differ in length by more than 10x, each
source's eval loss, a two-stage schedule, the draws plan and its refusals, and a mid-stage stop resumed on 2
fsdp ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import CORPUS, read_metrics, train_losses
from multi_run import launch_cases
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.data.mixture import blend_index
from pretrainer.data.readers import DataError
from pretrainer.plan.command import plan_for_command
from pretrainer.plan.render import text
from pretrainer.train.report import write_report

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = {"prose": 0.5, "reviews": 0.3, "news": 0.2}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Long English prose (CPython docs over 4,000 characters), short Chinese reviews (under 150), medium
    English pages (300-1,500), as JSONL."""
    root = tmp_path_factory.mktemp("sources")
    docs = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    reviews = [line.strip() for line in (REPO / "examples" / "data" / "zh_reviews.txt").read_text(
        encoding="utf-8").splitlines() if 20 <= len(line.strip()) < 150]
    texts = {"prose": [d for d in docs if len(d) > 4000][:40], "reviews": reviews[:1500],
             "news": [d for d in docs if 300 <= len(d) < 1500][:300]}
    out = {}
    for name, items in texts.items():
        out[name] = root / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in items),
                             encoding="utf-8")
    lengths = {name: np.mean([len(t) for t in items]) for name, items in texts.items()}
    assert lengths["prose"] > 10 * lengths["reviews"]
    return out


def mixture_config(base_config, sources, save_dir, **extra) -> dict:
    """With a `mixture_schedule` in `extra` the stages give the weights, so the sources have none."""
    weighted = "mixture_schedule" not in extra
    return {**base_config, "train_data": [{"name": n, "path": str(sources[n]), **({"weight": w} if weighted else {})}
                                          for n, w in WEIGHTS.items()],
            "num_training_steps": 24, "micro_batch_size": 4, "gradient_accumulation_steps": 4, "eval_interval": 0,
            "save_interval": 0, "export_hf": False, "save_dir": str(save_dir), **extra}


def shares(row: dict) -> dict[str, float]:
    tokens = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("source_tokens/")}
    total = sum(tokens.values())
    return {name: value / total for name, value in tokens.items()}


def test_token_shares_follow_the_weights_at_every_logged_step(base_config, sources, tmp_path):
    """16 windows a step: from step 7 (112 windows) on, every row's cumulative shares are within 1% of
    0.5 / 0.3 / 0.2, where weighting documents instead would give the prose most of the tokens."""
    PreTrainer(PreTrainingArguments(**mixture_config(base_config, sources, tmp_path / "run", eval_interval=12,
                                                     eval_iters=2))).train()
    evals = [row for row in read_metrics(tmp_path / "run") if "eval_loss" in row]
    assert [row["step"] for row in evals] == [12, 24]  # each source's held-out windows evaluated apart too
    assert all(row[f"eval_loss/{n}"] > 0 for row in evals for n in WEIGHTS)
    assert len({round(evals[-1][f"eval_loss/{n}"], 3) for n in WEIGHTS}) == 3
    rows = [row for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert len(rows) == 24 and all(f"source_tokens/{n}" in row for row in rows for n in WEIGHTS)
    for row in rows[6:]:
        for name, share in shares(row).items():
            assert share == pytest.approx(WEIGHTS[name], abs=0.01), (row["step"], name)
    assert sum(v for k, v in rows[-1].items() if k.startswith("source_tokens/")) == rows[-1]["tokens"]
    previous = dict.fromkeys(WEIGHTS, 0)
    for row in rows:  # each source's loss, weighted by its tokens of the step, is the step's loss
        counts = {n: row[f"source_tokens/{n}"] - previous[n] for n in WEIGHTS}
        previous = {n: row[f"source_tokens/{n}"] for n in WEIGHTS}
        mixed = sum(row[f"source_loss/{n}"] * counts[n] for n in WEIGHTS) / sum(counts.values())
        assert mixed == pytest.approx(row["loss"], rel=1e-5), row["step"]
    config = mixture_config(base_config, sources, tmp_path / "run", eval_interval=12, eval_iters=2)
    plan = plan_for_command(PreTrainingArguments(**config), None, None, "cpu", None)  # the stores exist now
    assert plan.data_plan.splitlines()[0].split() == ["source", "tokens", "available", "share", "tokens", "to",
                                                      "draw", "epochs"]
    assert [line.split()[0] for line in plan.data_plan.splitlines()[1:]] == list(WEIGHTS)
    assert "the plan of draws" in text(plan)
    fresh = plan_for_command(PreTrainingArguments(**{**config, "data_cache_path": str(tmp_path / "empty")}), None,
                             None, "cpu", None)
    assert fresh.data_plan.startswith("not tokenized yet: prose, reviews, news")
    page = write_report(tmp_path / "run").read_text()  # tokens per source stacked, eval loss per source
    assert all(title in page for title in ("Tokens trained per source (stacked)", "Train loss per source",
                                           "Eval loss per source"))
    assert (tmp_path / "run" / "report" / "mixture_tokens.svg").is_file()


def test_a_two_stage_schedule_switches_the_shares_at_its_token(base_config, sources, tmp_path):
    """Until 8,192 tokens (16 steps of 512) prose 0.8 / news 0.2; then reviews 0.6 / news 0.4: the tokens
    trained before and after the switch each follow their stage within 1%."""
    config = mixture_config(base_config, sources, tmp_path / "run", num_training_steps=32, mixture_schedule=[
        {"until_tokens": 8192, "weights": {"prose": 0.8, "news": 0.2}},
        {"weights": {"reviews": 0.6, "news": 0.4}}])
    PreTrainer(PreTrainingArguments(**config)).train()
    rows = {row["step"]: row for row in read_metrics(tmp_path / "run") if "loss" in row}
    first = {k: v for k, v in rows[16].items() if k.startswith("source_tokens/")}
    last = {k: rows[32][k] - first[k] for k in first}
    for tokens, weights in ((first, {"prose": 0.8, "news": 0.2}), (last, {"reviews": 0.6, "news": 0.4})):
        total = sum(tokens.values())
        for key, value in tokens.items():
            assert value / total == pytest.approx(weights.get(key.split("/")[1], 0.0), abs=0.01), key


def test_the_blend_keeps_every_source_within_one_sample_of_its_share():
    weights = np.array([0.5, 0.3, 0.2])
    source_of = blend_index([(0, weights)], 5000)
    counts = np.cumsum(np.eye(3)[source_of], axis=0)
    ideal = np.outer(np.arange(1, 5001), weights)
    assert np.abs(counts - ideal).max() <= 1.0
    staged = blend_index([(0, np.array([1.0, 0.0, 0.0])), (100, np.array([0.0, 0.5, 0.5]))], 300)
    assert set(staged[:100]) == {0} and np.bincount(staged[100:], minlength=3).tolist() == [0, 100, 100]


def test_the_plan_is_logged_and_a_source_repeated_past_max_epochs_is_refused(base_config, sources, tmp_path,
                                                                             pretrainer_log):
    config = mixture_config(base_config, sources, tmp_path / "run")
    config["train_data"][2]["max_epochs"] = 0.01
    with pytest.raises(DataError, match=r"train_data source news: the run would read it 0\.\d+ times .*more than "
                                        r"its max_epochs 0\.01; lower its weight"):
        PreTrainer(PreTrainingArguments(**config))
    log = pretrainer_log.take()
    assert "tokens available" in log and "epochs" in log


@pytest.mark.parametrize("train_data, schedule, message", [
    ([{"name": "a", "path": "x", "weight": -1}], None, r"train_data\[0\] \(a\): weight must be a number >= 0"),
    ([{"name": "a", "path": "x", "weight": 0}], None, "weights must be numbers >= 0 with a positive sum"),
    ([{"name": "a", "path": "x"}, {"name": "a", "path": "y"}], None, "source name\\(s\\) a appear more than once"),
    ([{"name": "a", "path": "x"}, "data/b.jsonl"], None, r"train_data\[1\] is 'data/b.jsonl': in a mixture every "
                                                         "source is a mapping"),
    ([{"name": "a", "path": "x"}], [{"weights": {"b": 1}}], "names unknown source\\(s\\) b; the sources are a"),
    ([{"name": "a", "path": "x"}], [{"until_tokens": 100, "weights": {"a": 1}}, {"until_tokens": 50,
                                                                                 "weights": {"a": 1}},
                                    {"weights": {"a": 1}}], "until_tokens must increase"),
    ("data/x.jsonl", [{"weights": {"a": 1}}], "mixture_schedule needs named sources"),
    ([{"name": "a", "path": "x", "eval_path": "y"}], None, "source\\(s\\) a give an eval_path, but eval_data "
                                                          "replaces every source's held-out set"),
    ([{"name": "a", "path": "x", "weight": 1}], [{"weights": {"a": 1}}], "source\\(s\\) a give a weight, but "
                                                                        "mixture_schedule's stages set the weights"),
])
def test_bad_mixtures_are_refused_naming_the_key(base_config, train_data, schedule, message):
    eval_data = {"eval_data": "held.jsonl"} if "eval_path" in message else {}
    with pytest.raises(ConfigError, match=message):
        PreTrainingArguments(**{**base_config, "train_data": train_data, "mixture_schedule": schedule, **eval_data})


def test_a_source_s_own_eval_path_replaces_its_split(base_config, sources, tmp_path):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": "十" * 40}) + "\n" for _ in range(20)), encoding="utf-8")
    config = mixture_config(base_config, sources, tmp_path / "run", num_training_steps=2, eval_interval=2,
                            eval_iters=1)
    config["train_data"][1]["eval_path"] = str(held)
    trainer = PreTrainer(PreTrainingArguments(**config))
    per_document = len(trainer.tokenizer("十" * 40, add_special_tokens=False)["input_ids"]) + 2  # BOS, EOS
    assert trainer.eval_sources["reviews"].dataset.num_tokens == 20 * per_document
    assert len(trainer.train_stream.dataset.sources[1]) * 32 >= 237_502  # no document of reviews held out
    trainer.train()
    assert "eval_loss/reviews" in [row for row in read_metrics(tmp_path / "run") if "eval_loss" in row][-1]


def test_a_source_with_no_tokens_is_named(base_config, sources, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    config = mixture_config(base_config, {**sources, "news": empty}, tmp_path / "run")
    with pytest.raises(DataError, match="train_data source news: .*empty.jsonl holds no tokens to train on"):
        PreTrainer(PreTrainingArguments(**config))


def test_stops_mid_stage_resume_on_1_2_4_ranks_and_tp_accounts_as_one_process(base_config, sources, tmp_path):
    """Stage 1 is the first 8 steps (4,096 tokens of 512). One process stops after step 5 (stage 1); 2 fsdp
    ranks resume it and stop after step 10 (stage 2); 4 ddp ranks finish it. Losses and accounting equal the
    uninterrupted one-process run's (1e-5), as do megatron tp=2's with the vocabulary-parallel chunked head."""
    schedule = [{"until_tokens": 4096, "weights": {"prose": 0.7, "reviews": 0.3}}, {"weights": WEIGHTS}]
    config = mixture_config(base_config, sources, tmp_path / "one", num_training_steps=12, mixture_schedule=schedule,
                            save_interval=5)
    PreTrainer(PreTrainingArguments(**config)).train()
    moved = {**config, "save_dir": str(tmp_path / "moved"), "exit_interval": 5}
    PreTrainer(PreTrainingArguments(**moved)).train()
    launch_cases({**moved, "exit_interval": None}, [
        {"name": "fsdp-to-10", "config": {"engine": "fsdp", "dp": 2, "micro_batch_size": 2, "exit_interval": 10}},
        {"name": "tp2", "config": {"engine": "megatron", "plugin_args": {"tp_degree": 2}, "loss_chunk_size": 24,
                                   "save_dir": str(tmp_path / "tp2")}},
        {"name": "pp2", "config": {"engine": "megatron", "plugin_args": {"pp_degree": 2},
                                   "save_dir": str(tmp_path / "pp2")}}], 2, tmp_path)
    launch_cases({**moved, "exit_interval": None}, [
        {"name": "ddp-4", "config": {"engine": "ddp", "dp": 4, "micro_batch_size": 1}}], 4, tmp_path)
    resumes = [(row["step"], row["world_size"]) for row in read_metrics(tmp_path / "moved")
               if row.get("event") == "resume"]
    assert resumes == [(5, 2), (10, 4)]
    want = train_losses(tmp_path / "one")
    for name in ("moved", "tp2", "pp2"):  # resumed on 2 fsdp ranks; the vocabulary-parallel chunked head
        have = train_losses(tmp_path / name)
        assert sorted(have) == sorted(want)
        assert [have[s] for s in sorted(want)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-5), name
    rows = [row for row in read_metrics(tmp_path / "moved") if "loss" in row]
    reference = [row for row in read_metrics(tmp_path / "one") if "loss" in row]
    tp_rows = [row for row in read_metrics(tmp_path / "tp2") if "loss" in row]
    pp_rows = [row for row in read_metrics(tmp_path / "pp2") if "loss" in row]  # per micro-batch logits
    for got, tp, pp, want in zip(rows, tp_rows, pp_rows, reference):  # no tokens in a row: no loss there
        keys = sorted(k for k in want if k.startswith("source_"))
        for row in (got, tp, pp):
            assert sorted(k for k in row if k.startswith("source_")) == keys
            assert [row[k] for k in keys] == pytest.approx([want[k] for k in keys], rel=1e-5), row["step"]


def test_prepared_prefixes_mix_by_name_and_weight_like_raw_sources(base_config, tmp_path):
    """data_path as named sources (megatron_dataset_flag): two prefixes whose documents are all token 7 and all
    token 9, weights 0.75 / 0.25: every sample holds one prefix's tokens, the shares follow the weights, each
    has its eval loss and the accounting adds up."""
    from pretrainer.data.indexed import IndexedDatasetWriter

    for name, token in (("sevens", 7), ("nines", 9)):
        writer = IndexedDatasetWriter(tmp_path / name, np.uint16)
        for _ in range(40):
            writer.add_document([token] * 60 + [1])
        writer.finalize()
    config = {**base_config, "train_data": None, "megatron_dataset_flag": True, "num_training_steps": 8,
              "micro_batch_size": 4, "gradient_accumulation_steps": 4, "eval_interval": 8, "eval_iters": 1,
              "data_path": [{"name": "sevens", "path": str(tmp_path / "sevens"), "weight": 0.75},
                            {"name": "nines", "path": str(tmp_path / "nines"), "weight": 0.25}],
              "dataloader_config": {"split": "90,10,0"}, "data_cache_path": str(tmp_path / "cache"),
              "save_interval": 0, "export_hf": False, "save_dir": str(tmp_path / "run")}
    plan = plan_for_command(PreTrainingArguments(**config), None, None, "cpu", None)
    windows = (36 * 61 - 1) // 32  # the train part: 36 of 40 documents of 61 tokens, in samples of 32 targets
    assert [line.split()[:2] for line in plan.data_plan.splitlines()[1:]] == [["sevens", f"{windows * 32:,}"],
                                                                            ["nines", f"{windows * 32:,}"]]
    trainer = PreTrainer(PreTrainingArguments(**config))
    samples = [trainer.train_stream.dataset[i]["input_ids"] for i in range(64)]
    assert all(len(set(s.tolist()) - {1}) == 1 for s in samples)  # one prefix per sample
    assert sum(7 in s.tolist() for s in samples) == 48
    trainer.train()
    last = [row for row in read_metrics(tmp_path / "run") if "loss" in row][-1]
    assert last["source_tokens/sevens"] == 3 * last["source_tokens/nines"] == 3 * 32 * 32
    evals = [row for row in read_metrics(tmp_path / "run") if "eval_loss" in row][-1]
    assert evals["eval_loss/sevens"] > 0 and evals["eval_loss/nines"] > 0


def test_a_prepared_mixture_s_mistake_names_data_path(base_config):
    """The error names the key the sources were written under."""
    with pytest.raises(ConfigError, match=r"key 'data_path': data_path: weights must be numbers >= 0 with a "
                                          r"positive sum"):
        PreTrainingArguments(**{**base_config, "train_data": None, "megatron_dataset_flag": True,
                                "data_path": [{"name": "a", "path": "prefix", "weight": 0}]})


def test_a_resume_onto_other_weights_is_refused_and_override_mixture_never_recounts_the_trained_tokens(
        base_config, sources, tmp_path):
    """The blend decides which source each trained sample came from: a resume onto other weights would recount the
    steps already trained over the new blend. Refused before anything is built; with override_mixture the counts
    carry on from the checkpoint's."""
    config = mixture_config(base_config, sources, tmp_path / "run", num_training_steps=4, save_interval=2,
                            exit_interval=2, micro_batch_size=2, gradient_accumulation_steps=1)
    PreTrainer(PreTrainingArguments(**config)).train()
    reweighted = {**config, "exit_interval": None, "train_data": [
        {"name": n, "path": str(sources[n]), "weight": w} for n, w in {"prose": 0.05, "reviews": 0.05,
                                                                        "news": 0.9}.items()]}
    with pytest.raises(ConfigError, match=r"^resuming from .*step-2 would change the run's state: mixture .*\(the "
                                          r"steps already trained would be read from another blend.*set "
                                          r"override_mixture: true to accept\)"):
        PreTrainer(PreTrainingArguments(**reweighted))
    swapped = {**config, "exit_interval": None, "train_data": [
        {"name": n, "path": str(sources[m]), "weight": w} for (n, w), m in zip(WEIGHTS.items(), ["news", "reviews",
                                                                                                 "prose"])]}
    with pytest.raises(ConfigError, match=r"would change the run's state: sources .*prose.*news\.jsonl.*set "
                                          r"override_mixture: true"):
        PreTrainer(PreTrainingArguments(**swapped))  # the same names and weights over other files
    PreTrainer(PreTrainingArguments(**{**reweighted, "override_mixture": True})).train()
    rows = {row["step"]: row for row in read_metrics(tmp_path / "run") if "loss" in row}
    counts = {step: {k: v for k, v in row.items() if k.startswith("source_tokens/")} for step, row in rows.items()}
    assert sorted(counts) == [1, 2, 3, 4]
    for earlier, later in zip([1, 2, 3], [2, 3, 4]):
        assert all(counts[later][name] >= counts[earlier][name] for name in counts[earlier]), (earlier, counts)
    assert all(sum(counts[step].values()) == rows[step]["tokens"] for step in rows)  # the run's own count
