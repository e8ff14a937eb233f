"""Pack tokenized documents into fixed windows, collate them, and mask across documents.

Documents (each `[BOS] text [EOS]`, see `encode`) are concatenated into one stream. Window `i` covers stream tokens
`[i*L, i*L + L]`: `L` inputs and the `L` next tokens as targets, so every token after the first is a target exactly
once. Nothing is padded and nothing is dropped; only the final window may be shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class PackedDataset(torch.utils.data.Dataset):
    """Windows of `seq_length` inputs over the concatenation of documents, each with its pre-shifted targets.
    `documents`: (start offsets, lengths) into `tokens`, in order (None: all of `tokens`, one stream)."""

    def __init__(self, tokens: np.ndarray, seq_length: int, documents: tuple[np.ndarray, np.ndarray] | None = None):
        self.tokens = tokens
        self.seq_length = seq_length
        if documents is None:
            self._starts = self._virtual_ends = None
            self._offset, total = 0, len(tokens)
        else:
            starts, lengths = (np.asarray(a, dtype=np.int64) for a in documents)
            keep = lengths > 0
            starts, lengths = starts[keep], lengths[keep]
            self._virtual_ends = np.cumsum(lengths)
            total = int(self._virtual_ends[-1]) if len(lengths) else 0
            contiguous = len(starts) == 0 or bool(np.all(starts[1:] == starts[:-1] + lengths[:-1]))
            self._starts = None if contiguous else starts
            self._offset = int(starts[0]) if len(starts) else 0
        self.num_tokens = total
        self.num_windows = max(0, -(-(total - 1) // seq_length)) if total > 1 else 0

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> dict:
        start = index * self.seq_length
        window = torch.from_numpy(self._read(start, min(start + self.seq_length + 1, self.num_tokens))
                                  .astype(np.int64))
        return {"input_ids": window[:-1], "shift_labels": window[1:]}

    def _read(self, low: int, high: int) -> np.ndarray:
        """Tokens [low, high) of the documents' concatenation."""
        if self._starts is None:
            return np.asarray(self.tokens[self._offset + low:self._offset + high])
        ends = self._virtual_ends
        document = int(np.searchsorted(ends, low, side="right"))
        pieces = []
        while low < high:
            begin = int(ends[document - 1]) if document else 0
            take = min(high, int(ends[document])) - low
            first = int(self._starts[document]) + (low - begin)
            pieces.append(np.asarray(self.tokens[first:first + take]))
            low += take
            document += 1
        return np.concatenate(pieces)

    @property
    def num_target_tokens(self) -> int:
        return max(0, self.num_tokens - 1)


@dataclass(frozen=True)
class DocumentMasking:
    """Megatron's reset_position_ids / reset_attention_mask for packed windows (docs/data.md, 'Document masking').
    With `attention` the model gets no attention mask, so HF models mask block-diagonally from the restarting
    positions; without it an all-ones mask keeps attention causal over the whole window."""
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
    batch = _stack_tokens(samples, pad_token_id)
    if "source" in samples[0]:  # a mixture's windows: each row's source (data/mixture.py)
        batch["source"] = torch.tensor([s["source"] for s in samples], dtype=torch.long)
    return masking.apply(batch) if masking is not None else batch


def _stack_tokens(samples: list[dict], pad_token_id: int) -> dict:
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
