"""A model trained with a tokenizer larger than its vocabulary (an extended one): the embedding and head
grow before any engine shards them, new rows start by `new_token_init`, `trainable_parameters` freezes the
rest, every engine gives the same losses, resume and export work, and a tokenizer that is not an extension
is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import CORPUS, ZH_REVIEWS, assert_resume_reproduces, train_losses, write_tiny_model
from multi_run import launch_cases
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.models import build_model, preflight

ADDED = 150  # new tokens: 4,096 + 150 = 4,246, padded to 4,288 rows (a multiple of 64)


@pytest.fixture(scope="module")
def grown(tmp_path_factory) -> dict:
    """A 2-layer Llama with saved weights and the quickstart byte-level tokenizer, that tokenizer extended
    with Chinese tokens, and a corpus of English and Chinese documents."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pretrainer.vocab.corpus import Corpus
    from pretrainer.vocab.extend import extend_tokenizer

    root = tmp_path_factory.mktemp("growth")
    config_folder = write_tiny_model(root / "config")
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_folder)).save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(config_folder).save_pretrained(root / "model")
    extend_tokenizer(root / "model", root / "extended", ADDED, corpus=Corpus([str(ZH_REVIEWS)]))
    english = CORPUS.read_text(encoding="utf-8").splitlines()[:60]
    chinese = [json.dumps({"text": line}, ensure_ascii=False)
               for line in ZH_REVIEWS.read_text(encoding="utf-8").splitlines()[:150]]
    corpus = root / "mixed.jsonl"
    corpus.write_text("\n".join(line for pair in zip(chinese[::2], chinese[1::2], english) for line in pair) + "\n",
                      encoding="utf-8")
    config = {"num_training_steps": 6, "micro_batch_size": 2, "dp": 2, "gradient_accumulation_steps": 2,
              "seq_length": 32, "dtype": "fp32", "model_path": str(root / "model"),
              "tokenizer_path": str(root / "extended"), "train_data": str(corpus), "lr": 1e-3, "warmup_steps": 2,
              "eval_interval": 3, "eval_iters": 2, "save_interval": 3, "seed": 7, "write_report": False,
              "trainable_parameters": "embeddings", "adam_eps": 1e-6}
    return {"root": root, "config": config}


def built(config: dict, **overrides):
    args = PreTrainingArguments(**{**config, "dp": 1, **overrides})
    spec = preflight(args)
    return build_model(args, spec), spec


def test_the_vocabulary_grows_padded_and_new_rows_start_from_their_pieces(grown):
    from transformers import AutoTokenizer

    saved = load_file(grown["root"] / "model" / "model.safetensors")
    model, spec = built(grown["config"])
    embed, head = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    assert embed.shape[0] == head.shape[0] == model.config.vocab_size == 4288
    assert torch.equal(embed[:4096], saved["model.embed_tokens.weight"])  # old rows untouched
    assert torch.equal(head[:4096], saved["lm_head.weight"])
    base, extended = AutoTokenizer.from_pretrained(grown["root"] / "model"), spec.tokenizer
    whole = [i for i in range(4096, 4096 + ADDED) if "\ufffd" not in extended.decode([i])]
    assert whole, "no new token is a whole character"
    for token_id in whole[:20]:  # a new token = the mean of the rows of the pieces it replaces
        pieces = base(extended.decode([token_id]), add_special_tokens=False)["input_ids"]
        assert torch.allclose(embed[token_id], saved["model.embed_tokens.weight"][pieces].mean(0), atol=1e-6)
        assert torch.allclose(head[token_id], saved["lm_head.weight"][pieces].mean(0), atol=1e-6)
    assert torch.allclose(embed[4096 + ADDED:], saved["model.embed_tokens.weight"].mean(0).expand(42, -1))

    mean_model, _ = built(grown["config"], new_token_init="mean")
    rows = mean_model.get_input_embeddings().weight.detach()[4096:4096 + ADDED]
    old_mean = saved["model.embed_tokens.weight"].mean(0)
    assert torch.allclose(rows, old_mean.expand_as(rows), atol=1e-3) and not torch.equal(rows[0], rows[1])
    normal, _ = built(grown["config"], new_token_init="normal")
    again, _ = built(grown["config"], new_token_init="normal")
    rows = normal.get_input_embeddings().weight.detach()[4096:4096 + ADDED]
    assert rows.std().item() == pytest.approx(0.02, rel=0.15)  # the config's initializer_range
    assert torch.equal(rows, again.get_input_embeddings().weight.detach()[4096:4096 + ADDED])  # seeded


@pytest.mark.parametrize("method", ["subtoken_mean", "mean", "normal"])
def test_an_engine_reading_slices_grows_the_same_rows_as_a_whole_load(grown, method):
    from pretrainer.models import materialize

    whole, _ = built(grown["config"], new_token_init=method)
    args = PreTrainingArguments(**{**grown["config"], "dp": 1, "new_token_init": method})
    sliced = build_model(args, preflight(args), read_slices=True)
    materialize(sliced, torch.device("cpu"), seed=1)
    theirs, ours = whole.state_dict(), sliced.state_dict()
    assert ours.keys() == theirs.keys() and ours["lm_head.weight"].shape[0] == 4288
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), method


def test_a_tokenizer_that_is_not_an_extension_is_refused_unless_allowed(grown, tmp_path):
    from pretrainer.vocab.corpus import Corpus
    from pretrainer.vocab.train import train_tokenizer

    other = train_tokenizer(Corpus([str(CORPUS)]), 4200, tmp_path / "other").folder
    config = {**grown["config"], "tokenizer_path": str(other)}
    with pytest.raises(ConfigError, match=r"is not an extension of the model's .*: [\d,]+ of the model tokenizer's "
                                          r"4,096 tokens have another id or none .*pretrainer tokenizer extend"):
        built(config)
    model, _ = built(config, allow_tokenizer_mismatch=True)
    assert model.config.vocab_size == 4224
    with pytest.raises(ConfigError, match="trainable_parameters: pattern 'decoder.*' matches no parameter"):
        PreTrainer(PreTrainingArguments(**{**grown["config"], "dp": 1, "trainable_parameters": ["decoder.*"],
                                           "save_dir": str(tmp_path / "x")}))
    with pytest.raises(ConfigError, match="new_token_init 'zeros' is not one of subtoken_mean, mean, normal"):
        PreTrainingArguments(**{**grown["config"], "new_token_init": "zeros"})


@pytest.fixture(scope="module")
def single_run(grown) -> Path:
    save_dir = grown["root"] / "single"
    PreTrainer(PreTrainingArguments(**{**grown["config"], "dp": 1, "micro_batch_size": 4,
                                       "save_dir": str(save_dir)})).train()
    return save_dir


def test_embeddings_only_training_changes_only_them_and_the_export_loads_and_generates(grown, single_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = load_file(grown["root"] / "model" / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(single_run / "hf")
    tokenizer = AutoTokenizer.from_pretrained(single_run / "hf")
    assert len(tokenizer) == 4096 + ADDED and model.config.vocab_size == 4288
    for name, tensor in model.state_dict().items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert not torch.equal(tensor[:4096], start[name])
        else:
            assert torch.equal(tensor, start[name]), name
    prompt = tokenizer("这本书", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4


def test_resume_of_a_grown_embeddings_only_run_reproduces_it(grown, tmp_path):
    assert_resume_reproduces({**grown["config"], "dp": 1, "micro_batch_size": 4, "export_hf": False}, tmp_path)


def test_every_engine_grows_the_vocabulary_and_trains_the_same(grown, single_run):
    root = grown["root"]
    (root / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    cases = [{"name": "fsdp", "config": {"engine": "fsdp", "save_dir": str(root / "fsdp")}},
             {"name": "zero3", "config": {"deepspeed": str(root / "zero3.json"), "save_dir": str(root / "zero3")}},
             {"name": "ddp", "config": {"engine": "ddp", "save_dir": str(root / "ddp")}},
             {"name": "megatron-tp2", "config": {"engine": "megatron", "dp": 1, "micro_batch_size": 4,
                                                 "plugin_args": {"tp_degree": 2}, "save_dir": str(root / "tp2")}},
             {"name": "megatron-pp2", "config": {"engine": "megatron", "dp": 1, "micro_batch_size": 4,
                                                 "plugin_args": {"pp_degree": 2}, "save_dir": str(root / "pp2")}}]
    launch_cases({**grown["config"], "export_hf": False}, cases, 2, root)
    want = train_losses(single_run)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    for name in ("fsdp", "zero3", "ddp", "tp2", "pp2"):
        have = train_losses(root / name)
        assert [have[s] for s in sorted(want)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-5), name


def test_a_random_init_model_is_built_with_the_grown_vocabulary_and_exports_the_sentencepiece_model(tmp_path):
    """A Llama-2-style SentencePiece tokenizer extended for Chinese; the model is a config.json (random init),
    so it is built at the grown size directly; the export holds tokenizer.model, as slow tokenizers need."""
    from transformers import AutoConfig, AutoTokenizer

    from pretrainer.vocab.corpus import Corpus
    from pretrainer.vocab.extend import extend_tokenizer
    from pretrainer.vocab.train import train_tokenizer

    english = tmp_path / "en.jsonl"
    english.write_text("".join(CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)[:600]))
    model = write_tiny_model(tmp_path / "model", vocab_size=1500, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the quickstart's, replaced by a SentencePiece one
        (model / name).unlink()
    train_tokenizer(Corpus([str(english)]), 1500, model, byte_fallback=True)
    extend_tokenizer(model, tmp_path / "extended", 300, corpus=Corpus([str(ZH_REVIEWS)]))
    save_dir = tmp_path / "run"
    PreTrainer(PreTrainingArguments(
        num_training_steps=2, micro_batch_size=2, dp=1, seq_length=32, dtype="fp32", model_path=str(model),
        tokenizer_path=str(tmp_path / "extended"), train_data=str(ZH_REVIEWS), eval_split=0, write_report=False,
        save_dir=str(save_dir))).train()
    assert AutoConfig.from_pretrained(save_dir / "hf").vocab_size == 1856  # 1,800 tokens padded to 64
    exported = (save_dir / "hf" / "tokenizer.model").read_bytes()
    assert exported == (tmp_path / "extended" / "tokenizer.model").read_bytes()
    assert len(AutoTokenizer.from_pretrained(save_dir / "hf")) == 1800
