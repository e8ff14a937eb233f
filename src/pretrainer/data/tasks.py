"""Multiple-choice task files read into records of (context, choices, gold): the generic layout and the row
layouts of published sets as `datasets` saves them (to_json / to_parquet). The formats, their prompts (as
lm-evaluation-harness) and the few-shot rules: docs/downstream-eval.md, 'Task files'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from ..config import DownstreamTask
from .readers import DataError, read_records
from .remote import is_url, local_file

LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class ChoiceRecord:
    context: str                 # everything before a choice, few-shot examples included
    choices: tuple[str, ...]     # each scored as the continuation `target_delimiter + choice`
    gold: int
    where: str                   # file:line, for messages


@dataclass(frozen=True)
class _Parsed:
    context: str
    choices: tuple[str, ...]
    gold: int
    description: str = ""        # a line put once before the few-shot examples (MMLU's subject)


def read_task(task: DownstreamTask) -> list[ChoiceRecord]:
    """The task's scored records, each with its few-shot prefix; a bad record raises with its file and line."""
    path = task.path
    rows = _parsed_rows(path, task.format)
    shots: list[_Parsed] = []
    if task.num_fewshot:
        if task.fewshot_path:
            shots = list(islice(_parsed_rows(task.fewshot_path, task.format), task.num_fewshot))
        else:
            shots = [parsed for _, parsed in islice(rows, task.num_fewshot)]
            rows = rows[task.num_fewshot:]
        if len(shots) < task.num_fewshot:
            raise DataError(f"{task.fewshot_path or path}: num_fewshot {task.num_fewshot} needs that many records, "
                            f"the file has {len(shots)}")
    rows = rows[:task.limit] if task.limit else rows
    if not rows:
        raise DataError(f"{path}: no records to score (the file is empty, or num_fewshot took them all)")
    examples = "".join(s.context + task.target_delimiter + s.choices[s.gold] + task.fewshot_delimiter for s in shots)
    return [ChoiceRecord(parsed.description + examples + parsed.context, parsed.choices, parsed.gold, where)
            for where, parsed in rows]


def _parsed_rows(name: str, fmt: str) -> list[tuple[str, _Parsed]]:
    # a URL: read whole, at every evaluation, so copied to the local cache on first use
    path = local_file(name, "downstream_evals") if is_url(name) else Path(name)
    if not path.is_file():
        raise DataError(f"downstream_evals: task file {path} does not exist")
    out = []
    for where, record in read_records(path):
        if isinstance(record, DataError):
            raise record
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected an object, got {type(record).__name__}")
        if fmt == "auto":
            fmt = detect_format(record, where)
        out.append((where, PARSERS[fmt](_Fields(record, where, fmt))))
    return out


def detect_format(record: dict, where: str) -> str:
    keys = set(record)
    for fmt, needed in SIGNATURES:
        if needed <= keys:
            return fmt
    shown = ", ".join(repr(k) for k in list(record)[:8]) or "none"
    raise DataError(f"{where}: cannot tell the task's layout from its fields ({shown}); write records as "
                    '{"context": ..., "choices": [...], "gold": i}, or set the task\'s `format` '
                    "(hellaswag, arc, piqa, mmlu, ceval)")


class _Fields:
    """A record's fields, each read with the check that names the file, line and field when it fails."""

    def __init__(self, record: dict, where: str, fmt: str):
        self.record, self.where, self.fmt = record, where, fmt

    def fail(self, message: str) -> DataError:
        return DataError(f"{self.where}: {message} ({self.fmt} task record)")

    def get(self, key: str, kind=str):
        if key not in self.record:
            raise self.fail(f"missing field {key!r}")
        value = self.record[key]
        if kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)  # published sets keep some labels as digit strings
        if not isinstance(value, kind) or isinstance(value, bool):
            raise self.fail(f"field {key!r} must be {kind.__name__}, got {value!r}")
        return value

    def texts(self, key: str, value=None) -> tuple[str, ...]:
        value = self.get(key, list) if value is None else value
        if len(value) < 2 or not all(isinstance(v, str) for v in value):
            raise self.fail(f"field {key!r} must list at least two strings, got {value!r}")
        return tuple(value)

    def gold(self, index: int, choices: tuple[str, ...], key: str) -> int:
        if not 0 <= index < len(choices):
            raise self.fail(f"gold index {index} (field {key!r}) is out of range for {len(choices)} choices")
        return index

    def letter(self, key: str) -> int:
        value = self.get(key).strip()
        if value not in LETTERS:
            raise self.fail(f"field {key!r} must be one of {', '.join(LETTERS)}, got {value!r}")
        return LETTERS.index(value)


def _choices(f: _Fields) -> _Parsed:
    choices = f.texts("choices")
    return _Parsed(f.get("context"), choices, f.gold(f.get("gold", int), choices, "gold"))


def _hellaswag_text(text: str) -> str:
    """HellaSwag's cleanup (lm-evaluation-harness): WikiHow's [title] marks become sentence ends, other
    bracketed tags go."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag(f: _Fields) -> _Parsed:
    ctx = f.get("ctx_a") + " " + f.get("ctx_b").capitalize()
    choices = tuple(_hellaswag_text(e) for e in f.texts("endings"))
    return _Parsed(_hellaswag_text(f.get("activity_label") + ": " + ctx), choices,
                   f.gold(f.get("label", int), choices, "label"))


def _arc(f: _Fields) -> _Parsed:
    block = f.get("choices", dict)
    texts, labels = f.texts("choices.text", block.get("text")), block.get("label")
    answer = f.get("answerKey")
    if not isinstance(labels, list) or answer not in labels:
        raise f.fail(f"answerKey {answer!r} is not among choices.label {labels!r}")
    return _Parsed(f"Question: {f.get('question')}\nAnswer:", texts, f.gold(labels.index(answer), texts, "answerKey"))


def _piqa(f: _Fields) -> _Parsed:
    choices = (f.get("sol1"), f.get("sol2"))
    return _Parsed(f"Question: {f.get('goal')}\nAnswer:", choices, f.gold(f.get("label", int), choices, "label"))


def _lettered(question: str, options: tuple[str, ...], answer_word: str) -> str:
    lines = [question.strip(), *(f"{letter}. {text}" for letter, text in zip(LETTERS, options))]
    return "\n".join(lines) + "\n" + answer_word


def _mmlu(f: _Fields) -> _Parsed:
    options = f.texts("choices")
    if len(options) != 4:
        raise f.fail(f"field 'choices' must hold 4 options, got {len(options)}")
    subject = f.record.get("subject")
    description = (f"The following are multiple choice questions (with answers) about "
                   f"{subject.replace('_', ' ')}.\n\n") if isinstance(subject, str) and subject else ""
    return _Parsed(_lettered(f.get("question"), options, "Answer:"), LETTERS,
                   f.gold(f.get("answer", int), LETTERS, "answer"), description)


def _ceval(f: _Fields) -> _Parsed:
    options = tuple(f.get(letter) for letter in LETTERS)
    return _Parsed(_lettered(f.get("question"), options, "答案："), LETTERS, f.letter("answer"))


PARSERS = {"choices": _choices, "hellaswag": _hellaswag, "arc": _arc, "piqa": _piqa, "mmlu": _mmlu,
           "ceval": _ceval}
SIGNATURES = (("choices", {"context", "choices", "gold"}), ("hellaswag", {"ctx_a", "ctx_b", "endings"}),
              ("arc", {"question", "choices", "answerKey"}), ("piqa", {"goal", "sol1", "sol2"}),
              ("ceval", {"question", "A", "B", "C", "D", "answer"}), ("mmlu", {"question", "choices", "answer"}))
