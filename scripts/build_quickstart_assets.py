"""Build the quickstart's corpus and tokenizer from CPython's own documentation.

The corpus is CPython's reference-manual topics and the docstrings of the Python
standard library (PSF licence, see examples/data/README.md), one document per
topic or docstring, written as JSON lines. A byte-level BPE tokenizer is trained
on it and saved into the tiny model's folder beside its config.json. The topics
are also written as alpaca records and as `<s>Human: ...</s><s>Assistant: ...</s>`
CSV rows, the two record formats of the seeds. All outputs are committed, so
this script only needs to be rerun to refresh them:

    python scripts/build_quickstart_assets.py
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "data" / "python_docs.jsonl"
ALPACA = ROOT / "examples" / "data" / "python_topics_alpaca.json"
CHAT_CSV = ROOT / "examples" / "data" / "python_topics_chat.csv"
TOKENIZER_DIR = ROOT / "examples" / "models" / "tiny-llama"
VOCAB_SIZE = 4096
MAX_CORPUS_CHARS = 2_500_000
MIN_DOC_CHARS = 120

# Modules that open windows, print on import, or are not documentation.
SKIP_PREFIXES = ("antigravity", "this", "idlelib", "tkinter", "turtle", "test", "__", "_", "lib2to3",
                 "ensurepip", "pydoc_data", "msilib", "winreg", "winsound", "msvcrt", "nt")


def iter_docstrings(module_name: str):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_name)
    except Exception:
        return
    yield inspect.getdoc(module)
    for _, obj in sorted(vars(module).items()):
        if getattr(obj, "__module__", None) != module_name:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield inspect.getdoc(obj)
        if inspect.isclass(obj):
            for _, member in sorted(vars(obj).items()):
                if inspect.isfunction(member):
                    yield inspect.getdoc(member)


def build_corpus() -> list[str]:
    """Reference-manual topics first (pydoc's copy of the language reference), then docstrings."""
    from pydoc_data.topics import topics

    docs = [topics[name].strip() for name in sorted(topics)]
    seen, total = set(docs), sum(map(len, docs))
    for name in sorted(sys.stdlib_module_names):
        if name.startswith(SKIP_PREFIXES):
            continue
        for doc in iter_docstrings(name):
            if not doc or len(doc) < MIN_DOC_CHARS or doc in seen:
                continue
            seen.add(doc)
            docs.append(doc)
            total += len(doc)
            if total >= MAX_CORPUS_CHARS:
                return docs
    return docs


def train_tokenizer(docs: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    # Encoding a prompt adds BOS, as every training document starts with it.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=2048)
    fast.save_pretrained(TOKENIZER_DIR)
    write_model_config(fast)


def write_model_config(tokenizer) -> None:
    """A small Llama (GQA, untied embeddings) sized for a CPU quickstart of about two minutes."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.02,
                rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                use_cache=False).save_pretrained(TOKENIZER_DIR)


def write_record_formats() -> None:
    """The reference topics as question/answer pairs, in the seeds' alpaca JSON and chat CSV forms."""
    import csv
    from pydoc_data.topics import topics

    names = sorted(topics)
    alpaca = [{"instruction": f"Explain the Python topic '{name}'.", "input": "", "output": topics[name].strip()}
              for name in names]
    ALPACA.write_text(json.dumps(alpaca, ensure_ascii=False, indent=1), encoding="utf-8")
    with open(CHAT_CSV, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        for name in names:
            writer.writerow([f"<s>Human: What does the Python reference say about '{name}'?\n</s>"
                             f"<s>Assistant: {topics[name].strip()}\n</s>"])


def main() -> None:
    docs = build_corpus()
    write_record_formats()
    CORPUS.parent.mkdir(parents=True, exist_ok=True)
    with open(CORPUS, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    train_tokenizer(docs)
    print(f"{len(docs)} documents, {sum(map(len, docs))} characters -> {CORPUS}; tokenizer -> {TOKENIZER_DIR}")


if __name__ == "__main__":
    main()
