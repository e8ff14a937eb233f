"""The torch-native backend: data, tensor, sequence, pipeline, context and expert parallelism on PyTorch's own
machinery (DTensor, FSDP2, `torch.distributed.pipelining`), over one device mesh `dp x pp x cp x tp` (meshes.py).

`engine: single | ddp | fsdp | megatron` name this backend's defaults, not different code, and every name takes every
dimension (docs/engines.md). Where the model is split (tp or pp > 1, or always under megatron) each rank builds only
its pipeline stages and the loop holds a `StagedModel`: those modules under the HF model's own names, so optimizer,
DCP checkpoints and HF export all see HF keys. Tensor parallelism leaves MoE blocks whole, so their gradients, like
per-head norms', are summed over tp at the step (docs/moe.md, 'On the megatron engine: tp x ep').
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_module

from ..batch import IGNORE, SOURCE, HeadCall, HeadOutput, batch_targets
from ..config import ConfigError, expert_shape
from ..models import materialize
from ..models.chunked_loss import computes_loss
from ..models.hf_weights import carry_checkpoint
from ..models.mtp import decoder_layer_list
from ..models.registry import parse_model_config
from . import context_parallel
from .activation_checkpoint import RecomputeSettings, decoder_layers
from .engine import Engine, to_device_async
from .expert_parallel import shard_experts
from .megatron_settings import MegatronSettings, read_settings, splits_model, unused_keys
from .parallelize import ExpertSharding, Parallelism, parallelize, replicate_layers, shard_layers
from .pipeline import DecoderStage, PipelineLoss, build_schedule, forward_in_order, split_layers, stages_of_rank
from .splits import get_split, moe_blocks
from .torch_plan import SingleTraits, TorchTraits

logger = logging.getLogger(__name__)


class StagedModel(torch.nn.Module):
    """This rank's stages, presented under the HF model's module names (`model.layers.7...`, `lm_head`)."""

    def __init__(self, hf_model: torch.nn.Module, stages: list[DecoderStage]):
        super().__init__()
        self.config = hf_model.config
        decoder = torch.nn.Module()
        decoder.layers = torch.nn.ModuleDict()
        for stage in stages:
            if stage.embed_tokens is not None:
                decoder.embed_tokens = stage.embed_tokens
            decoder.layers.update(stage.layers)
            if stage.mtp_embed_tokens is not None and not hasattr(decoder, "embed_tokens"):
                decoder.embed_tokens = stage.mtp_embed_tokens  # a copy of the first stage's (see DecoderStage)
            if stage.norm is not None:
                decoder.norm = stage.norm
            if stage.lm_head is not None:
                self.lm_head = stage.lm_head
        decoder.rotary_emb = stages[0].rotary_emb
        self.model = decoder
        object.__setattr__(self, "stages", stages)  # not children: their modules are already registered above
        object.__setattr__(self, "hf_model", hf_model)
        carry_checkpoint(hf_model, self)

    def _init_weights(self, module: torch.nn.Module) -> None:  # materialize() initialises through the HF rules
        self.hf_model._init_weights(module)

    def get_output_embeddings(self) -> torch.nn.Module | None:  # the last stage's head (the optimizer's groups)
        return getattr(self, "lm_head", None)


class TorchEngine(TorchTraits, Engine):
    """The backend; `DDPEngine`, `FSDPEngine` and `MegatronEngine` below are its defaults under their names. Its
    traits and cost models (the planner's answers) are in torch_plan.py and fsdp_plan.py."""

    shards_parameters = True  # FSDP2's fully_shard and replicate both re-create the parameters as DTensors

    def __init__(self, options, world, meshes):
        super().__init__(options, world, meshes)
        self.mesh = meshes.model()
        self.dp_rank, self.pp_rank, self.tp_rank = (self.mesh.get_local_rank(d) for d in ("dp", "pp", "tp"))
        # gradients and token counts are summed over the ranks holding the same parameters: dp x cp
        self.data_mesh = meshes.data()
        self.expert_mesh = meshes.experts() if self.dims.ep > 1 else None
        self._routes_tokens = False  # this rank's stages hold MoE blocks (their routing reads the padding)
        self._tp_partial: list[tuple[torch.nn.Module, str]] = []  # see _sum_partial_gradients_over_tp
        self._experts: list[torch.nn.Module] = []  # the split experts modules of the module being built
        self.units: list[torch.nn.Module] = []  # what data parallelism wrapped: the model, or this rank's stages
        self.stages: list[DecoderStage] = []
        self.stage_ids: list[int] = []
        self.schedule = None
        self.loss_weight = 1.0
        self.pipeline_loss = PipelineLoss()
        self._padding_checked = False
        self._head_loss = False  # the output head computes the loss itself (loss_chunk_size)
        self._has_depths = False  # multi-token prediction depths follow the head (on the last stage)

    @property
    def exports_tensor_by_tensor(self) -> bool:
        # Shards offloaded to host memory cannot be gathered over an accelerator's process group one by one.
        return not (self.settings.cpu_offload and self.device.type != "cpu")

    @property
    def wraps_data_ranks(self) -> bool:
        """Data parallelism wraps modules: over 2+ data ranks, or to offload shards to the host (one process too)."""
        return self.data_mesh.size() > 1 or self.settings.cpu_offload

    def autocast(self):
        """Replicated modules compute under autocast; FSDP2 (sharded) ones are cast by FSDP's mixed-precision policy."""
        if self.settings.distributed_optimizer and self.wraps_data_ranks:
            return contextlib.nullcontext()
        return super().autocast()

    @property
    def context_multiple(self) -> int:
        """Sequence parallelism splits each cp rank's tokens again over tp."""
        return self.settings.tp if self.settings.sequence_parallel else 1

    @classmethod
    def read_settings(cls, args, model_config, world_size: int, dtype: str) -> MegatronSettings:
        """plugin_args (and other_megatron_args) read and checked against what this backend can run."""
        settings = read_settings(args, getattr(model_config, "num_hidden_layers", None), cls.default_strategy(args),
                                 "fsdp_shard_size" in cls.own_keys, cls.stages_always or splits_model(args))
        settings = replace(settings, notices=tuple(unused_keys(args, model_config, settings)))
        if cls.runs_stages(settings):
            check_stages(args, model_config, dtype, settings, cls.name)
        holders = world_size // (settings.tp * settings.pp)  # the data ranks: dp x cp
        if args.expert_parallel_degree > 1 and settings.shard_size not in (None, holders):
            raise ConfigError("key 'fsdp_shard_size': hybrid sharding with expert_parallel_degree > 1 is not "
                              "supported yet; shard over all data ranks (fsdp_shard_size: null)")
        return settings

    @classmethod
    def default_strategy(cls, args) -> str:
        """The data-parallel sharding where the config names none (Megatron-Core's default: replicate)."""
        return "no_shard"

    @classmethod
    def replica_ranks(cls, args) -> int:
        settings = read_settings(args, default_strategy=cls.default_strategy(args), reads_shard_size=False,
                                 stages=False)  # tp and pp are all it needs
        return settings.tp * settings.pp * args.context_parallel_degree

    @classmethod
    def parallel_style(cls, settings: MegatronSettings) -> tuple[bool, str]:
        return settings.sequence_parallel, settings.schedule

    @classmethod
    def recompute(cls, args, settings: MegatronSettings) -> RecomputeSettings:
        return settings.recompute if cls.runs_stages(settings) else super().recompute(args, settings)

    def shard_batch(self, batch: dict) -> dict:
        return self.context.shard(batch, self.options.seq_length if self.settings.pp > 1 else 0) if self.context \
            else batch

    # ------------------------------------------------------------------ model
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Parallelize the HF model as one module, or cut this rank's pipeline stages from it and parallelize each
        (parallelize.py's order); context-parallel attention goes on the whole model first."""
        if self.context:
            context_parallel.install(model, self.context.degree)
        if self.runs_stages(self.settings):
            return self._wrap_stages(model)
        if not any(p.is_meta for p in model.parameters()) and not self.settings.cpu_offload:
            model.to(self.device)
        model = parallelize(model, self._steps())
        self.units = [model]
        # offloaded shards live in host memory: materialise them there
        self.materialize_if_meta(model, torch.device("cpu") if self.settings.cpu_offload else None)
        return model

    def _steps(self, tensor_parallel=None) -> Parallelism:
        steps = self.parallelism(self._data_parallel if self.wraps_data_ranks else None, tensor_parallel)
        return replace(steps, expert_parallel=self._split_experts) if self.expert_mesh is not None else steps

    def _wrap_stages(self, model: torch.nn.Module) -> StagedModel:
        s = self.settings
        shape = parse_model_config(model, self.options.seq_length)
        if self.is_main:
            for notice in s.notices:
                logger.info(notice)
        if s.tp > 1:
            shape.check_tensor_parallel(s.tp)
        shape.check_pipeline(s.num_stages)
        split = get_split(shape.parallel_split)
        parts = split.parts(model)
        ranges = split_layers(shape.num_layers, s.num_stages, s.pipeline_layers)
        self.stage_ids = stages_of_rank(self.pp_rank, s.pp, s.num_stages)
        is_meta = any(p.is_meta for p in model.parameters())
        self._head_loss = computes_loss(parts.lm_head)
        self._has_depths = len(parts.layers) > model.config.num_hidden_layers  # models/mtp.py's, after the head
        if self._has_depths and s.pp > 1:
            self.meshes.pipeline_ends()  # made by every rank, now, in the same order
        tensor_parallel = functools.partial(self._tensor_parallel, split) if s.tp > 1 else None
        for index in self.stage_ids:
            stage = DecoderStage(parts, ranges[index], first=index == 0, last=index == s.num_stages - 1,
                                 config=model.config, tied=not shape.untied_embeddings,
                                 no_split_modules=getattr(model, "_no_split_modules", None))
            if not is_meta:
                stage.to(self.device)
            self._routes_tokens |= bool(moe_blocks(stage))
            self.stages.append(parallelize(stage, self._steps(tensor_parallel)))
        self.units = list(self.stages)
        if not is_meta:
            _release_other_stages(parts, self.stages)
        _run_depths_as_laid_out(model, self.stages)
        view = StagedModel(model, self.stages)
        if is_meta:
            materialize(view, self.device, self.options.seed, parametrization=self.options.parametrization)
            for stage in self.stages:  # to_empty gives tied parameters separate storage: tie them again
                if stage.tied and stage.embed_tokens is not None and stage.lm_head is not None:
                    stage.lm_head.weight = stage.embed_tokens.weight
        self.loss_weight = 1.0 if self.tp_rank == 0 and s.num_stages - 1 in self.stage_ids else 0.0
        if s.pp > 1:
            self._build_schedule()
        logger.info("%s engine: %s; this rank (dp %d, pp %d, tp %d) holds stage(s) %s with layers %s",
                    self.name, s.describe(), self.dp_rank, self.pp_rank, self.tp_rank, self.stage_ids,
                    [f"{ranges[i].start}-{ranges[i].stop - 1}" for i in self.stage_ids])
        return view

    def _build_schedule(self) -> None:
        s = self.settings
        self.pipeline_loss.head_computes_loss = self._head_loss
        for part in (*self.stages, self.pipeline_loss):  # the schedule's first step infers shapes, with a forward
            part.infers_shapes = True                       # of each stage and a loss call
        self.schedule = build_schedule(self.stages, self.stage_ids, s.num_stages, s.schedule, s.num_micro_batches,
                                       self.pipeline_loss, self.device, self.mesh.get_group("pp"))

    def _tensor_parallel(self, split, stage: DecoderStage) -> None:
        """The family's tp layouts on the tp mesh; without sequence parallelism the norms become replicated
        DTensors too, so every parameter lives on the mesh (one optimizer, one norm)."""
        sequence_parallel = self.settings.sequence_parallel
        split.tensor_parallel(stage, self.mesh["tp"], sequence_parallel)
        if not sequence_parallel:
            self._replicate_norms(stage)
        stage.sequence_shards = self.settings.tp if sequence_parallel else 1
        # still-plain parameters see only this tp rank's heads (Qwen3's q/k norms) or tokens (MoE): summed at the step
        self._tp_partial += [(module, name) for module in stage.modules()
                             for name, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]

    def _replicate_norms(self, stage: DecoderStage) -> None:
        """Without sequence parallelism the norms see the whole sequence on every tp rank."""
        # the decoder layer's norms (a per-head norm inside attention sees this rank's heads only), and a
        # multi-token prediction depth's projection (models/mtp.py), which also sees the whole sequence
        norms = [m for layer in stage.layers.values() for name, m in layer.named_modules()
                 if (type(m).__name__.endswith("RMSNorm") and "self_attn" not in name) or name.endswith("eh_proj")]
        if stage.norm is not None:
            norms.append(stage.norm)
        mesh = self.mesh["tp"]
        for norm in norms:
            distribute_module(norm, mesh, output_fn=lambda module, output, device_mesh: output.to_local(),
                              input_fn=lambda module, inputs, device_mesh: tuple(
                                  DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) for x in inputs))

    def _split_experts(self, module: torch.nn.Module) -> None:
        """The routed experts over the ep ranks; their gradients are reduced over the dp / ep ranks holding the
        same ones, where the loop's scale expects an average over dp: 1 / ep evens that out."""
        self._experts = shard_experts(module, self.expert_mesh["ep"],
                                      self.dims.expert_replicas / self.dims.gradient_ranks)

    def _data_parallel(self, module: torch.nn.Module) -> torch.nn.Module:
        """Gradients over dp x cp: all-reduced (`replicate`), or reduce-scattered with the optimizer state sharded
        (FSDP2), each decoder layer and the split experts of each layer their own units."""
        self._start_as_first_data_rank(module)
        layers = list(module.layers.values()) if isinstance(module, DecoderStage) else decoder_layers(module)
        experts = ExpertSharding(self._experts, self.expert_mesh["expert_replicas"]) \
            if self.expert_mesh is not None else None
        if self.settings.distributed_optimizer:  # FSDP's mixed-precision policy casts (no autocast then)
            shard_layers(module, self.meshes.data_sharding(), layers, self.precision,
                         self.settings.reshard_parameters, self.settings.cpu_offload, experts)
        else:
            replicate_layers(module, self.data_mesh, layers, experts)
        return module

    def _start_as_first_data_rank(self, module: torch.nn.Module) -> None:
        """Weights each rank built itself (a user's model, one loaded whole) start as the first data rank's, as DDP's
        broadcast makes them: a rank seeded otherwise would train a replica of its own. Split experts come from the
        first of the ranks holding them; a meta-device model is instead materialised from one seed on every rank."""
        if any(p.is_meta for p in module.parameters()):
            return
        experts = {id(p) for m in self._experts for p in m.parameters()}
        for tensor in (*module.parameters(), *module.buffers()):
            mesh = self.expert_mesh["expert_replicas"] if id(tensor) in experts else self.data_mesh
            group = mesh.get_group()
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            dist.broadcast(local.detach(), src=dist.get_global_rank(group, 0), group=group)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.hf_model if self.stages else model

    def trained_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # staged: this rank's stages only

    def forward_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return list(self.stages) or [model]

    # ------------------------------------------------------------- the step
    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module):
        # sharded: the distributed optimizer's gradients stay sharded (reduce-scattered every micro-batch)
        wrapped = [] if self.options.accumulate == "sharded" else \
            [unit for unit in self.units if hasattr(unit, "set_requires_gradient_sync")]
        for unit in wrapped:
            unit.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for unit in wrapped:
                unit.set_requires_gradient_sync(True)

    def padded_length(self, length: int) -> int:
        """Sequence length a batch is right-padded to: a multiple of tp under sequence parallelism (each rank
        holds an equal slice), and the run's full length under pipelining (stages exchange fixed shapes)."""
        s = self.settings
        if self.context:  # shard_batch made every rank's piece of equal, tp-divisible length already
            return length
        if s.pp > 1:
            length = max(length, self.options.seq_length)
        multiple = s.tp if s.sequence_parallel else 1
        return -(-length // multiple) * multiple

    def _check_padding_side(self, batch: dict) -> None:
        """Stages run causal attention without a padding mask, so padding must come after the tokens. A
        DataLoader pads one way throughout: its first masked batch is checked (the check reads the device)."""
        mask = batch.get("attention_mask")
        if mask is None or self._padding_checked:
            return
        self._padding_checked = True
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ConfigError(f"engine {self.name}'s pipeline stages need right-padded batches (attention_mask "
                              "1...1 0...0 per row); this batch has padding before tokens: set the tokenizer's "
                              "padding_side='right'")

    def forward(self, model: torch.nn.Module, batch: dict, per_token: bool = False) -> HeadOutput | None:
        """What the head returns for a batch (logits, or its loss sums, see chunked_loss.py) on the rank holding
        the last stage; None elsewhere when pipelined."""
        if not self.stages:
            return super().forward(model, batch, per_token)
        self._check_padding_side(batch)
        length = batch["input_ids"].shape[1]
        input_ids = _pad(batch["input_ids"], self.padded_length(length), 0)
        padded = input_ids.shape[1]
        position_ids = batch.get("position_ids")
        if position_ids is not None:
            position_ids = _pad(position_ids, padded, 0)
        # a head that computes the loss, or multi-token prediction's depths after it, are handed the batch
        call = HeadCall(_pad(batch_targets(batch), padded, IGNORE), per_token, SOURCE in batch, input_ids,
                        position_ids) if self._head_loss or self._has_depths else None
        with self.sequence_layout(batch):
            if self.settings.pp == 1:
                # an MoE model's routing reads the padding (the batch's and this engine's own)
                mask = _pad(_attention_mask(batch), padded, 0) if self._routes_tokens else None
                output = self.stages[0](input_ids, position_ids, attention_mask=mask, call=call)
            else:
                output = forward_in_order(self.stage_ids, self.stages, self.settings.num_stages,
                                          self.mesh.get_group("pp"), input_ids.to(self.device), call, self.autocast)
        return None if output is None else HeadOutput.of(output, self._head_loss, call).first_positions(length)

    def forward_backward(self, model, micro_batches: list[dict], loss_fn, scale: float,
                         extra_losses=None) -> torch.Tensor:
        if self.settings.pp == 1:
            return super().forward_backward(model, micro_batches, loss_fn, scale, extra_losses)
        # pipelined, the schedule runs each micro-batch's backward: balancing losses ride on the activations
        # (balancing_losses_on_activations) and `extra_losses` has nothing to hand over
        for batch in micro_batches:
            self._check_padding_side(batch)
        self.pipeline_loss.begin(loss_fn, scale)
        # Every micro-batch gets the same shape (stages exchange fixed-size activations): a short last batch
        # of a user DataLoader gains rows whose targets are all ignored.
        length = self.padded_length(max(b["input_ids"].shape[1] for b in micro_batches))
        rows = max(self.options.micro_batch_size, *(b["input_ids"].shape[0] for b in micro_batches))
        inputs = torch.cat([_pad(b["input_ids"], length, 0, rows) for b in micro_batches])
        targets = torch.cat([_pad(batch_targets(b), length, IGNORE, rows) for b in micro_batches])
        last = self.settings.num_stages - 1
        # a head that computes the loss is handed each micro-batch's targets with its hidden states, and
        # multi-token prediction depths after the head the tokens as well
        stage_inputs = {"targets": targets} if (self._head_loss or self._has_depths) and last in self.stage_ids else {}
        if self._has_depths and last in self.stage_ids:
            stage_inputs["mtp_tokens"] = inputs
        if self._routes_tokens:  # an MoE model's routing reads each micro-batch's padding (every stage is handed it)
            stage_inputs["attention_mask"] = torch.cat([_pad(_attention_mask(b), length, 0, rows)
                                                        for b in micro_batches])
        # return_outputs=False: the schedule would otherwise keep every micro-batch's logits until the next step
        with self.autocast(), self.sequence_layout(micro_batches[0]):
            self.schedule.step(*([inputs] if 0 in self.stage_ids else []),
                               target=targets if last in self.stage_ids else None, return_outputs=False,
                               **stage_inputs)
        return self.pipeline_loss.window_sum(self.device)

    def release(self) -> None:
        super().release()
        self.mesh = self.data_mesh = self.expert_mesh = self.schedule = None
        self.stages, self.units, self._tp_partial = [], [], []

    # ------------------------------------------------------------ Mixture-of-Experts
    @property
    def balancing_losses_on_activations(self) -> bool:
        return self.settings.pp > 1

    @property
    def routing_group(self):
        """Under tensor (and so sequence) parallelism each tp rank routes its own 1/tp of every sequence."""
        return self.mesh.get_group("tp") if self._routes_tokens and self.settings.tp > 1 else None

    def step(self, model, optimizer, max_norm, skip_nonfinite: bool = True, skip_rule=None):
        self._sum_partial_gradients_over_tp(model)
        self._sum_embedding_gradients()
        return super().step(model, optimizer, max_norm, skip_nonfinite, skip_rule)

    def is_replica(self, param: torch.Tensor) -> bool:
        return any(stage.mtp_embed_tokens is not None and param is stage.mtp_embed_tokens.weight
                   for stage in self.stages)

    def _sum_embedding_gradients(self) -> None:
        """Multi-token prediction under pipelining: the first stage's embedding and the last stage's copy sum their
        gradients over the pipeline's two end ranks, so both apply the same update (Megatron's embedding group)."""
        if self.settings.pp == 1 or not self._has_depths:
            return
        group = self.meshes.pipeline_ends()
        if group is None:  # a stage in between holds neither
            return
        held = next(e for stage in self.stages for e in (stage.embed_tokens, stage.mtp_embed_tokens) if e is not None)
        if held.weight.grad is None:  # no gradient reached it here: the other end's is the sum
            held.weight.grad = torch.zeros_like(held.weight)
        grad = held.weight.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)

    def _sum_partial_gradients_over_tp(self, model: torch.nn.Module) -> None:
        """Sum over tp, once per step in one flat all-reduce (docs/moe.md, 'On the megatron engine: tp x ep'), the
        gradients that hold only this tp rank's part: parameters tp left whole but fed this rank's part of the data,
        read by module and name (data parallelism may have replaced them since), and DTensor gradients left Partial
        over tp (sequence-parallel norms), made Replicate so the gradient norm and clipping see their sums."""
        if self.settings.tp == 1:
            return
        plain = [module._parameters[name].grad for module, name in self._tp_partial]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in plain if g is not None]
        partial = []
        for param in model.parameters():
            grad = param.grad
            if isinstance(grad, DTensor) and "tp" in (grad.device_mesh.mesh_dim_names or ()):
                tp_dim = grad.device_mesh.mesh_dim_names.index("tp")
                if grad.placements[tp_dim].is_partial():
                    partial.append((param, tp_dim))
                    local.append(grad.to_local())
        if not local:
            return
        flat = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(flat, group=self.mesh.get_group("tp"))
        for g, summed in zip(local, flat.split([g.numel() for g in local])):
            g.copy_(summed.view_as(g))
        for param, tp_dim in partial:
            grad = param.grad
            placements = list(grad.placements)
            placements[tp_dim] = Replicate()
            param.grad = DTensor.from_local(grad.to_local(), grad.device_mesh, placements, run_check=False,
                                            shape=grad.shape, stride=grad.stride())

    def measured_gradient_ranks(self, model: torch.nn.Module) -> int:
        return self.data_mesh.size()

    def shard_group_size(self) -> int:
        if not self.settings.distributed_optimizer:
            return 1
        mesh = self.meshes.data_sharding()  # its last dimension shards (after `replicate` under hybrid sharding)
        return mesh.size(mesh.ndim - 1)

    @property
    def gradient_holders(self) -> int:
        """The ranks of one pipeline stage: each holds its stage's gradients (or their tp/dp shards)."""
        return self.world_size // self.settings.pp

    # ------------------------------------------------------------ reductions
    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Token counts: the tp and pp ranks of one model replica see the same tokens, so sum over dp (x cp:
        each cp rank counts its own part of the sequences) only."""
        counts = to_device_async(counts, self.device)
        dist.all_reduce(counts, group=self.data_mesh.get_group())
        return counts

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Loss sums: one copy per replica (per cp rank: each holds its tokens' part), from last stage, tp rank 0."""
        value = value * self.loss_weight
        dist.all_reduce(value)
        return value

    def describe(self) -> str:
        cp = f" x cp={self.context.degree}" if self.context else ""
        return super().describe() + f" mesh=(dp={self.dims.dp} x pp={self.settings.pp}{cp} x tp={self.settings.tp}) " \
            + self.settings.describe()


class SingleEngine(SingleTraits, TorchEngine):
    """`engine: single`: the HF model as it is, on one process and device, loaded whole; nothing wraps it."""

    name = "single"
    one_process = True
    own_keys = ()
    shards_parameters = False  # an optimizer built over the model's own parameters is used as it is

    @classmethod
    def read_settings(cls, args, model_config, world_size: int, dtype: str) -> MegatronSettings:
        return MegatronSettings()  # plugin_args' layout is not read here: run/rules.py refuses or warns of it

    @classmethod
    def replica_ranks(cls, args) -> int:
        return args.context_parallel_degree

    def describe(self) -> str:
        return Engine.describe(self)  # nothing is split: no mesh to show


class DDPEngine(TorchEngine):
    """`engine: ddp`: the model (or its stages) replicated over the data ranks, gradients all-reduced."""

    name = "ddp"


class FSDPEngine(TorchEngine):
    """`engine: fsdp`: parameters, gradients and optimizer state sharded over the data ranks (docs/engines.md)."""

    name = "fsdp"
    own_keys = (*Engine.own_keys, "fsdp_reshard_after_forward", "fsdp_cpu_offload", "fsdp_shard_size")

    @classmethod
    def default_strategy(cls, args) -> str:
        return "optim_grads_params" if args.fsdp_reshard_after_forward else "optim_grads"

    @classmethod
    def read_settings(cls, args, model_config, world_size: int, dtype: str) -> MegatronSettings:
        settings = super().read_settings(args, model_config, world_size, dtype)
        if args.fsdp_cpu_offload and cls.runs_stages(settings):
            raise ConfigError(f"key 'fsdp_cpu_offload': fsdp_cpu_offload is not available with engine {cls.name} "
                              "splitting the model over ranks (tp_degree or pp_degree above 1); remove it, or train "
                              "without the split")
        return replace(settings, cpu_offload=args.fsdp_cpu_offload)  # a whole model: always sharded


class MegatronEngine(TorchEngine):
    """`engine: megatron`: Megatron-Core's defaults, the model always run as pipeline stages (docs/megatron.md)."""

    name = "megatron"
    own_keys = (*Engine.own_keys, "fsdp_shard_size")  # hybrid sharding of the distributed optimizer
    stages_always = True


def check_stages(args, model_config, dtype: str, settings: MegatronSettings, name: str) -> None:
    """What pipeline stages cannot run (they run their own forward, not the HF model's)."""
    if dtype == "fp16":
        raise ConfigError(f"dtype fp16 is not available with engine {name}'s pipeline stages (no loss scaler "
                          "across them); use bf16 (or fp32)")
    if model_config is not None and expert_shape(model_config, "the model's config") is not None:
        if settings.tp > 1 and not settings.sequence_parallel:
            raise ConfigError("plugin_args.sequence_parallelism: a Mixture-of-Experts model with tp_degree > 1 "
                              "needs sequence parallelism (each tp rank routes its own part of the tokens, as "
                              "in Megatron-Core); set plugin_args.sequence_parallelism: true")
    if settings.pp > 1 and (args.reset_position_ids or args.reset_attention_mask):
        raise ConfigError("reset_position_ids / reset_attention_mask are not available with pp_degree > 1 "
                          "(positions are not sent between stages); use pp_degree 1")
    if args.compile and settings.tp > 1:
        raise ConfigError("compile: true with tp_degree > 1 is not available: the backward of DTensor "
                          "redistributions through compiled layers fails in this torch version; compile "
                          "works with pp_degree and dp, or set compile: false")


def _run_depths_as_laid_out(model: torch.nn.Module, stages: list[DecoderStage]) -> None:
    """Multi-token prediction depths run from the HF model's layer list (models/mtp.py): it takes the modules the
    last stage laid them out into (wrapped for activation checkpointing)."""
    layers = decoder_layer_list(model) if any(stage.depth_layers for stage in stages) else None
    for stage in stages:
        for name in stage.depth_layers:
            layers[int(name)] = stage.layers[name]


def _release_other_stages(parts, stages: list[DecoderStage]) -> None:
    """A model loaded with weights arrives whole on every rank: free what other pipeline ranks hold."""
    kept = {id(m) for stage in stages for m in stage.modules()}
    for module in (parts.embed_tokens, *parts.layers, parts.norm, parts.lm_head):
        if id(module) not in kept:
            module.to("meta")


def _pad(tensor: torch.Tensor, length: int, value: int, rows: int = 0) -> torch.Tensor:
    """Right-pad [batch, seq] to `length` (targets there are ignored; causal attention hides it from real tokens),
    and below with rows of `value` to `rows`."""
    extra, extra_rows = max(length - tensor.shape[1], 0), max(rows - tensor.shape[0], 0)
    return torch.nn.functional.pad(tensor, (0, extra, 0, extra_rows), value=value) if extra or extra_rows else tensor


def _attention_mask(batch: dict) -> torch.Tensor:
    mask = batch.get("attention_mask")
    return mask if mask is not None else torch.ones_like(batch["input_ids"])
