"""`pretrainer tokenizer extend`: new tokens learned on a corpus (or taken from another tokenizer), appended to a base
tokenizer (a SentencePiece BPE `tokenizer.model` or a byte-level BPE `tokenizer.json`) so that every base token keeps
its id; docs/new-language.md, 'Extend a tokenizer'.

A candidate is kept only if it holds a character of a target script (see `scripts`), is not a base token, and can be
built from tokens already kept, so text without target-script characters tokenizes exactly as before.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from pathlib import Path

from ..data.readers import DataError
from .corpus import Corpus
from .scripts import detect_target_scripts, holds_target_char
from .train import convert_sentencepiece, import_sentencepiece, sentencepiece_model

SAMPLE_BYTES = 64 * 2**20  # of corpus read to count its characters and find the target scripts
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                "generation_config.json")


@dataclass
class Extension:
    folder: Path
    base_size: int
    added: list[str] = field(default_factory=list)
    targets: dict[str, float] = field(default_factory=dict)  # script -> share the base left uncovered
    kind: str = ""

    @property
    def size(self) -> int:
        return self.base_size + len(self.added)


def refuse_base_as_output(base: Path, output: Path) -> None:
    if output.resolve() == base.resolve():
        raise DataError(f"--output {output} is the base tokenizer's folder; write the extension elsewhere")


def extend_tokenizer(base: Path, output: Path, add: int, corpus: Corpus | None = None, source: Path | None = None,
                     scripts: list[str] | None = None, workers: int = 1) -> Extension:
    if add < 1:
        raise DataError(f"--add {add}: give the number of tokens to add (at least 1)")
    if corpus is None and source is None:
        raise DataError("give --input FILES to learn new tokens from, or --from TOKENIZER to take them from")
    base = _tokenizer_folder(base, "--tokenizer")
    source = _tokenizer_folder(source, "--from") if source is not None else None
    sentencepiece_base = (base / "tokenizer.model").is_file()
    if source is not None and sentencepiece_base != (source / "tokenizer.model").is_file():
        raise DataError(f"--from {source}: its tokens cannot be merged into --tokenizer {base}: one is a "
                        "SentencePiece model (tokenizer.model) and the other is not; take the new tokens from a "
                        "tokenizer of the same kind (pretrainer tokenizer train with or without --byte-fallback)")
    refuse_base_as_output(base, output)
    output.mkdir(parents=True, exist_ok=True)
    for name in CONFIG_FILES:  # special tokens, BOS/EOS settings and the chat template carry over
        if (base / name).is_file():
            shutil.copy(base / name, output / name)
    if sentencepiece_base:
        return _extend_sentencepiece(base, output, add, corpus, source, scripts, workers)
    return _extend_hf_bpe(base, output, add, corpus, source, scripts)


def _tokenizer_folder(path: Path, flag: str) -> Path:
    folder = path.parent if path.is_file() else path
    if not ((folder / "tokenizer.model").is_file() or (folder / "tokenizer.json").is_file()):
        raise DataError(f"{flag} {path}: no tokenizer.model or tokenizer.json there")
    return folder


def _characters(corpus: Corpus | None, source: Path | None) -> Counter:
    """The characters of (a sample of) the corpus, or of the other tokenizer's vocabulary."""
    return Counter(chain.from_iterable(corpus.documents("surveying characters", SAMPLE_BYTES) if corpus else
                                       _pieces_text(source)))


def _targets(scripts: list[str] | None, characters: Counter, covers) -> dict[str, float]:
    if scripts:
        return {script.upper(): 1.0 for script in scripts}
    found = detect_target_scripts(characters, covers)
    if not found:
        raise DataError("the base tokenizer already covers every script of the corpus (no script has more than 5% "
                        "of its characters uncovered); name the scripts to extend with --scripts (e.g. CJK)")
    return found


# ----------------------------------------------------------------------------------- SentencePiece model
def _extend_sentencepiece(base, output, add, corpus, source, scripts, workers) -> Extension:
    import_sentencepiece()  # the missing package named, with the fix
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString((base / "tokenizer.model").read_bytes())
    if proto.trainer_spec.model_type != pb.TrainerSpec.BPE:
        raise DataError(f"--tokenizer {base}: tokenizer.model is a SentencePiece "
                        f"{pb.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type)} model; only BPE models "
                        "(as Llama-2 ships) are extended")
    vocab = {piece.piece for piece in proto.pieces}
    extension = Extension(output, len(proto.pieces), kind="SentencePiece BPE")
    characters = _characters(corpus, source)
    extension.targets = _targets(scripts, characters, lambda char: char in vocab)
    # room for every character (SentencePiece needs them in its vocabulary) and for pieces the filter drops
    learned_size = add + len(characters) + 1000
    candidates = (_sentencepiece_pieces(pb, (source / "tokenizer.model").read_bytes()) if source else
                  _learn_sentencepiece(corpus, proto, learned_size, workers, pb))
    lowest = min((piece.score for piece in proto.pieces), default=0.0)
    for piece in candidates:
        if len(extension.added) == add:
            break
        if piece in vocab or not holds_target_char(piece, set(extension.targets)) or not _buildable(piece, vocab):
            continue
        entry = proto.pieces.add()
        entry.piece, entry.type = piece, pb.ModelProto.SentencePiece.NORMAL
        entry.score = lowest - 1 - len(extension.added)  # after every base merge, in learned order
        vocab.add(piece)
        extension.added.append(piece)
    (output / "tokenizer.model").write_bytes(proto.SerializeToString())
    convert_sentencepiece(output)
    return extension


def _buildable(piece: str, vocab: set[str]) -> bool:
    """A single character, or two tokens already in the vocabulary side by side."""
    return len(piece) == 1 or any(piece[:i] in vocab and piece[i:] in vocab for i in range(1, len(piece)))


def _learn_sentencepiece(corpus, proto, size, workers, pb) -> list[str]:
    """Pieces a SentencePiece BPE with the base's normalisation learns on the corpus, most frequent first."""
    spec, normalizer = proto.trainer_spec, proto.normalizer_spec
    model = sentencepiece_model(
        corpus, "learning pieces", "learn from", workers, model_type="bpe", vocab_size=size,
        byte_fallback=spec.byte_fallback, split_digits=spec.split_digits,
        allow_whitespace_only_pieces=spec.allow_whitespace_only_pieces,
        remove_extra_whitespaces=normalizer.remove_extra_whitespaces, add_dummy_prefix=normalizer.add_dummy_prefix,
        normalization_rule_name=normalizer.name or "identity", unk_id=0, bos_id=-1, eos_id=-1, hard_vocab_limit=False)
    return _sentencepiece_pieces(pb, model)


def _sentencepiece_pieces(pb, model: bytes) -> list[str]:
    proto = pb.ModelProto()
    proto.ParseFromString(model)
    normal = [p for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.NORMAL]
    # single characters first (every multi-character piece is built from them), then by score
    return [p.piece for p in sorted(normal, key=lambda p: (len(p.piece) > 1, -p.score))]


def _pieces_text(folder: Path):
    """The other tokenizer's vocabulary as text, to find the scripts it adds."""
    if (folder / "tokenizer.json").is_file():
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        yield " ".join(data["model"]["vocab"])
    else:
        from sentencepiece import sentencepiece_model_pb2 as pb

        yield " ".join(_sentencepiece_pieces(pb, (folder / "tokenizer.model").read_bytes()))


# ----------------------------------------------------------------------------------- HF tokenizer.json BPE
def _extend_hf_bpe(base, output, add, corpus, source, scripts) -> Extension:
    from tokenizers import Tokenizer

    data = json.loads((base / "tokenizer.json").read_text(encoding="utf-8"))
    model = data["model"]
    if model.get("type") != "BPE":
        raise DataError(f"--tokenizer {base}: tokenizer.json holds a {model.get('type')} model; only BPE "
                        "tokenizers are extended")
    if "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        raise DataError(f"--tokenizer {base}: a tokenizer.json BPE that is not byte-level is extended through its "
                        "SentencePiece tokenizer.model; put that file in the folder (Llama-2 repositories ship it)")
    tokenizer = Tokenizer.from_str(json.dumps(data))
    vocab: dict[str, int] = dict(model["vocab"])
    merges = _merges_of_data(data)
    next_id = 1 + max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))])
    extension = Extension(output, next_id, kind="byte-level BPE")

    def covers(char: str) -> bool:
        return len(tokenizer.encode(char, add_special_tokens=False).ids) == 1

    extension.targets = _targets(scripts, _characters(corpus, source), covers)
    targets = set(extension.targets)
    learned = (_merges_of_data(json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))) if source
               else _learn_merges(corpus, data, add))
    new_merges = []
    for left, right in learned:
        if len(extension.added) == add:
            break
        token = left + right
        if token in vocab or left not in vocab or right not in vocab:
            continue
        if not holds_target_char(_byte_level_text(token), targets):
            continue
        vocab[token] = next_id
        next_id += 1
        new_merges.append([left, right])
        extension.added.append(token)
    model["vocab"] = vocab
    model["merges"] = [list(m) for m in merges] + new_merges
    (output / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return extension


@lru_cache(maxsize=1)
def _char_to_byte() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte written as one printable character (the GPT-2 convention that
    byte-level tokenizer.json files use), read back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]  # written as 256, 257, ... in order
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + n): byte for n, byte in enumerate(others)}}


def _byte_level_text(token: str) -> str:
    """A byte-level token's text, partial characters at its ends decoded as far as they go (a token holding part of a
    multi-byte character counts as that character's script when its lead byte is there)."""
    table = _char_to_byte()
    raw = bytes(table[char] for char in token if char in table)
    text = raw.decode("utf-8", errors="ignore")
    if text or not raw or raw[0] < 0xC0:
        return text
    # a lead byte and part of its continuation: complete it
    return next(filter(None, ((raw + b"\x80" * n).decode("utf-8", errors="ignore") for n in (1, 2, 3))), "")


def _learn_merges(corpus: Corpus, base_data: dict, add: int) -> list[tuple[str, str]]:
    """Merges a BPE with the base's normaliser and pre-tokenizer learns on the corpus, in learned order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    template = Tokenizer.from_str(json.dumps(base_data))
    learner.normalizer, learner.pre_tokenizer = template.normalizer, template.pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 4 * add + 1000, show_progress=False,
                                  initial_alphabet=alphabet)
    learner.train_from_iterator(corpus.documents("learning merges"), trainer)
    return _merges_of_data(json.loads(learner.to_str()))


def _merges_of_data(data: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in data["model"]["merges"]]
