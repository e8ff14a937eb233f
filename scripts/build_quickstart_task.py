"""Build examples/tasks/python_docs_choices.jsonl: a small multiple-choice task from the quickstart corpus.

Each record is the start of a prose paragraph of `examples/data/python_docs.jsonl` (its first 12 to 20
words) with four candidate continuations of 6 words: the paragraph's own next words (gold) and the words
at the same place in three other paragraphs. A model that has learned the documentation's language
ranks the real continuation first more often than chance (25%). The records come from the training
corpus itself, so the task measures what the quickstart run learns, not generalisation.

    python scripts/build_quickstart_task.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "examples" / "data" / "python_docs.jsonl"
OUT = ROOT / "examples" / "tasks" / "python_docs_choices.jsonl"
RECORDS, CHOICES, CONTINUATION = 200, 4, 6


def prose_paragraphs() -> list[list[str]]:
    paragraphs = []
    for line in CORPUS.read_text(encoding="utf-8").splitlines():
        for block in json.loads(line)["text"].split("\n\n"):
            words = block.split()
            # prose: starts with a capital letter, not indented code, long enough for a context and a choice
            if len(words) >= 30 and block[:1].isupper() and not block.startswith(" ") and "::" not in block:
                paragraphs.append(words)
    return paragraphs


def main() -> None:
    rng = random.Random(0)
    paragraphs = prose_paragraphs()
    picked = rng.sample(range(len(paragraphs)), RECORDS)
    with open(OUT, "w", encoding="utf-8") as out:
        for index in picked:
            words = paragraphs[index]
            cut = rng.randint(12, 20)
            others = rng.sample([i for i in range(len(paragraphs)) if i != index], CHOICES - 1)
            choices = [" ".join(paragraphs[i][cut:cut + CONTINUATION]) for i in others]
            gold = rng.randrange(CHOICES)
            choices.insert(gold, " ".join(words[cut:cut + CONTINUATION]))
            out.write(json.dumps({"context": " ".join(words[:cut]), "choices": choices, "gold": gold},
                                 ensure_ascii=False) + "\n")
    print(f"{OUT}: {RECORDS} records from {len(paragraphs)} prose paragraphs")


if __name__ == "__main__":
    main()
