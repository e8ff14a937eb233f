"""The batch contract shared by data, engines and the loop: targets, the ignore index, token counts, logits
and the next-token loss, on either batch convention.

Packed batches carry `shift_labels` (target of position j is the next token).
Batches from a user DataLoader follow the HF convention: `labels` aligned with
`input_ids`, -100 to ignore; they are shifted here. Targets that fall on
padding (attention_mask 0) are ignored too. The loss is returned as a sum with
its target count, so accumulation and ranks can average over tokens exactly.

An output head may compute the loss itself, chunk by chunk, so the full `[batch, seq, vocab]` logits never
exist (`models/chunked_loss.py`): `forward_logits` hands it the batch's targets, and its "logits" are then
`[summed loss, correct predictions]` (`is_head_loss`; a third entry with an output z-loss), which `loss_sum`
and evaluation read; inside
`per_token_losses()` (scoring, no backward) they are each token's loss instead, `[batch, seq]`.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
import torch.nn.functional as F

IGNORE = -100
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
SOURCE = "source"  # a mixture's batches: each row's source (data/mixture.py), for per-source losses
# The batch being forwarded, for an output head that computes the loss itself (its targets are derived
# only when such a head asks: the common path pays nothing).
_forwarded_batch: ContextVar[dict | None] = ContextVar("the batch in forward_logits", default=None)
_token_losses_wanted: ContextVar[bool] = ContextVar("per-token losses from the head", default=False)


def batch_targets(batch: dict) -> torch.Tensor:
    if "shift_labels" in batch:
        targets = batch["shift_labels"]
    else:
        labels = batch.get("labels", batch["input_ids"])
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        mask = batch.get("attention_mask")
        if mask is not None:
            targets = targets.masked_fill(F.pad(mask[:, 1:], (0, 1), value=0) == 0, IGNORE)
    return targets


def count_targets(batch: dict) -> torch.Tensor:
    return (batch_targets(batch) != IGNORE).sum()


def count_inputs(batch: dict) -> int:
    """Useful (non-padding) input tokens of a host batch."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def forward_logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The model's logits for a device batch, or its summed loss when its output head computes it."""
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    with forwarding(batch):
        return model(**inputs, use_cache=False).logits


@contextlib.contextmanager
def _holding(variable: ContextVar, value):
    """`variable` is `value` inside the block."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def forwarding(batch: dict):
    """`batch` is the one being forwarded (for an engine that runs the model's modules itself)."""
    return _holding(_forwarded_batch, batch)


def forwarded_attention_mask() -> torch.Tensor | None:
    """The attention_mask of the batch being forwarded (1: a token, 0: padding); None without one."""
    batch = _forwarded_batch.get()
    return batch.get("attention_mask") if batch is not None else None


class PipelinedMasks:
    """The attention masks of the micro-batches a pipeline schedule is running, handed to each stage's forwards in
    order (a stage runs its micro-batches in order). On a schedule's first step each stage first runs one
    stand-in forward to infer shapes (torch.distributed.pipelining), which is no micro-batch."""

    STAND_IN = "stand-in"

    def __init__(self, masks: list[torch.Tensor], stand_in_first: bool):
        self.masks = masks
        self.stand_in_first = stand_in_first
        self._taken: dict[int, int] = {}

    def take(self, stage: torch.nn.Module) -> torch.Tensor | str:
        """The mask of `stage`'s next micro-batch, or STAND_IN."""
        index = self._taken.get(id(stage), -1 if self.stand_in_first else 0)
        self._taken[id(stage)] = index + 1
        return self.STAND_IN if index < 0 else self.masks[index]


_pipelined_masks: ContextVar[PipelinedMasks | None] = ContextVar("the pipelined micro-batches", default=None)


def pipelining(masks: PipelinedMasks):
    """A pipeline schedule runs the micro-batches `masks` describes."""
    return _holding(_pipelined_masks, masks)


def pipelined_masks() -> PipelinedMasks | None:
    return _pipelined_masks.get()


def head_targets() -> torch.Tensor | None:
    """The targets of the batch being forwarded (None outside `forward_logits`, e.g. in `generate`)."""
    batch = _forwarded_batch.get()
    return batch_targets(batch) if batch is not None else None


def targets_for_head(targets: torch.Tensor):
    """Hand `targets` to an output head that computes the loss itself, for an engine that runs the model's
    modules without `forward_logits` (pipeline stages); the rows' sources, tokens and positions of the batch being
    forwarded stay (per-source losses, multi-token prediction)."""
    outer = _forwarded_batch.get() or {}
    kept = {k: outer[k] for k in (SOURCE, "input_ids", "position_ids") if k in outer}
    return _holding(_forwarded_batch, {"shift_labels": targets, **kept})


_row_losses: list = [None]  # the last head forward's loss sum per row, where its batch carries SOURCE


def forwarded_rows_wanted() -> bool:
    """Whether the batch being forwarded asks for each row's loss sum (it carries each row's source)."""
    batch = _forwarded_batch.get()
    return batch is not None and SOURCE in batch


def keep_row_losses(rows: torch.Tensor) -> None:
    """An output head that computes the loss itself hands over each row's loss sum (no gradient)."""
    _row_losses[0] = rows


def take_row_losses() -> torch.Tensor | None:
    """The row losses the last head forward kept (once)."""
    rows, _row_losses[0] = _row_losses[0], None
    return rows


def forwarded_batch() -> dict | None:
    """The batch being forwarded (None outside `forward_logits`)."""
    return _forwarded_batch.get()


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which document of its row each token is in, from positions that restart at 0 with every document (packed
    windows with reset_position_ids); positions that never restart make each row one document."""
    starts = position_ids == 0
    starts[..., 0] = True
    return starts.long().cumsum(dim=-1)


def depth_targets(batch: dict, depth: int) -> torch.Tensor:
    """The targets of multi-token prediction depth `depth` (k): position i predicts the token k + 1 ahead, which
    is the main target of position i + k, kept only where position i + k is in the window and in the document of
    position i (no depth predicts across a document boundary: a depth's view of the next document starts with its
    own first token, as the main head's). Depth 0 is the main targets."""
    targets = batch_targets(batch)
    if depth == 0:
        return targets
    shifted = F.pad(targets[:, depth:], (0, depth), value=IGNORE)
    positions = batch.get("position_ids")
    if positions is not None:
        documents = document_ids(positions.expand_as(targets).clone())
        same = F.pad(documents[:, depth:], (0, depth), value=-1) == documents
        shifted = shifted.masked_fill(~same, IGNORE)
    return shifted


def depth_inputs(input_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """The tokens `depth` ahead of each position (0 past the window's end, where no target is kept)."""
    return F.pad(input_ids[:, depth:], (0, depth), value=0)


def targets_of_depth(targets: torch.Tensor):
    """Hand a multi-token prediction depth's `targets` to an output head that computes the loss itself (the rows'
    sources stay out: the per-source losses are the main head's)."""
    return _holding(_forwarded_batch, {"shift_labels": targets})


def per_token_losses():
    """Ask an output head that computes the loss itself for each token's loss rather than the sums."""
    return _holding(_token_losses_wanted, True)


def wants_token_losses() -> bool:
    return _token_losses_wanted.get()


def token_losses(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each target's negative log-likelihood, `[batch, seq]` in fp32 (0 where ignored), from a forward's
    logits or from a head's own per-token losses (`per_token_losses`)."""
    if output.dim() == targets.dim():  # the head computed them
        return output.float() * (targets != IGNORE)
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="none").view(targets.shape)


def is_head_loss(output: torch.Tensor) -> bool:
    """Whether a forward's output is an output head's own `[summed loss, correct predictions(, z sum)]`."""
    return output.dim() == 1 and output.shape[0] in (2, 3)


def z_loss_sum(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum over valid targets of logsumexp(logits)^2 (PaLM's output z-loss, before its coefficient), from
    logits or from a head that computed it (`[.., .., z sum]`; its gradient then rides on the loss's)."""
    if is_head_loss(output):
        return output[2]
    valid = (targets != IGNORE).reshape(-1)
    log_norm = torch.logsumexp(output.float().reshape(-1, output.shape[-1]), dim=-1)
    return (log_norm.square() * valid).sum()


def loss_sum(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed token loss of a forward's `output`: logits, or an output head's own `[summed loss, correct]`."""
    if is_head_loss(output):  # the output head computed the summed loss itself (chunked)
        return output[0]
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
