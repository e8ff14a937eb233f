"""Tokenize documents and pack them into fixed windows.

Every document becomes `[BOS] text [EOS]` (BOS only when the tokenizer has one
distinct from EOS and the text does not already start with it; EOS only when
the text does not already end with it), and all documents are concatenated
into one token stream. Window `i` covers stream tokens `[i*L, i*L + L]`:
`L` inputs and the `L` next tokens as targets, so every token after the first
is a target exactly once. Nothing is padded and nothing is dropped; only the
final window may be shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .readers import DataError, Document

TOKENIZE_BATCH = 512


def tokenize_documents(documents: list[Document], tokenizer) -> tuple[np.ndarray, int]:
    """Return the packed token stream and the number of empty documents skipped."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token, which separates packed documents; "
                        "use a tokenizer that defines eos_token")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id not in (None, eos) else None
    pieces: list[list[int]] = []
    skipped = 0
    for start in range(0, len(documents), TOKENIZE_BATCH):
        batch = documents[start:start + TOKENIZE_BATCH]
        encoded = tokenizer([d.text for d in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for ids in encoded:
            if not ids:
                skipped += 1
                continue
            if bos is not None and ids[0] != bos:
                ids = [bos] + ids
            if ids[-1] != eos:
                ids = ids + [eos]
            pieces.append(ids)
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    stream = np.fromiter((t for ids in pieces for t in ids), dtype=dtype) if pieces else np.zeros(0, dtype)
    return stream, skipped


class PackedDataset(torch.utils.data.Dataset):
    """Windows of `seq_length` inputs over a token stream, each with its pre-shifted targets."""

    def __init__(self, stream: np.ndarray, seq_length: int):
        self.stream = stream
        self.seq_length = seq_length
        self.num_windows = max(0, -(-(len(stream) - 1) // seq_length)) if len(stream) > 1 else 0

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> dict:
        start = index * self.seq_length
        window = torch.from_numpy(self.stream[start:start + self.seq_length + 1].astype(np.int64))
        return {"input_ids": window[:-1], "shift_labels": window[1:]}

    @property
    def num_target_tokens(self) -> int:
        return max(0, len(self.stream) - 1)


@dataclass(frozen=True)
class DocumentMasking:
    """Megatron's reset_position_ids / reset_attention_mask for packed windows.

    Positions restart after every EOS, so each document is encoded as if it began the window. With
    `attention` set the model also gets no attention mask: HF models then read the restarting positions
    as packed sequences and mask attention block-diagonally (flash-attention varlen kernels do this for
    free; SDPA and eager build a [batch, 1, seq, seq] mask, which costs memory and rules out SDPA's flash
    kernel). Without `attention` an all-ones mask keeps attention causal over the whole window.
    """
    eod_token_id: int
    attention: bool = False

    def apply(self, batch: dict) -> dict:
        batch["position_ids"] = document_position_ids(batch["input_ids"], self.eod_token_id)
        if self.attention:
            batch.pop("attention_mask", None)  # padding targets are ignored; causality keeps them out of the rest
        elif "attention_mask" not in batch:
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch


def document_position_ids(input_ids: torch.Tensor, eod_token_id: int) -> torch.Tensor:
    """Position of each token within its document: 0 at the window start and right after every EOS."""
    index = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eod_token_id
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values


def collate_packed(samples: list[dict], pad_token_id: int, masking: DocumentMasking | None = None) -> dict:
    """Stack windows; only a short final window is padded (padding masked out of attention and loss)."""
    batch = _stack_windows(samples, pad_token_id)
    return masking.apply(batch) if masking is not None else batch


def _stack_windows(samples: list[dict], pad_token_id: int) -> dict:
    length = max(s["input_ids"].shape[0] for s in samples)
    if all(s["input_ids"].shape[0] == length for s in samples):
        return {key: torch.stack([s[key] for s in samples]) for key in ("input_ids", "shift_labels")}
    batch = {
        "input_ids": torch.full((len(samples), length), pad_token_id, dtype=torch.long),
        "shift_labels": torch.full((len(samples), length), -100, dtype=torch.long),
        "attention_mask": torch.zeros((len(samples), length), dtype=torch.long),
    }
    for row, sample in enumerate(samples):
        n = sample["input_ids"].shape[0]
        batch["input_ids"][row, :n] = sample["input_ids"]
        batch["shift_labels"][row, :n] = sample["shift_labels"]
        batch["attention_mask"][row, :n] = 1
    return batch
