"""Growing a model's vocabulary to an extended tokenizer, before any engine shards the model.

`plan_growth` (at preflight) picks the new size and checks that every token of the model's own tokenizer keeps its
id; `grow_embeddings` (after loading) fills the new rows by `new_token_init` (docs/new-language.md). A text the old
tokenizer cannot split, and every padding row, gets the mean of all rows. Random draws use a generator seeded with
`seed`, so every rank builds the same rows.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(frozen=True)
class VocabGrowth:
    old_size: int                     # the model's vocab_size
    new_size: int                     # the padded size the embedding grows to
    tokens: int                       # the tokenizer's length
    base_tokenizer: object | None     # the model's own tokenizer (None: not found beside the model)


def padded_size(tokens: int, multiple: int, tensor_parallel: int = 1) -> int:
    """A multiple of `multiple` and of the tensor-parallel degree (the embedding and head are split by rows)."""
    step = math.lcm(max(1, multiple), max(1, tensor_parallel))
    return -(-tokens // step) * step


def plan_growth(config, tokenizer, args, model_folder: Path | None, config_source: str,
                tensor_parallel: int = 1) -> VocabGrowth | None:
    """None when the tokenizer fits the model's vocabulary; else the growth, after checking the tokenizer
    extends the model's own."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or len(tokenizer) <= vocab:
        return None
    base = _model_tokenizer(model_folder, args.resolved_tokenizer_path)
    if base is not None:
        check_extension(base, tokenizer, args.resolved_tokenizer_path, model_folder, args.allow_tokenizer_mismatch)
    elif not args.allow_tokenizer_mismatch:
        raise ConfigError(f"the tokenizer ({args.resolved_tokenizer_path}) has {len(tokenizer):,} tokens but the "
                          f"model has vocab_size={vocab:,} ({config_source}), and no tokenizer of the model's own "
                          "is there to check that the new one extends it (the model folder has none, or it is the "
                          "one given); keep the model's original tokenizer in its folder and point tokenizer_path "
                          "at the extended one, or set allow_tokenizer_mismatch: true")
    new_size = padded_size(len(tokenizer), args.pad_vocab_to_multiple_of, tensor_parallel)
    return VocabGrowth(vocab, new_size, len(tokenizer), base)


def _model_tokenizer(model_folder: Path | None, tokenizer_path: str | None):
    from transformers import AutoTokenizer

    if model_folder is None or not any((model_folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    if tokenizer_path and Path(tokenizer_path).resolve() in (model_folder.resolve(), model_folder.resolve() /
                                                             "config.json"):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(model_folder))
    except Exception:  # a folder with a partial tokenizer: nothing to compare with
        return None


def check_extension(base, tokenizer, tokenizer_path, model_folder, allow: bool) -> None:
    """Every token of the model's tokenizer must keep its id in the new one."""
    new_vocab = tokenizer.get_vocab()
    differing = [(token, i, new_vocab.get(token)) for token, i in base.get_vocab().items()
                 if new_vocab.get(token) != i]
    if not differing:
        return
    token, old, new = differing[0]
    message = (f"the tokenizer ({tokenizer_path}) is not an extension of the model's ({model_folder}): "
               f"{len(differing):,} of the model tokenizer's {len(base):,} tokens have another id or none "
               f"(e.g. {token!r}: {old} -> {new}), so their embedding rows would be read for other tokens")
    if allow:
        logger.warning("%s; training anyway (allow_tokenizer_mismatch: true)", message)
        return
    raise ConfigError(f"{message}; make it with `pretrainer tokenizer extend --tokenizer {model_folder}`, or set "
                      "allow_tokenizer_mismatch: true to train anyway")


class RowGrower:
    """The grown matrix of an input embedding or output head: its old rows, the new rows by `new_token_init`,
    the padding rows. Matrices are grown in the model's order (input embedding, then an untied head) from one
    generator seeded with `seed`, so a run that loads whole and one that reads slices draw the same rows."""

    def __init__(self, model_config, growth: VocabGrowth, tokenizer, method: str, std: float | None, seed: int):
        self.growth, self.method, self.seed = growth, method, seed
        self.std = std if std is not None else getattr(model_config, "initializer_range", 0.02)
        self.pieces = _base_pieces(tokenizer, growth) if method == "subtoken_mean" else None
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def draws(self) -> bool:
        """Whether growing uses the generator (so a head's rows depend on the input embedding's draws)."""
        return self.method != "subtoken_mean"

    def restart(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    @torch.no_grad()
    def grow(self, old: torch.Tensor) -> torch.Tensor:
        """[new_size, hidden] from the [old_size, hidden] `old`."""
        growth = self.growth
        grown = torch.empty((growth.new_size, old.shape[1]), dtype=old.dtype, device=old.device)
        grown[:growth.old_size] = old
        mean = old.mean(dim=0)
        new_rows = grown[growth.old_size:growth.tokens]
        if self.method == "normal":
            new_rows.copy_(torch.randn(new_rows.shape, generator=self.generator, dtype=torch.float32) * self.std)
        elif self.method == "mean":
            new_rows.copy_(_perturbed_means(old, len(new_rows), self.generator))
        else:
            for row, ids in zip(new_rows, self.pieces):
                row.copy_(old[ids].mean(dim=0) if ids else mean)
        grown[growth.tokens:] = mean  # padding rows: never a target, never read
        return grown

    def describe(self) -> str:
        return (self.method if self.pieces is None else
                f"subtoken_mean ({sum(1 for p in self.pieces if not p)} without pieces)")


def grow_embeddings(model: torch.nn.Module, growth: VocabGrowth, tokenizer, method: str, std: float | None,
                    seed: int) -> None:
    """Resize the input embedding and output head of a loaded model to `growth.new_size` and initialise the
    new rows by `method` (see the module docstring)."""
    grower = RowGrower(model.config, growth, tokenizer, method, std, seed)
    model.resize_token_embeddings(growth.new_size, mean_resizing=False)  # keeps the old rows, first
    matrices = [model.get_input_embeddings().weight]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not matrices[0]:
        matrices.append(head.weight)
    with torch.no_grad():
        for weight in matrices:
            weight.copy_(grower.grow(weight[:growth.old_size]))
    logger.info("vocabulary: %d -> %d rows (%d tokens, the rest padding); new rows: %s", growth.old_size,
                growth.new_size, growth.tokens, grower.describe())


def _base_pieces(tokenizer, growth: VocabGrowth) -> list[list[int]]:
    """For each new id, the ids of the pieces the model's own tokenizer splits the token into: its BPE model
    applied to the token's string (byte-level and SentencePiece-style tokens alike), else its text encoded."""
    base = growth.base_tokenizer or tokenizer
    backend = getattr(base, "backend_tokenizer", None)
    pieces = []
    for token_id in range(growth.old_size, growth.tokens):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if backend is not None:
            ids = [piece.id for piece in backend.model.tokenize(token)]
        else:
            ids = base(tokenizer.convert_tokens_to_string([token]), add_special_tokens=False)["input_ids"]
        pieces.append([i for i in ids if i < growth.old_size])
    return pieces


def _perturbed_means(old: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    mean = old.mean(dim=0)
    centered = old - mean
    covariance = centered.T @ centered / len(old)
    try:
        factor = torch.linalg.cholesky(1e-9 * covariance)
    except RuntimeError:  # not positive definite (few rows): the plain mean
        return mean.expand(count, -1).clone()
    noise = torch.randn((count, old.shape[1]), generator=generator, dtype=old.dtype)
    return mean + noise @ factor.T
