"""`pretrainer tokenizer train`: a tokenizer learned from a corpus, written as an HF folder.

Two families, the ones Llama-family models ship:
- `--type bpe` (default): a byte-level BPE (`tokenizers`; Llama-3, Qwen): every text is representable, no unknown token;
- `--type bpe --byte-fallback` and `--type unigram`: a SentencePiece model trained with `sentencepiece` and Llama-2's
  settings (digits split, whitespace kept, byte fallback), written as `tokenizer.model` plus the `tokenizer.json` that
  transformers converts from it, so slow and fast tokenizers both load it.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

from ..data.readers import DataError
from .corpus import Corpus

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
KINDS = ("bpe", "unigram")
PRINTABLE_ASCII = "".join(chr(c) for c in range(0x21, 0x7F))  # always whole pieces, however rare in the corpus


@dataclass
class TrainedTokenizer:
    folder: Path
    vocab_size: int
    kind: str  # "byte-level BPE" | "SentencePiece BPE" | "SentencePiece unigram"


def train_tokenizer(corpus: Corpus, vocab_size: int, output: Path, kind: str = "bpe", byte_fallback: bool = False,
                    workers: int = 1) -> TrainedTokenizer:
    if kind not in KINDS:
        raise DataError(f"--type {kind!r}: choose one of {', '.join(KINDS)}")
    if vocab_size < 300:
        raise DataError(f"--vocab-size {vocab_size}: give at least 300 (256 byte tokens and the special tokens "
                        "come first)")
    output.mkdir(parents=True, exist_ok=True)
    if kind == "bpe" and not byte_fallback:
        return _train_byte_level(corpus, vocab_size, output)
    return _train_sentencepiece(corpus, vocab_size, output, kind, byte_fallback, workers)


def _train_byte_level(corpus: Corpus, vocab_size: int, output: Path) -> TrainedTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus.documents("learning merges"), trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                             special_tokens=[(BOS, bos)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS).save_pretrained(output)
    return TrainedTokenizer(output, tokenizer.get_vocab_size(), "byte-level BPE")


def _train_sentencepiece(corpus: Corpus, vocab_size: int, output: Path, kind: str, byte_fallback: bool,
                         workers: int) -> TrainedTokenizer:
    model = sentencepiece_model(
        corpus, "reading", "train on", workers, vocab_size=vocab_size, model_type=kind, byte_fallback=byte_fallback,
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, required_chars=PRINTABLE_ASCII)
    (output / "tokenizer.model").write_bytes(model)
    # Llama-2's tokenizer_config.json: BOS added in front, no EOS, the slow class named
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
              "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False, "legacy": False}
    (output / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    size = convert_sentencepiece(output)
    return TrainedTokenizer(output, size, f"SentencePiece {kind.upper() if kind == 'bpe' else kind}")


def sentencepiece_model(corpus: Corpus, description: str, verb: str, workers: int, **options) -> bytes:
    """A SentencePiece model trained on the corpus's lines with `options` and the settings both commands share."""
    sentencepiece = import_sentencepiece()
    model = io.BytesIO()  # handed back, not written by sentencepiece, whose writer does not report a failed write
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=corpus.lines(description), model_writer=model, character_coverage=0.9995, pad_id=-1,
            num_threads=max(1, workers), max_sentence_length=16384, input_sentence_size=5_000_000,
            shuffle_input_sentence=True, minloglevel=2, **options)
    except RuntimeError as exc:  # e.g. a vocabulary larger than the corpus can fill
        raise DataError(f"sentencepiece could not {verb} {', '.join(map(str, corpus.files))}: {exc}") from None
    return model.getvalue()


def convert_sentencepiece(folder: Path) -> int:
    """Write `tokenizer.json` from the folder's `tokenizer.model` with transformers' own conversion (what a
    fast tokenizer built from the model would be); returns the vocabulary size."""
    from transformers import AutoTokenizer

    (folder / "tokenizer.json").unlink(missing_ok=True)  # else transformers reads it instead of converting
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    return len(tokenizer)


def import_sentencepiece():
    try:
        import sentencepiece
    except ImportError:
        raise DataError("SentencePiece tokenizers (--byte-fallback, --type unigram, tokenizer.model files) need "
                        "the sentencepiece package: pip install sentencepiece (or pip install "
                        "'pretrainer[tokenizer]')") from None
    return sentencepiece
