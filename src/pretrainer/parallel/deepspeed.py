"""DeepSpeed ZeRO stages 1-3 (with optimizer/parameter offload, bf16/fp16) behind the Engine interface.

Driven by a DeepSpeed JSON (`deepspeed: path.json`, or what an `accelerate launch` DeepSpeed config put in
the environment) whose "auto" values are filled from the pretraining config. The JSON's own optimizer and
scheduler blocks are used when present; otherwise the run's AdamW groups and schedule are handed to
DeepSpeed. DeepSpeed owns accumulation boundaries, clipping, loss scaling and the schedule step, so the
loop's calls map onto `backward`/`step` of the DeepSpeed engine.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..config import ConfigError
from ..models import checkpoint_name, has_meta_tensors, materialize
from .deepspeed_config import (
    config_from_accelerate_env,
    fill_deepspeed_config,
    fill_hidden_size,
    load_deepspeed_config,
    validate_deepspeed_config,
)
from .distributed import DistributedEngine

logger = logging.getLogger(__name__)

CHECKPOINT_TAG = "deepspeed"


class DeepSpeedEngine(DistributedEngine):
    name = "deepspeed"
    shards_parameters = True
    applies_every_update = True  # DeepSpeed's step always updates (only its fp16 loss scaler skips)
    checkpoint_format = "deepspeed"  # its own ZeRO shards, written by save_checkpoint
    checkpoint_needs_same_world_size = True
    supports_async_save = False

    reads_weight_slices = True  # ZeRO-3 partitions module by module (stages 1-2 still build the whole model)

    def __init__(self, args):
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise ConfigError("engine deepspeed needs the deepspeed package: pip install 'pretrainer[deepspeed]'") \
                from None
        super().__init__(args)
        source = args.deepspeed if args.deepspeed is not None else config_from_accelerate_env()
        self.source = (f"key 'deepspeed' ({source})" if isinstance(source, str) else
                       "key 'deepspeed'" if args.deepspeed is not None else "the accelerate DeepSpeed config")
        # Filled and checked now, before the model is built: only the bucket sizes wait for its hidden size.
        self.ds_config, self.filled = fill_deepspeed_config(load_deepspeed_config(source), args, self.world_size,
                                                            hidden_size=None)
        validate_deepspeed_config(self.ds_config, self.source)
        self.model_engine = None

    @property
    def zero_stage(self) -> int:
        return int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError("DeepSpeed wraps model, optimizer and schedule together: use setup()")

    def setup(self, model, plan, optimizer, scheduler, build_optimizer, build_scheduler):
        import deepspeed

        self.plan = plan

        self.prepare_layers(model)
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        if hidden:
            fill_hidden_size(self.ds_config, hidden, self.filled)
        if self.filled and self.is_main:
            logger.info("DeepSpeed config: filled %s", ", ".join(f"{k}={v}" for k, v in self.filled.items()))
        if self.zero_stage == 3 and has_meta_tensors(model):
            # Built module by module and partitioned at once (as under zero.Init): no rank holds the whole model.
            deepspeed.init_distributed()  # joins the existing process group (as deepspeed.initialize would)
            materialize(model, self.device, self.args.seed, partition=self._partition)
        else:
            self.materialize_if_meta(model)
        # (A user optimizer never reaches here: it would hold unsharded parameters; PreTrainer refuses it.)
        if "optimizer" not in self.ds_config:
            optimizer = build_optimizer(model)  # our AdamW groups (no decay on norms/biases/embeddings)
            if "offload_optimizer" in (self.ds_config.get("zero_optimization") or {}):
                self.ds_config["zero_force_ds_cpu_optimizer"] = False
        if "scheduler" in self.ds_config:  # the JSON's scheduler wins over lr_decay_style, as in the HF Trainer
            logger.info("using the DeepSpeed config's scheduler %s (lr_decay_style is not used)",
                        self.ds_config["scheduler"].get("type"))
            scheduler = None
        elif scheduler is None:
            # Our schedule; over DeepSpeed's own optimizer when the JSON defines one (a callable it applies).
            scheduler = build_scheduler(optimizer) if optimizer is not None else build_scheduler
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
            model_parameters=None if optimizer is not None else [p for p in model.parameters() if p.requires_grad])
        self.model_engine = engine
        return engine, ds_optimizer, ds_scheduler

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

    def step(self, model, optimizer, max_norm, skip_nonfinite: bool = True, skip: bool = False):
        # DeepSpeed decides itself: its fp16 loss scaler skips non-finite steps; bf16/fp32 updates are applied.
        skipped_before = self.model_engine.skipped_steps
        self.model_engine.step()  # clips (gradient_clipping), updates, steps the schedule, zeroes grads
        norm = self.model_engine.get_global_grad_norm()
        grad_norm = torch.tensor(float(norm) if norm is not None else float("nan"))
        return grad_norm, self.model_engine.skipped_steps == skipped_before

    def finish_step(self, optimizer, scheduler) -> None:
        pass  # done inside DeepSpeed's step

    def save_state(self, folder, model, optimizer) -> None:
        self.model_engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, client_state={})

    def load_state(self, folder, model, optimizer) -> None:
        path, _ = self.model_engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                                    load_lr_scheduler_states=True)
        if path is None:
            raise ConfigError(f"{folder}: no DeepSpeed checkpoint (tag {CHECKPOINT_TAG!r}) could be loaded")

    def export_tensors(self, model):
        """ZeRO-3: each partitioned parameter is gathered on its own (GatheredParameters) and copied on the
        main rank; stages 1-2 hold whole 16-bit weights on every rank (the main rank's are taken)."""
        if self.zero_stage != 3:
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
            yield checkpoint_name(name), whole if self.is_main else None

    def full_state_dict(self, model) -> dict:
        if self.zero_stage == 3:  # gather the partitions (the seed's export wrote size-0 tensors here)
            state = self.model_engine._zero3_consolidated_16bit_state_dict()
            return {k: v.detach().cpu() for k, v in (state or {}).items()}
        return {k: v.detach().cpu() for k, v in self.model_engine.module.state_dict().items()}

    def unwrap(self, model):
        return self.model_engine.module

    def describe(self) -> str:
        zero = self.ds_config.get("zero_optimization") or {}
        offload = [k for k in ("offload_optimizer", "offload_param") if zero.get(k, {}).get("device") not in
                   (None, "none")]
        return super().describe() + f" zero_stage={self.zero_stage} offload={','.join(offload) or 'none'}"
