"""`pretrainer tokenizer inspect`: tokenizers side by side on the same documents.

Per tokenizer: vocabulary size, characters per token, tokens per document, the share of tokens that are byte-fallback
pieces (`<0xE4>`) or unknown, and the share that are new (ids >= the vocabulary size of the first, base tokenizer)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..data.readers import DataError
from .corpus import Corpus

BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@dataclass
class TokenizerStats:
    path: str
    vocab_size: int
    documents: int
    characters: int
    tokens: int
    chars_per_token: float
    tokens_per_document: float
    byte_fallback_rate: float
    new_token_share: float


def inspect_tokenizers(paths: list[str], corpus: Corpus, limit_bytes: int | None = None) -> list[TokenizerStats]:
    from transformers import AutoTokenizer

    tokenizers = []
    for path in paths:
        if not Path(path).exists():
            raise DataError(f"tokenizer {path} does not exist")
        tokenizers.append(AutoTokenizer.from_pretrained(path))
    base_size = len(tokenizers[0])
    texts = list(corpus.documents("reading", limit_bytes))
    if not texts:
        raise DataError(f"--input {', '.join(map(str, corpus.files))}: no documents")
    characters = sum(map(len, texts))
    stats = []
    for path, tokenizer in zip(paths, tokenizers):
        fallback_ids = {i for token, i in tokenizer.get_vocab().items() if BYTE_PIECE.match(token)}
        if tokenizer.unk_token_id is not None:
            fallback_ids.add(tokenizer.unk_token_id)
        ids = [i for row in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in row]
        tokens, fallback, new = len(ids), sum(i in fallback_ids for i in ids), sum(i >= base_size for i in ids)
        stats.append(TokenizerStats(str(path), len(tokenizer), len(texts), characters, tokens,
                                    round(characters / max(tokens, 1), 3), round(tokens / len(texts), 1),
                                    _share(fallback, tokens), _share(new, tokens)))
    return stats


def stats_table(stats: list[TokenizerStats]) -> str:
    header = ("tokenizer", "vocab", "chars/token", "tokens/doc", "byte-fallback", "new tokens")
    rows = [(s.path, f"{s.vocab_size:,}", f"{s.chars_per_token:.3f}", f"{s.tokens_per_document:,.1f}",
             f"{s.byte_fallback_rate:.2%}", f"{s.new_token_share:.2%}") for s in stats]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in
                                enumerate(zip(row, widths))) for row in [header, *rows])


def _share(count: int, tokens: int) -> float:
    return round(count / tokens, 4) if tokens else 0.0
