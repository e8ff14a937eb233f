"""Which writing systems a tokenizer extension targets: a new token must hold a character of one, so text without such
characters (English, when extending for Chinese) tokenizes exactly as before.

By default the targets are the scripts whose characters the base tokenizer leaves uncovered (byte fallback, or more than
one token for a single character) in at least `UNCOVERED_SHARE` of their occurrences in the corpus, among the scripts
that make up at least `MIN_CORPUS_SHARE` of its characters.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from functools import lru_cache
from typing import Callable

UNCOVERED_SHARE = 0.05
MIN_CORPUS_SHARE = 0.001  # a script this rare in the corpus (a stray Greek letter) is not a target


# CJK punctuation and the full/halfwidth forms Chinese text writes (，。「」ＡＢ) count as CJK; other
# punctuation, symbols and digits are COMMON, which every script shares and no extension targets by itself.
CJK_FORMS_BLOCKS = ((0x3000, 0x303F), (0xFE30, 0xFE4F), (0xFF00, 0xFFEF))


@lru_cache(maxsize=65536)
def script_of(char: str) -> str:
    """A coarse script: for letters and marks the first word of the Unicode name (LATIN, CYRILLIC, HIRAGANA,
    ...; CJK for ideographs), CJK for CJK punctuation and full/halfwidth forms, else COMMON."""
    code = ord(char)
    if any(low <= code <= high for low, high in CJK_FORMS_BLOCKS):
        return "CJK"
    if unicodedata.category(char)[0] not in "LM":
        return "COMMON"
    first = unicodedata.name(char, "COMMON").split()[0]
    return "CJK" if first in ("CJK", "IDEOGRAPHIC", "KANGXI") else first


def detect_target_scripts(counts: Counter, covers: Callable[[str], bool]) -> dict[str, float]:
    """The scripts the base tokenizer covers poorly, with the share of their characters' occurrences it leaves
    uncovered; `counts`: the corpus's characters; `covers(char)`: whether the base has a single token for it."""
    seen, uncovered = Counter(), Counter()
    for char, count in counts.items():
        if char.isspace():
            continue
        script = script_of(char)
        seen[script] += count
        if not covers(char):
            uncovered[script] += count
    total = sum(seen.values())
    shares = {script: uncovered[script] / seen[script] for script in seen
              if script != "COMMON" and seen[script] >= MIN_CORPUS_SHARE * total}
    return {script: share for script, share in sorted(shares.items()) if share >= UNCOVERED_SHARE}


def holds_target_char(text: str, targets: set[str]) -> bool:
    return any(script_of(char) in targets for char in text)
