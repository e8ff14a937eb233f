"""Mixture-of-Experts routing as the loop sees it: balancing losses, expert bias updates and routing counts.

`MoeRouting` hooks every router (the module whose output the model names for `router_logits`), so it needs no
per-family code and works through any engine that keeps the modules. Padding, evaluation forwards and recomputations
count nowhere; a recomputation still computes the losses and drops them, since the checkpoint checks that it saves
what the forward did. The rules and why they are so: docs/moe.md, 'The knobs' and 'On the megatron engine: tp x ep'.
"""

from __future__ import annotations

import collections
import functools
import math

import torch
import torch.distributed as dist

from ..config import ConfigError, MoeSettings, key_error


class MoeRouting:
    def __init__(self, model: torch.nn.Module, settings: MoeSettings):
        self.settings = settings
        self.experts_implementation = select_experts_implementation(model, settings.experts_implementation)
        self.routers = find_routers(model)
        self.sigmoid_scores = [hasattr(router, "e_score_correction_bias") for router in self.routers]
        if settings.expert_bias_update_rate and not all(self.sigmoid_scores):
            raise key_error("moe_expert_bias_update_rate", f"{type(self.routers[0]).__name__} has no per-expert "
                            "routing bias (e_score_correction_bias, as DeepSeek-V3's router) for aux-loss-free "
                            "balancing to move; use moe_aux_loss_coeff with this model")
        self._weight: torch.Tensor | float = 0.0  # of one unit's balancing losses in the step's gradient
        self._rows = 0                            # sequences of the micro-batch being run
        self._valid: torch.Tensor | None = None   # its tokens (1) and padding (0) as this rank routes them
        self._stand_in = False                    # the forward running is a pipeline's shape inference
        # per layer, the masks of recorded router calls not yet replayed: a recomputation must use its own forward's
        # mask, and a pipeline schedule runs other micro-batches' forwards in between (each stage replays them in order)
        self._replays = [collections.deque() for _ in self.routers]
        self._recording = False
        self._pending: list[torch.Tensor] = []
        self._step_counts: torch.Tensor | None = None      # [layers, experts] tokens routed this step
        self._interval_counts: torch.Tensor | None = None  # the same, over the logging interval
        # [aux sum, z sum, dropped, routed] over layers and the interval (device), and what the host knows: units
        self._interval_sums: torch.Tensor | None = None
        self._interval_units = 0.0
        self._split_group, self._split = None, 1  # see split_sequences
        self._attach = False  # see attach_losses
        self._start_hooks = []
        self.watch_forwards([model])
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._routed, layer))

    def watch_forwards(self, modules: list[torch.nn.Module]) -> None:
        """Start each micro-batch where it enters these modules (their first argument has its rows first): the
        model, or an engine's pipeline stages."""
        for handle in self._start_hooks:
            handle.remove()
        self._start_hooks = [m.register_forward_pre_hook(self._start_forward, with_kwargs=True) for m in modules]
        # a replay inside backward (activation checkpointing) runs after the forward: it records nothing
        self._start_hooks += [m.register_forward_hook(self._end_forward) for m in modules]

    def attach_losses(self) -> None:
        """Under a pipeline schedule, each router call's weighted balancing losses ride on its routing weights
        (Megatron's MoEAuxLossAutoScaler; docs/moe.md, 'On the megatron engine: tp x ep')."""
        self._attach = True

    def split_sequences(self, group) -> None:
        """Each sequence's tokens are routed in parts, one on each rank of `group` (None: whole sequences)."""
        self._split_group = group
        self._split = dist.get_world_size(group) if group is not None else 1

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def trains_balancing_losses(self) -> bool:
        return bool(self.settings.aux_loss_coeff or self.settings.z_loss_coeff)

    def begin_step(self, unit_weight: torch.Tensor | float) -> None:
        """`unit_weight`: the factor of one unit's losses (the engine's `mean_weight` of the global batch's units)."""
        self._weight = unit_weight
        for queue in self._replays:
            queue.clear()

    def take_losses(self) -> torch.Tensor | None:
        """The balancing losses of the forward just run (weighted, to add to its scaled loss); ends recording."""
        self._recording = False
        if not self._pending:
            return None
        total = torch.stack(self._pending).sum()
        self._pending = []
        return total

    # -------------------------------------------------------------- hooks
    def _start_forward(self, module, args, kwargs) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        self._rows = int(input_ids.shape[0]) if input_ids is not None else 1
        self._recording = module.training and torch.is_grad_enabled()
        self._pending = []
        if self._recording and getattr(module, "infers_shapes", False):  # a pipeline schedule's shape inference:
            self._recording, self._valid, self._stand_in = False, None, True
            return
        mask = kwargs.get("attention_mask")
        if mask is not None and self._split > 1:  # this rank's part of each sequence (sequence parallelism)
            mask = mask.chunk(self._split, dim=1)[dist.get_rank(self._split_group)]
        self._valid = mask.reshape(-1) if mask is not None else None

    def _end_forward(self, module, args, output) -> None:
        self._recording = self._stand_in = False

    def _routed(self, layer: int, module, args, output):
        if not (module.training and torch.is_grad_enabled()):  # evaluation (dropless, as the exported model)
            return None
        logits, weights, indices = output[0], output[1], output[2]
        experts, top_k = self.settings.shape.experts, self.settings.shape.top_k
        tokens = logits.shape[0]
        units = self._rows if self.settings.aux_loss_type == "seq" else 1
        if self._recording:
            valid = self._valid if self._valid is not None and self._valid.numel() == tokens else None
            valid = valid.to(device=logits.device, dtype=torch.bool) if valid is not None else None
            self._replays[layer].append(valid)
        else:  # a replay inside backward takes its forward's mask; the shape inference, none
            queue = self._replays[layer]
            valid = queue.popleft() if queue and not self._stand_in else None
        # a recomputation runs the same operations (the checkpoint requires it) and keeps nothing
        s = self.settings
        with torch.set_grad_enabled(self.trains_balancing_losses):  # else for the metrics only
            aux, z = balancing_losses(logits.float().reshape(units, tokens // units, experts),
                                      indices.reshape(units, -1), top_k, self.sigmoid_scores[layer],
                                      self._split_group, self._split,
                                      valid.view(units, -1) if valid is not None else None)
            weighted = (s.aux_loss_coeff * aux.sum() + s.z_loss_coeff * z.sum()) * self._weight
        kept = None
        if s.capacity_factor is not None:  # an expert over capacity drops tokens: their weight becomes 0
            per_expert = weights.shape[-1] == experts != top_k  # weights over all experts (GPT-OSS), not per slot
            chosen = indices.reshape(-1, top_k)
            slot_weights = weights.gather(-1, chosen) if per_expert else weights.reshape(-1, top_k)
            kept = capacity_mask(slot_weights, chosen, experts, s.capacity_factor, s.drop_policy, valid)
            mask = torch.zeros_like(weights, dtype=torch.bool).scatter_(-1, chosen, kept) if per_expert \
                else kept.view(weights.shape)
            output = (output[0], weights * mask.to(weights.dtype), *output[2:])
        if not self._recording:
            return output if kept is not None else None
        if self.trains_balancing_losses and self._attach:
            output = (output[0], AddToBackward.apply(output[1], weighted), *output[2:])
        elif self.trains_balancing_losses:
            self._pending.append(weighted)
        # scatter_add_, not bincount (which reads the largest index on the host): nothing here waits for the device
        flat = indices.reshape(-1)
        counted = valid.repeat_interleave(top_k).long() if valid is not None else torch.ones_like(flat)
        self._counts(logits.device)[layer].scatter_add_(0, flat, counted)
        dropped = (~kept).reshape(-1).long().mul(counted).sum() if kept is not None \
            else torch.zeros((), device=logits.device)
        self._sums(logits.device).add_(torch.stack([aux.detach().sum(), z.detach().sum(), dropped,
                                                    counted.sum()]).double())
        self._interval_units += units / self._split  # each rank of a split holds a part of the same units
        return output if kept is not None or self._attach else None

    def keep_counts_on(self, device: torch.device) -> None:
        """Hold the counts on `device` from the start: a rank whose pipeline stages route no token (DeepSeek-V3's
        dense first layers) still takes part in every reduction of them, with zeros."""
        self._counts(device)
        self._sums(device)

    def _counts(self, device) -> torch.Tensor:
        if self._step_counts is None:
            self._step_counts = torch.zeros(self.layers, self.settings.shape.experts, dtype=torch.int64, device=device)
            self._interval_counts = torch.zeros_like(self._step_counts)
        return self._step_counts

    def _sums(self, device) -> torch.Tensor:
        if self._interval_sums is None:
            self._interval_sums = torch.zeros(4, dtype=torch.float64, device=device)
        return self._interval_sums

    # --------------------------------------------------- after the step
    @torch.no_grad()
    def end_step(self, reduce_sum, applied: bool) -> None:
        """Move the step's counts into the interval's; with bias updates (and the update applied), step each
        router's bias from the counts summed over ranks (`reduce_sum`: the engine's all-reduce)."""
        if self._step_counts is None:
            return
        rate = self.settings.expert_bias_update_rate
        if rate and applied:
            load = reduce_sum(self._step_counts.double())
            for router, layer_load in zip(self.routers, load):
                bias = router.e_score_correction_bias
                bias += (rate * torch.sign(layer_load.mean() - layer_load)).to(bias.dtype)
        self._interval_counts += self._step_counts
        self._step_counts.zero_()

    def interval_row(self, reduce_sum) -> dict:
        """The routing metrics of the interval since the last call, over all ranks (one all-reduce)."""
        if self._interval_counts is None:
            return {}
        host = torch.tensor([self._interval_units], dtype=torch.float64, device=self._interval_sums.device)
        both = reduce_sum(torch.cat([self._interval_counts.double().flatten(), self._interval_sums, host]))
        self._interval_counts.zero_()
        self._interval_sums.zero_()
        self._interval_units = 0.0
        counts = both[:-5].view(self.layers, -1)
        aux, z, dropped, routed, units = both[-5:].tolist()
        row = routing_balance(counts)
        row.update({"moe_aux_loss": aux / max(units, 1.0), "moe_z_loss": z / max(units, 1.0)})
        if self.settings.capacity_factor is not None:
            row["moe_dropped_fraction"] = dropped / max(routed, 1.0)
        return row


class AddToBackward(torch.autograd.Function):
    """The identity on `carrier`; its backward also starts `loss`'s backward, with gradient 1."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype = loss.dtype
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


def balancing_losses(logits: torch.Tensor, chosen: torch.Tensor, top_k: int, sigmoid_scores: bool,
                     split_group=None, split: int = 1, valid: torch.Tensor | None = None):
    """Per unit (rows of `logits` [units, tokens, experts]; `chosen` [units, tokens * top_k]: the experts picked): the
    load-balancing loss and the z-loss of docs/moe.md, 'The knobs'; `valid` [units, tokens]: the tokens that count.
    With each unit's tokens split over the `split` ranks of `split_group` (docs/moe.md, 'On the megatron engine'),
    the returned values are this rank's parts of the unit's losses: they add up over the group."""
    units, tokens, experts = logits.shape
    if sigmoid_scores:
        scores = logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)
    else:
        probs = logits.softmax(-1)
    weight = valid.to(logits.dtype) if valid is not None else torch.ones(units, tokens, device=logits.device)
    counts = torch.zeros(units, experts, device=logits.device).scatter_add_(
        1, chosen, weight.repeat_interleave(top_k, dim=1))
    counts = torch.cat([counts, weight.sum(1, keepdim=True)], dim=1)  # and the unit's tokens, T
    if split_group is not None:
        dist.all_reduce(counts, group=split_group)
    counts, whole = counts[:, :-1], counts[:, -1].clamp(min=1)
    aux = experts / (top_k * whole * whole) * (counts * (probs * weight.unsqueeze(-1)).sum(1)).sum(-1)
    z = (torch.logsumexp(logits, dim=-1).square() * weight).sum(-1) / whole
    return aux, z


def capacity_mask(weights: torch.Tensor, indices: torch.Tensor, experts: int, factor: float,
                  policy: str, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Which of the (token, slot) assignments [tokens, top_k] an expert takes under `moe_capacity_factor`
    (docs/moe.md, 'The knobs'); with `valid` [tokens], padding takes no place and is never kept."""
    tokens, top_k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(-weights.detach().reshape(-1).float(), stable=True) if policy == "probs" \
        else torch.arange(flat.numel(), device=flat.device)
    if valid is None:
        capacity = math.ceil(factor * tokens * top_k / experts)
    else:  # padding after every token in each queue; a tensor capacity (nothing waits for the device)
        capacity = torch.ceil(factor * valid.sum() * top_k / experts)
        padding = ~valid.repeat_interleave(top_k)
        order = order[torch.argsort(padding[order].byte(), stable=True)]
    queue = order[torch.argsort(flat[order], stable=True)]  # by expert, in the policy's order within each
    per_expert = torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    starts = per_expert.cumsum(0) - per_expert
    place = torch.arange(flat.numel(), device=flat.device) - starts[flat[queue]]  # place in its expert's queue
    kept = torch.empty_like(flat, dtype=torch.bool)
    kept[queue] = place < capacity
    if valid is not None:
        kept &= valid.repeat_interleave(top_k)
    return kept.view(tokens, top_k)


def routing_balance(counts: torch.Tensor) -> dict:
    """`moe_load_imbalance`: the largest over layers of (max / mean tokens per expert), 1.0 when even;
    `moe_dead_experts`: (layer, expert) pairs that got no token; `moe_layer_imbalance`: each layer's ratio."""
    routed = counts[counts.sum(-1) > 0]
    if routed.numel() == 0:
        return {}
    per_layer = routed.max(-1).values / routed.mean(-1)
    return {"moe_load_imbalance": float(per_layer.max()), "moe_dead_experts": int((routed == 0).sum()),
            "moe_layer_imbalance": [round(float(v), 4) for v in per_layer]}


def select_experts_implementation(model: torch.nn.Module, requested: str) -> str:
    """Set how the model's experts compute (`auto`: transformers' choice, kept); returns the one that runs."""
    if requested != "auto":
        try:
            model.set_experts_implementation(requested)
        except (ValueError, ImportError, RuntimeError) as exc:
            raise key_error("moe_experts_implementation", f"{requested} cannot run here: {exc}") from None
    return str(getattr(model.config, "_experts_implementation", None) or "eager")


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every router of an HF MoE model, in layer order: the class the model records `router_logits` from."""
    recorder = getattr(model, "_can_record_outputs", None) or {}
    target = recorder.get("router_logits")
    router_class = getattr(target, "target_class", None)
    if router_class is None:
        raise ConfigError(f"{type(model).__name__} declares experts but names no router module (its "
                          "_can_record_outputs has no router_logits entry); pretrainer trains the transformers MoE "
                          "models that do (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...)")
    routers = [module for module in model.modules() if isinstance(module, router_class)]
    if not routers:
        raise ConfigError(f"{type(model).__name__} has no {router_class.__name__} module")
    return routers


def idle_expert_parameters(model: torch.nn.Module, shape) -> int:
    """Parameters of the routed experts a token does not go through: all of theirs but top_k / experts (the
    figure FLOPs per token leave out, in the run and in the planner). `shape`: the config's ExpertShape."""
    routed = sum(p.numel() for name, p in model.named_parameters()
                 if ".experts." in name and p.dim() >= 2 and p.shape[0] == shape.experts)
    return round(routed * (1 - shape.top_k / shape.experts))


def find_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every routed-experts module of an HF MoE model, in layer order: one MoE layer's fused expert weights
    ([experts, ...] 3-D tensors, transformers' experts interface), not its shared experts (plain MLPs)."""
    found = []
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        own = list(module.parameters(recurse=False))
        if (isinstance(experts, int) and any(p.dim() == 3 for p in own)
                and all(p.dim() >= 2 and p.shape[0] == experts for p in own)):
            found.append(module)
    return found
