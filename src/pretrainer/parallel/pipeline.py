"""Pipeline stages cut from an HF decoder, and the schedules that run them (`torch.distributed.pipelining`).

A `DecoderStage` holds a contiguous run of decoder layers and, on the first stage, the embedding, on the last, the
final norm and output head. It runs the layers itself (not the HF model's forward) so a stage can start from hidden
states, and activations between stages are plain local tensors. Its children keep the HF names (`embed_tokens`,
`layers.<global index>`, `norm`, `lm_head`), so the engine presents a rank's stages under the model's state-dict keys.

Stage s of S lives on pipeline rank s % pp (Megatron's interleaved placement): with v virtual stages
per rank, rank r holds stages r, r+pp, r+2pp, ...
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint
from transformers.masking_utils import create_causal_mask

from ..batch import HeadCall, HeadOutput
from ..config import ConfigError
from ..models.registry import pipeline_misfit
from . import context_parallel
from .splits import ModelParts


def split_layers(num_layers: int, num_stages: int, explicit: list | None = None) -> list[range]:
    """Decoder layer indices per stage: `explicit` counts, or as even as possible (earlier stages get the
    extra layers: the last stage also carries the output head)."""
    if explicit is not None:
        counts = list(explicit)
    else:
        problem = pipeline_misfit(num_stages, num_layers, tied=False)
        if problem:
            raise ConfigError(f"{problem}: lower pp_degree or the virtual stages")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    starts = [0, *itertools.accumulate(counts)]
    return [range(start, stop) for start, stop in zip(starts, starts[1:])]


def stages_of_rank(pp_rank: int, pp: int, num_stages: int) -> list[int]:
    return list(range(pp_rank, num_stages, pp))


class DecoderStage(torch.nn.Module):
    def __init__(self, parts: ModelParts, layer_ids: range, first: bool, last: bool, config, tied: bool,
                 no_split_modules):
        super().__init__()
        self.embed_tokens = parts.embed_tokens if first else None
        main = [str(i) for i in layer_ids]
        # the last stage also holds the multi-token prediction depths (models/mtp.py: layers past
        # num_hidden_layers, run by the head's hook, not here)
        depths = range(config.num_hidden_layers, len(parts.layers)) if last else range(0)
        self.layers = torch.nn.ModuleDict({str(i): parts.layers[i] for i in [*layer_ids, *depths]})
        self.main_layers, self.depth_layers = main, [str(i) for i in depths]
        self.norm = parts.norm if last else None
        self.lm_head = parts.lm_head if last else None
        # the depths embed the tokens ahead: a last stage that is not also the first holds a copy of the embedding,
        # its gradient summed with the first stage's at each step (as Megatron-Core's MTP on the last stage)
        self.mtp_embed_tokens = parts.embed_tokens if depths and not first else None
        self.rotary_emb = parts.rotary_emb
        self.config = config
        self.tied = tied
        self._no_split_modules = no_split_modules  # how activation checkpointing finds the layers
        self.sequence_shards = 1  # tp size under sequence parallelism: hidden states hold seq/tp positions
        # the next training forward is the schedule's shape inference, not a micro-batch (set when it is built): MoE
        # routing records nothing of it (models/moe_routing.py); the head's call says so, for the MTP depths
        self.infers_shapes = False
        self.recompute_groups: list[tuple[list[str], bool]] = [(main, False)]

    def set_recompute(self, method: str, num_layers: int | None) -> None:
        """Megatron's full recompute, `uniform` or `block`, over `num_layers` (docs/megatron.md's recompute row)."""
        names = self.main_layers
        if method == "block":
            count = len(names) if num_layers is None else min(num_layers, len(names))
            self.recompute_groups = [([n], True) for n in names[:count]] + \
                ([(names[count:], False)] if count < len(names) else [])
        else:
            size = num_layers or 1
            self.recompute_groups = [(names[i:i + size], True) for i in range(0, len(names), size)]
        for name in self.depth_layers:  # the depths run from the head's hook, each checkpointed on its own
            self.layers[name] = checkpoint_wrapper(self.layers[name])

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, mtp_tokens: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, call: HeadCall | None = None) -> torch.Tensor:
        """Hidden states (token ids on the first stage) to the next stage's, or on the last what its head returns for
        `call`, which the schedule's `targets` (and `mtp_tokens`) become. `attention_mask` (padding) is read only by
        MoE routing hooks: stages attend causally."""
        if self.embed_tokens is not None:
            batch, seq = hidden.shape
            hidden = self.embed_tokens(hidden)
        else:
            batch, seq = hidden.shape[0], hidden.shape[1] * self.sequence_shards
        if position_ids is None:  # a context-parallel rank's tokens sit at their places in the whole window
            position_ids = context_parallel.active_positions(hidden.device)
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
        shape_only = hidden.new_empty((batch, seq, 1))
        mask = create_causal_mask(config=self.config, inputs_embeds=shape_only, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        position_embeddings = self.rotary_emb(shape_only, position_ids=position_ids)
        for names, recompute in self.recompute_groups:
            if recompute and torch.is_grad_enabled():
                hidden = checkpoint(self._run_layers, names, hidden, mask, position_embeddings, position_ids,
                                    use_reentrant=False)
            else:
                hidden = self._run_layers(names, hidden, mask, position_embeddings, position_ids)
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            if call is None and targets is not None:
                call = HeadCall(targets, input_ids=mtp_tokens, shapes_only=self.infers_shapes)
            hidden = self.lm_head(hidden, call=call) if call is not None else self.lm_head(hidden)
        if self.training and torch.is_grad_enabled():
            self.infers_shapes = False
        return hidden

    def _run_layers(self, names, hidden, mask, position_embeddings, position_ids):
        for name in names:
            hidden = self.layers[name](hidden, attention_mask=mask, position_embeddings=position_embeddings,
                                       position_ids=position_ids)
        return hidden


def build_schedule(stage_modules: list[DecoderStage], stage_ids: list[int], num_stages: int, schedule: str,
                   num_micro_batches: int, loss_fn, device: torch.device, group):
    """The `torch.distributed.pipelining` schedule over this rank's stages."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    stages = [PipelineStage(module, index, num_stages, device, group=group)
              for module, index in zip(stage_modules, stage_ids)]
    options = {"n_microbatches": num_micro_batches, "loss_fn": loss_fn, "scale_grads": False}
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, **options)
    if len(stages) != 1:
        raise ConfigError(f"pipeline_schedule {schedule} runs one stage per rank; {len(stages)} were built")
    return (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stages[0], **options)


class PipelineLoss:
    """The loss a pipeline schedule calls on the last stage per micro-batch: the loop's summed token loss, scaled for
    the backward, each sum kept for the step's loss. `infers_shapes`: the next call is the schedule's first-step
    shape inference on a stand-in output: a zero loss, never reaching the loop's loss function or its extensions."""

    def __init__(self) -> None:
        self.loss_fn, self.scale, self.sums = None, 1.0, []
        self.head_computes_loss = self.infers_shapes = False

    def begin(self, loss_fn, scale) -> None:
        """A new accumulation window: `loss_fn(output, targets)` sums a micro-batch's token losses."""
        self.loss_fn, self.scale, self.sums = loss_fn, scale, []

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        call = HeadCall(targets) if self.head_computes_loss else None
        typed = HeadOutput.of(output, self.head_computes_loss, call)
        if self.infers_shapes:
            self.infers_shapes = False
            return typed.loss_sum(targets) * 0
        summed = self.loss_fn(typed, targets)
        self.sums.append(summed.detach())
        return summed * self.scale

    def window_sum(self, device: torch.device) -> torch.Tensor:
        """This rank's summed loss over the window (zero off the last stage)."""
        return sum((summed.double() for summed in self.sums), torch.zeros((), dtype=torch.float64, device=device))


@torch.no_grad()
def forward_in_order(stage_ids: list[int], stages: list[DecoderStage], num_stages: int, group, input_ids,
                     call: HeadCall | None, autocast) -> torch.Tensor | None:
    """Run every stage in order without a schedule, sending hidden states between pipeline ranks (evaluation):
    the last stage's output on the rank holding it, None elsewhere. `group`: the pipeline ranks."""
    pp, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    by_id = dict(zip(stage_ids, stages))
    hidden = None
    shape = (input_ids.shape[0], input_ids.shape[1] // stages[0].sequence_shards, stages[0].config.hidden_size)
    for index in range(num_stages):
        owner, previous = index % pp, (index - 1) % pp
        if index > 0 and owner != previous:
            if pp_rank == previous:
                dist.send(hidden.float().contiguous(), dst=dist.get_global_rank(group, owner), group=group)
            elif pp_rank == owner:
                hidden = torch.empty(shape, dtype=torch.float32, device=input_ids.device)
                dist.recv(hidden, src=dist.get_global_rank(group, previous), group=group)
        if pp_rank == owner:
            with autocast():
                hidden = by_id[index](input_ids if index == 0 else hidden,
                                      call=call if index == num_stages - 1 else None)
    return hidden if num_stages - 1 in stage_ids else None
