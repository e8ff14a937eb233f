"""DeepSpeed ZeRO stages 1-3 (with optimizer/parameter offload, bf16/fp16) behind the Engine interface.

Driven by a DeepSpeed JSON (`deepspeed: path.json`, or what an `accelerate launch` DeepSpeed config put in the
environment) whose "auto" values are filled from the pretraining config. The JSON's own optimizer and scheduler blocks
are used when present; otherwise the run's AdamW groups and schedule are handed to DeepSpeed. DeepSpeed owns
accumulation boundaries, clipping, loss scaling and the schedule step: the loop's calls map onto its `backward`/`step`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import warnings

import torch

from ..config import ConfigError
from ..config.names import parameter_name
from ..models import has_meta_tensors, materialize
from .deepspeed_config import DeepSpeedSettings, read_deepspeed_settings
from .deepspeed_plan import DeepSpeedTraits
from .engine import Engine
from .layout import HeldState, tensor_bytes
from .parallelize import parallelize

logger = logging.getLogger(__name__)

# DeepSpeed's ZeRO calls these torch.distributed functions on every bucket; torch 2.13 marks them deprecated (same
# behaviour, new names) and the FutureWarning, printed from each call site on every rank, drowned a ZeRO-3 log.
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def silence_deprecated_collectives() -> None:
    if not any(f[1] is not None and f[1].pattern == DEPRECATED_COLLECTIVES for f in warnings.filters):
        warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning)
        logger.info("torch's FutureWarnings for all_gather_into_tensor/reduce_scatter_tensor (deprecated names "
                    "DeepSpeed still calls) are silenced")

CHECKPOINT_TAG = "deepspeed"
def ask_cpuinfo_once() -> None:
    """DeepSpeed's CPU ops ask py-cpuinfo for the CPU flags at each check or load (CPU Adam under offload: 3 times a
    rank at start), each question costing a Python process (~1 s of CPU); the answer cannot change: keep the first."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then reads lscpu itself
        return
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.lru_cache(maxsize=1)(cpuinfo.get_cpu_info)


def require_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise ConfigError("engine deepspeed needs the deepspeed package: pip install 'pretrainer[deepspeed]'") \
            from None


class DeepSpeedEngine(DeepSpeedTraits, Engine):
    """Its traits and its cost model (the planner's answers) are in deepspeed_plan.py."""

    name = "deepspeed"
    shards_parameters = True
    applies_every_update = True  # DeepSpeed's step always updates (only its fp16 loss scaler skips)
    checkpoint_format = "deepspeed"  # its own ZeRO shards, written by save_checkpoint
    checkpoint_needs_same_world_size = True
    supports_async_save = False
    own_keys = (*Engine.own_keys, "deepspeed")

    def __init__(self, options, world, meshes):
        require_deepspeed()
        super().__init__(options, world, meshes)
        self.ds_config = copy.deepcopy(self.settings.config)  # deepspeed.initialize keeps and changes it
        self.model_engine = None

    @classmethod
    def read_settings(cls, args, model_config, world_size: int, dtype: str) -> DeepSpeedSettings:
        require_deepspeed()
        return read_deepspeed_settings(args, world_size, dtype, getattr(model_config, "hidden_size", None))

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError("DeepSpeed wraps model, optimizer and schedule together: use setup()")

    def setup(self, model, optimizer, scheduler, build_optimizer, build_scheduler):
        import deepspeed

        ask_cpuinfo_once()
        if self.settings.filled and self.is_main:
            logger.info("DeepSpeed config: filled %s", ", ".join(f"{k}={v}" for k, v in self.settings.filled.items()))
        model = parallelize(model, self.parallelism(data_parallel=self._materialize))
        # (A user optimizer never reaches here: it would hold unsharded parameters; PreTrainer refuses it.)
        if "optimizer" not in self.ds_config:
            optimizer = build_optimizer(model)  # our AdamW groups (no decay on norms/biases/embeddings)
        if "scheduler" in self.ds_config:  # the JSON's scheduler wins over lr_decay_style, as in the HF Trainer
            logger.info("using the DeepSpeed config's scheduler %s (lr_decay_style is not used)",
                        self.ds_config["scheduler"].get("type"))
            scheduler = None
        elif scheduler is None:
            # Our schedule; over DeepSpeed's own optimizer when the JSON defines one (a callable it applies).
            scheduler = build_scheduler(optimizer) if optimizer is not None else build_scheduler
        silence_deprecated_collectives()
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
            model_parameters=None if optimizer is not None else [p for p in model.parameters() if p.requires_grad])
        self.model_engine = engine
        return engine, ds_optimizer, ds_scheduler

    def _materialize(self, model: torch.nn.Module) -> torch.nn.Module:
        """DeepSpeed places the model in deepspeed.initialize; a meta-device model is materialised first, under
        ZeRO-3 module by module and partitioned at once (as under zero.Init): no rank holds the whole model."""
        import deepspeed

        if self.settings.zero_stage == 3 and has_meta_tensors(model):
            deepspeed.init_distributed()  # joins the existing process group (as deepspeed.initialize would)
            materialize(model, self.device, self.options.seed, partition=self._partition,
                        parametrization=self.options.parametrization)
        else:
            self.materialize_if_meta(model)
        return model

    def _partition(self, parameters: list[torch.nn.Parameter]) -> None:
        """Shard whole parameters over the ranks as ZeRO-3 parameters (DeepSpeed takes rank 0's values)."""
        import deepspeed

        holder = torch.nn.Module()  # zero.Init converts an existing module's parameters, in place
        for index, parameter in enumerate(parameters):
            if hasattr(parameter, "ds_id"):  # already a ZeRO-3 parameter
                continue
            if self.precision.dtype != "fp32":  # DeepSpeed keeps ZeRO-3 weights in the compute dtype
                parameter.data = parameter.data.to(self.precision.compute_dtype)
            holder.register_parameter(f"p{index}", parameter)
        deepspeed.zero.Init(module=holder, config_dict_or_path=self.ds_config)

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed holds the weights in the compute dtype itself

    def backward(self, loss: torch.Tensor) -> None:
        # The loss is already normalised over the whole accumulation window.
        self.model_engine.backward(loss, scale_wrt_gas=False)
        if not self.model_engine.is_gradient_accumulation_boundary():
            self.model_engine.step()  # advances DeepSpeed's micro-step count; no update off the boundary

    def step(self, model, optimizer, max_norm, skip_nonfinite: bool = True, skip_rule=None):
        # DeepSpeed decides itself: its fp16 loss scaler skips non-finite steps; bf16/fp32 updates are applied.
        skipped_before = self.model_engine.skipped_steps
        self.model_engine.step()  # clips (gradient_clipping), updates, steps the schedule, zeroes grads
        norm = self.model_engine.get_global_grad_norm()
        grad_norm = torch.tensor(float(norm) if norm is not None else float("nan"))
        return grad_norm, self.model_engine.skipped_steps == skipped_before

    def finish_step(self, optimizer, scheduler) -> None:
        pass  # done inside DeepSpeed's step

    def save_own_state(self, folder) -> None:
        self.model_engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, client_state={})

    def load_own_state(self, folder) -> None:
        path, _ = self.model_engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
        if path is None:
            raise ConfigError(f"{folder}: no DeepSpeed checkpoint (tag {CHECKPOINT_TAG!r}) could be loaded")

    def export_tensors(self, model):
        """ZeRO-3 gathers one partitioned parameter at a time (docs/loading.md); stages 1-2: the main rank's copy."""
        if self.settings.zero_stage != 3:
            yield from super().export_tensors(model)
            return
        import deepspeed

        module = self.model_engine.module
        parameters = dict(module.named_parameters(remove_duplicate=False))
        for name, tensor in module.state_dict().items():
            parameter = parameters.get(name)
            if parameter is None or not hasattr(parameter, "ds_id"):
                whole = tensor.detach().cpu()
            else:
                with deepspeed.zero.GatheredParameters([parameter]):
                    whole = parameter.data.detach().cpu().clone() if self.is_main else None
            yield parameter_name(name), whole if self.is_main else None

    def full_state_dict(self, model) -> dict:
        # ZeRO-3: gather the partitions (the seed's export wrote size-0 tensors here)
        state = self.model_engine._zero3_consolidated_16bit_state_dict() if self.settings.zero_stage == 3 else \
            self.model_engine.module.state_dict()
        return {k: v.detach().cpu() for k, v in (state or {}).items()}

    def unwrap(self, model):
        return self.model_engine.module

    def trained_module(self, model):
        return model  # the optimizer is built before deepspeed.initialize wraps the module

    def release(self) -> None:
        super().release()
        self.model_engine = None

    def held_state(self, model, optimizer) -> HeldState:
        """Weights: the module's (ZeRO-3 partitions); optimizer: inner moments and ZeRO's fp32 master partitions."""
        parameters = list(self.model_engine.module.parameters())
        weights = tensor_bytes(getattr(p, "ds_tensor", p) for p in parameters)
        masters = getattr(optimizer, "single_partition_of_fp32_groups", None) or \
            getattr(optimizer, "fp32_partitioned_groups_flat", None) or []
        inner = getattr(optimizer, "optimizer", optimizer)
        moments = super().optimizer_state_bytes(inner)
        dp = self.model_engine.dp_world_size
        return HeldState(weights, moments + tensor_bytes(masters), dp, dp if self.settings.zero_stage >= 1 else 1,
                         isinstance(self.autocast(), torch.autocast))

    def describe(self) -> str:
        return super().describe() + " " + self.settings.describe()
