"""The output head and cross-entropy in chunks of tokens (`loss_chunk_size`), so the `[tokens, vocab]` logits never
exist whole (docs/long-context.md, 'The chunked loss').

Each chunk's loss and its gradients for the hidden states and the head's weight are made at once in forward; backward
only scales the stored gradients. The head's weight is thus used only inside the head's own forward, where every
engine has it whole (FSDP's unsharded parameters, ZeRO-3's gathered ones). A vocab-parallel head's hidden-state
gradient is a partial sum that the tensor-parallel layout reduces in backward.

With an output z-loss (`z_loss_coeff` c) the head returns `[cross-entropy sum, correct, z sum]`, the first entry
carrying the cross-entropy's value and the objective's gradient (as ce + c(z - sg(z)) does), so every engine's
backward trains the z-loss while the logged loss stays the cross-entropy. Handed a `batch.HeadCall` the head computes
the loss; without one (`generate`, a user's call) it returns logits.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..batch import IGNORE, HeadCall, HeadOutput
from ..config import ConfigError

logger = logging.getLogger(__name__)

AUTO_LOGITS_BYTES = 256 * 2**20  # fp32 logits of a micro-batch above this: chunk ("auto")
AUTO_CHUNK_BYTES = 64 * 2**20    # one chunk's fp32 logits under "auto"


@dataclass(frozen=True)
class LossChunk:
    """`loss_chunk_size` resolved for a run: tokens per chunk (0: the plain loss)."""
    size: int
    explicit: bool          # set by the user (a head that cannot chunk is an error), not `auto`
    reason: str = ""        # why `auto` chose the plain loss where the logits are large


def resolve_chunk_size(setting, micro_batch_size: int, seq_length: int, vocab_size: int) -> int:
    """Tokens per chunk (0: off) for `loss_chunk_size` (auto, 0 or a number)."""
    if setting != "auto":
        return int(setting)
    if 4 * micro_batch_size * seq_length * vocab_size <= AUTO_LOGITS_BYTES:
        return 0
    return max(128, AUTO_CHUNK_BYTES // (4 * vocab_size))


def resolve_loss_chunk(setting, micro_batch_size: int, seq_length: int, model_config, custom_loss: bool,
                       vocab_size: int | None = None) -> LossChunk:
    """The run's loss chunk, for `train` and the planner alike: off where a custom loss needs per-token losses
    or the model transforms its logits after the head (an error when the size was given explicitly)."""
    explicit = setting != "auto"
    size = resolve_chunk_size(setting, micro_batch_size, seq_length, vocab_size or model_config.vocab_size)
    if not size:
        return LossChunk(0, explicit)
    reason = ""
    if custom_loss:
        reason = "custom_loss_function needs per-token losses"
    elif any(getattr(model_config, key, None) for key in ("final_logit_softcapping", "logit_scale")):
        reason = "the model transforms the logits after the head (softcapping or scaling)"
    if reason and explicit:
        raise ConfigError(f"loss_chunk_size: not available here ({reason}); set loss_chunk_size: 0")
    return LossChunk(0 if reason else size, explicit, reason)


def install_chunked_loss(model: torch.nn.Module, chunk_size: int, explicit: bool, z_loss_coeff: float = 0.0) -> bool:
    """Make the model's output head compute the loss in chunks of `chunk_size` tokens; False (with a reason
    logged, or an error when the setting was explicit) for heads it cannot replace."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        reason = "its output head is not a bias-free Linear"
        if explicit:
            raise ConfigError(f"loss_chunk_size: this model cannot compute its loss in chunks ({reason}); set "
                              "loss_chunk_size: 0")
        logger.info("chunked loss not used: %s", reason)
        return False
    head.forward = types.MethodType(_chunked_forward, head)
    head.loss_chunk_size = chunk_size
    head.z_loss_coeff = z_loss_coeff
    install_head_call(model)
    logger.info("loss: the output head and cross-entropy run in chunks of %d tokens (loss_chunk_size)", chunk_size)
    return True


def computes_loss(head: torch.nn.Module | None) -> bool:
    """Whether `head` was made to compute the loss itself (`install_chunked_loss`)."""
    return bool(getattr(head, "loss_chunk_size", 0))


def takes_head_call(model: torch.nn.Module) -> bool:
    """Whether the model's forward hands its head a `HeadCall` (`install_head_call`)."""
    return bool(getattr(model, "takes_head_call", False))


def install_head_call(model: torch.nn.Module) -> None:
    """Give the model a forward that runs its decoder, then hands the output head the call (`head_call`) and returns
    a `HeadOutput` (docs/architecture.md); a head that does not compute the loss takes the call too (for MTP)."""
    if takes_head_call(model):
        return
    head = model.get_output_embeddings()
    if not computes_loss(head):
        if not isinstance(head, torch.nn.Linear):
            raise ConfigError(f"the model's output head is a {type(head).__name__}, not a Linear; multi-token "
                              "prediction and the chunked loss need a Linear head")
        head.forward = types.MethodType(_linear_forward, head)
    model.forward = types.MethodType(_forward_with_call, model)
    model.takes_head_call = True


def _forward_with_call(self, input_ids=None, attention_mask=None, position_ids=None, head_call: HeadCall | None = None,
                       **kwargs):
    if head_call is None:  # generate, a user's call: the model's own forward
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  **kwargs)
    inputs = {key: value for key, value in (("attention_mask", attention_mask), ("position_ids", position_ids))
              if value is not None}
    hidden = self.base_model(input_ids=input_ids, use_cache=False, **inputs).last_hidden_state
    head = self.get_output_embeddings()
    return HeadOutput.of(head(hidden, call=head_call), computes_loss(head), head_call)


def _linear_forward(self: torch.nn.Linear, hidden: torch.Tensor, call: HeadCall | None = None) -> torch.Tensor:
    return F.linear(hidden, self.weight, self.bias)


def _chunked_forward(self: torch.nn.Linear, hidden: torch.Tensor, call: HeadCall | None = None) -> torch.Tensor:
    if call is None:
        return F.linear(hidden, self.weight)
    from torch.distributed.tensor import DTensor

    z_coeff = getattr(self, "z_loss_coeff", 0.0)
    rows = [] if call.rows else None  # a mixture's batch: each row's loss, for its source
    if isinstance(self.weight, DTensor):
        out = _vocab_parallel_loss(hidden, self.weight, call.targets, self.loss_chunk_size, call.per_token, z_coeff,
                                   rows)
    else:
        out = LinearCrossEntropy.apply(hidden, self.weight, call.targets, self.loss_chunk_size, None, call.per_token,
                                       z_coeff, rows)
    if rows:
        call.row_losses = rows[0]
    return out


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows [offset, offset + rows) of a head split over `group`."""
    offset: int
    group: object


def _vocab_parallel_loss(hidden, weight, targets: torch.Tensor, chunk: int, per_token: bool,
                         z_coeff: float = 0.0, rows: list | None = None) -> torch.Tensor:
    """The chunked loss of a head whose weight is a DTensor sharded by vocabulary rows over a 1-D mesh; the
    input arrives as the layout's replicated DTensor (sequence-parallel slices already gathered)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = weight.device_mesh
    if mesh.ndim != 1 or not weight.placements[0].is_shard(0):
        raise ConfigError(f"loss_chunk_size: the output head's weight is laid out as {weight.placements} on a "
                          f"{mesh.ndim}-D mesh; chunks need it split by vocabulary rows over one tensor-parallel "
                          "mesh: set loss_chunk_size: 0")
    _, (offset, _) = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    out = LinearCrossEntropy.apply(hidden, weight.to_local(), targets, chunk, VocabShard(offset, mesh.get_group()),
                                   per_token, z_coeff, rows)
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False)


class LinearCrossEntropy(torch.autograd.Function):
    """[sum over tokens of cross_entropy(hidden @ weight.T, targets), correct next-token predictions], ignoring
    IGNORE targets, in chunks (the count is for evaluation; only the sum has a gradient). With a `VocabShard`,
    `weight` holds the shard's rows (docs/long-context.md, 'The chunked loss'). `per_token` (scoring): each
    target's loss instead. With `z_coeff` > 0 a third entry sums logsumexp(logits)^2 over the valid targets, its
    gradient folded into the first's (sum + z_coeff x it). `rows`, a list, receives each row's loss sum."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                shard: VocabShard | None, per_token: bool = False, z_coeff: float = 0.0, rows: list | None = None):
        flat = hidden.reshape(-1, hidden.shape[-1])
        labels = targets.reshape(-1).to(flat.device)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(flat) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        correct = torch.zeros((), dtype=torch.float32, device=flat.device)
        z_sum = torch.zeros((), dtype=torch.float32, device=flat.device)
        each = torch.zeros(labels.shape, dtype=torch.float32, device=flat.device) if per_token else None
        row_sums = torch.zeros(targets.reshape(-1, targets.shape[-1]).shape[0], dtype=torch.float32,
                               device=flat.device) if rows is not None else None
        for start in range(0, flat.shape[0], chunk):
            h, t = flat[start:start + chunk], labels[start:start + chunk]
            logits = F.linear(h, weight).float()
            valid = t != IGNORE
            if shard is None:
                local = t.clamp(min=0)
                log_norm = torch.logsumexp(logits, dim=-1)
                target_logit = logits.gather(1, local[:, None])[:, 0]
                correct += ((logits.argmax(dim=-1) == t) & valid).sum()
                mine = valid
            else:
                log_norm, target_logit, local, mine, best = _shard_statistics(logits, t, valid, shard)
                correct += ((target_logit >= best) & valid).sum()  # the target holds the largest logit
            losses = (log_norm - target_logit) * valid
            total += losses.sum()
            if z_coeff:
                z_sum += (log_norm.square() * valid).sum()
            if per_token:
                each[start:start + chunk] = losses
            if row_sums is not None:  # token j of the flat batch is in row j // seq
                row_sums.index_add_(0, torch.arange(start, start + len(t), device=flat.device) // targets.shape[-1],
                                    losses.detach())
            if want_hidden or want_weight:
                grad_logits = torch.exp(logits - log_norm[:, None])  # softmax, minus one at the target
                if z_coeff:  # d(c lse^2)/d logits = 2 c lse softmax
                    grad_logits *= (1 + 2 * z_coeff * log_norm)[:, None]
                grad_logits.scatter_add_(1, local[:, None], -mine.to(logits.dtype)[:, None])
                grad_logits *= valid[:, None]
                grad_logits = grad_logits.to(h.dtype)
                if want_hidden:
                    grad_hidden[start:start + chunk] = grad_logits @ weight.to(h.dtype)
                if want_weight:
                    grad_weight += (grad_logits.t() @ h).float()
        if rows is not None:
            rows.append(row_sums)
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight) if g is not None))
        ctx.have = (want_hidden, want_weight)
        if per_token:
            return each.view(targets.shape)
        return torch.stack([total, correct, z_sum] if z_coeff else [total, correct])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_total = grad_output[0]
        saved = list(ctx.saved_tensors)
        grad_hidden = (saved.pop(0) * grad_total).reshape(ctx.hidden_shape) if ctx.have[0] else None
        grad_weight = (saved.pop(0) * grad_total).to(ctx.weight_dtype) if ctx.have[1] else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _shard_statistics(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, shard: VocabShard):
    """Over the whole vocabulary, from each rank's rows: (log of the softmax normaliser, the target's logit,
    the target's row in this shard (0 where elsewhere), whether this shard holds it, the largest logit)."""
    rows = logits.shape[1]
    mine = valid & (targets >= shard.offset) & (targets < shard.offset + rows)
    local = torch.where(mine, targets - shard.offset, 0)
    best = logits.max(dim=-1).values
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=shard.group)
    sums = torch.stack([torch.exp(logits - best[:, None]).sum(dim=-1),
                        logits.gather(1, local[:, None])[:, 0] * mine])
    dist.all_reduce(sums, group=shard.group)
    return best + torch.log(sums[0]), sums[1], local, mine, best
