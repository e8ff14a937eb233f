"""The texts a tokenizer learns from or is measured on: any input `prepare` reads, streamed, with a progress
bar in input bytes on a terminal."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from ..data.readers import BytesRead, expand_paths, read_documents


class Corpus:
    """Documents of `inputs` (files, globs or folders), read afresh on each iteration."""

    def __init__(self, inputs: list[str], text_key: str = "text", txt_mode: str = "line"):
        self.files: list[Path] = expand_paths(inputs, "--input")
        self.text_key, self.txt_mode = text_key, txt_mode

    def documents(self, description: str = "", limit_bytes: int | None = None) -> Iterator[str]:
        """Each document's text; stops after `limit_bytes` of input when given."""
        meter = BytesRead(self.files)
        total = min(meter.total, limit_bytes) if limit_bytes else meter.total
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description,
                  disable=not (description and sys.stderr.isatty())) as bar:
            for document in read_documents(self.files, self.text_key, self.txt_mode, meter=meter):
                bar.update(min(meter.done, total) - bar.n)
                yield document.text
                if limit_bytes and meter.done >= limit_bytes:
                    return

    def lines(self, description: str = "") -> Iterator[str]:
        """Non-empty lines of the documents (what SentencePiece trains on: it skips very long sentences)."""
        for text in self.documents(description):
            yield from (line for line in text.splitlines() if line.strip())
