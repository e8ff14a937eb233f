"""The batch contract shared by data, engines and the loop: targets, the ignore index, token counts, and what a
forward hands back (`HeadOutput`), on either batch convention.

Packed batches carry `shift_labels` (target of position j is the next token). Batches from a user DataLoader follow
the HF convention: `labels` aligned with `input_ids`, -100 to ignore; they are shifted here. Targets that fall on
padding (attention_mask 0) are ignored too. The loss is returned as a sum with its target count, so accumulation and
ranks can average over tokens exactly. Every reader of a forward's result asks its `HeadOutput`, never the tensor's
shape, since a chunked head never makes the full logits (docs/architecture.md, and docs/long-context.md, 'The chunked
loss').
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

IGNORE = -100
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
SOURCE = "source"  # a mixture's batches: each row's source (data/mixture.py), for per-source losses


@dataclass
class HeadCall:
    """What a forward asks of a loss-computing head (`lm_head(hidden, call=...)`) and the row losses it returns."""
    targets: torch.Tensor
    per_token: bool = False                   # each target's loss (scoring, no backward) instead of the sums
    rows: bool = False                        # each row's loss sum too (a mixture's per-source losses)
    input_ids: torch.Tensor | None = None     # the tokens and positions, for multi-token prediction's depths
    position_ids: torch.Tensor | None = None
    row_losses: torch.Tensor | None = None    # filled by the head when `rows`: each row's loss sum, no gradient
    shapes_only: bool = False                 # a pipeline schedule's shape inference, no micro-batch of the run

    @classmethod
    def of(cls, batch: dict, per_token: bool = False) -> "HeadCall":
        return cls(batch_targets(batch), per_token, SOURCE in batch, batch["input_ids"], batch.get("position_ids"))


@dataclass
class HeadOutput:
    """A forward's result: the logits, or the sums a head that computes the loss returned (`[loss sum, correct
    predictions(, z sum)]`, the first carrying the gradient; or each target's loss under `per_token`)."""
    logits: torch.Tensor | None = None
    summed_loss: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    z_sum: torch.Tensor | None = None          # the head's output z-loss sum; its gradient rides on the loss's
    token_losses: torch.Tensor | None = None
    row_losses: torch.Tensor | None = None

    @classmethod
    def of(cls, output: torch.Tensor, head_computes_loss: bool, call: HeadCall | None = None) -> "HeadOutput":
        """The typed result of a head's output tensor, where the caller knows which kind of head ran."""
        if not head_computes_loss or call is None:
            return cls(logits=output)
        if call.per_token:
            return cls(token_losses=output)
        return cls(summed_loss=output[0], correct=output[1], z_sum=output[2] if len(output) > 2 else None,
                   row_losses=call.row_losses)

    def first_positions(self, length: int) -> "HeadOutput":
        """This output for a batch's own `length` positions, where the forward ran a right-padded one."""
        cut = {name: getattr(self, name)[:, :length] for name in ("logits", "token_losses")
               if getattr(self, name) is not None}
        return dataclasses.replace(self, **cut)

    def whole(self) -> "HeadOutput":
        """This output with every tensor-parallel field (a DTensor) gathered into a plain tensor."""
        return HeadOutput(**{name: value.full_tensor() if hasattr(value, "full_tensor") else value
                             for name, value in vars(self).items()})

    def loss_sum(self, targets: torch.Tensor) -> torch.Tensor:
        """The summed token loss (with its gradient)."""
        if self.summed_loss is not None:
            return self.summed_loss
        logits = self.logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE, reduction="sum")

    def correct_count(self, targets: torch.Tensor) -> torch.Tensor:
        if self.correct is not None:
            return self.correct
        return ((self.logits.argmax(-1) == targets) & (targets != IGNORE)).sum()

    def each_token_loss(self, targets: torch.Tensor) -> torch.Tensor:
        """Each target's negative log-likelihood, `[batch, seq]` in fp32 (0 where ignored)."""
        if self.token_losses is not None:
            return self.token_losses.float() * (targets != IGNORE)
        logits = self.logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE,
                               reduction="none").view(targets.shape)

    def row_loss_sums(self, targets: torch.Tensor) -> torch.Tensor | None:
        """Each row's loss sum (no gradient); None where the head ran without the rows (a pipeline's)."""
        if self.row_losses is not None:
            return self.row_losses
        return self.each_token_loss(targets).detach().sum(-1) if self.logits is not None else None

    def z_loss_sum(self, targets: torch.Tensor) -> torch.Tensor:
        """The sum over valid targets of logsumexp(logits)^2 (PaLM's output z-loss, before its coefficient)."""
        if self.z_sum is not None:
            return self.z_sum
        valid = (targets != IGNORE).reshape(-1)
        log_norm = torch.logsumexp(self.logits.float().reshape(-1, self.logits.shape[-1]), dim=-1)
        return (log_norm.square() * valid).sum()


# A forward returns it through DDP, FSDP and DeepSpeed, which find an output's tensors (to hook backward) as a pytree.
pytree.register_dataclass(HeadOutput)


def batch_targets(batch: dict) -> torch.Tensor:
    if "shift_labels" in batch:
        return batch["shift_labels"]
    targets = F.pad(batch.get("labels", batch["input_ids"])[:, 1:], (0, 1), value=IGNORE)
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


def forward_head(model: torch.nn.Module, batch: dict, takes_call: bool, per_token: bool = False) -> HeadOutput:
    """A device batch's forward: the logits, or, for a model whose forward hands its head a call
    (`models.chunked_loss.install_head_call`), what the head returns for the batch's targets."""
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if not takes_call:
        return HeadOutput(logits=model(**inputs, use_cache=False).logits)
    return model(**inputs, head_call=HeadCall.of(batch, per_token))


def loss_sum(output: HeadOutput, targets: torch.Tensor) -> torch.Tensor:
    """A forward's summed token loss: the loop's loss function where no extension or hook adds to it."""
    return output.loss_sum(targets)


def depth_targets(batch: dict, depth: int) -> torch.Tensor:
    """The targets of multi-token prediction depth `depth` (docs/multi-token-prediction.md, 'What a depth computes');
    depth 0 is the main targets."""
    targets = batch_targets(batch)
    if depth == 0:
        return targets
    shifted = F.pad(targets[:, depth:], (0, depth), value=IGNORE)
    positions = batch.get("position_ids")
    if positions is not None:
        # each token's document in its row: positions restart at 0 with every document (packed windows with
        # reset_position_ids); positions that never restart make each row one document
        starts = positions.expand_as(targets).clone() == 0
        starts[..., 0] = True
        documents = starts.long().cumsum(dim=-1)
        same = F.pad(documents[:, depth:], (0, depth), value=-1) == documents
        shifted = shifted.masked_fill(~same, IGNORE)
    return shifted


def depth_inputs(input_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """The tokens `depth` ahead of each position (0 past the window's end, where no target is kept)."""
    return F.pad(input_ids[:, depth:], (0, depth), value=0)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def cut_windows(batch: dict, length: int) -> dict:
    """A packed batch of `[rows, L]` windows as `[rows x L/length, length]` ones: each window cut into consecutive
    shorter ones over the same tokens and targets (a sequence-length stage, config/seq_stages.py). Positions that
    restart at every document (reset_position_ids) restart at each short window's start too, as a run at `length`
    would have them; a mixture's row sources follow their rows. A batch of shorter windows (a corpus's last one) is
    padded on the right to whole windows first (causal attention keeps padding out of the tokens before it; its
    targets are ignored), and windows holding nothing but a row's padding are left out."""
    rows, total = batch["input_ids"].shape
    if total <= length:
        return batch
    if "shift_labels" not in batch:
        raise ValueError("seq_length_schedule cuts the run's packed windows (batches with shift_labels); this batch "
                         "has none, so it cannot be cut into a stage's windows")
    pieces = -(-total // length)
    padded = {key: _pad_right(key, value, pieces * length - total) if _is_row_tensor(value, rows, total) else value
              for key, value in batch.items()}
    cut = {key: value.reshape(rows * pieces, length) if _is_row_tensor(value, rows, pieces * length) else value
           for key, value in padded.items()}
    positions = cut.get("position_ids")
    if positions is not None:
        # the first document of a window continues one begun before it: its positions restart at the window start
        before_first_start = (positions[:, 1:] == 0).cumsum(dim=1) == 0
        first = F.pad(before_first_start, (1, 0), value=True)
        cut["position_ids"] = torch.where(first, positions - positions[:, :1], positions)
    if SOURCE in batch:
        cut[SOURCE] = batch[SOURCE].repeat_interleave(pieces)
    keep = cut["attention_mask"].any(dim=1) if "attention_mask" in cut else None  # not only a row's padding
    if keep is not None and not bool(keep.all()):
        cut = {key: value[keep] if isinstance(value, torch.Tensor) and value.shape[:1] == keep.shape else value
               for key, value in cut.items()}
    return cut


def _is_row_tensor(value, rows: int, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2 and tuple(value.shape) == (rows, length)


def _pad_right(key: str, value: torch.Tensor, extra: int) -> torch.Tensor:
    """`extra` positions of padding after a row tensor: ignored targets, masked-out inputs."""
    if not extra:
        return value
    return F.pad(value, (0, extra), value=IGNORE if key in ("shift_labels", "labels") else 0)
