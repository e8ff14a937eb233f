"""The byte-level BPE alphabet: each byte written as one printable character (the GPT-2 convention that
byte-level tokenizer.json files use), and back."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _char_to_byte() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def token_bytes(token: str) -> bytes:
    table = _char_to_byte()
    return bytes(table[char] for char in token if char in table)
