"""A layout: how a run spreads one model over its processes, in the terms the estimate needs.

Read from a config without launching anything (`layout_from_args`: the engine `train` would choose for that
many processes, the Megatron and DeepSpeed settings as their engines read them), and written back as the
`key=value` overrides that turn one layout into another.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ConfigError
from ..parallel.deepspeed_config import AUTO, config_from_accelerate_env, fill_hidden_size, load_deepspeed_config
from ..parallel.factory import select_engine
from ..parallel.megatron_settings import read_settings

DEEPSPEED_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                      "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000}


@dataclass(frozen=True)
class Layout:
    engine: str                   # single | ddp | fsdp | deepspeed | megatron
    world_size: int               # processes
    devices_per_node: int         # processes that share one machine
    micro_batch: int              # sequences per forward on one replica
    accumulation: int             # micro-batches per optimizer step
    seq_length: int
    dtype: str                    # bf16 | fp16 | fp32 (compute; master weights are fp32)
    recompute: str = "none"       # none | selective | full
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"        # pipeline schedule (pp > 1)
    zero_stage: int = 0           # deepspeed
    offload_optimizer: bool = False  # deepspeed
    offload_parameters: bool = False  # deepspeed ZeRO-3
    # DeepSpeed's buffers, in elements (its defaults; "auto" is derived from the hidden size as the engine does)
    reduce_bucket: int = DEEPSPEED_DEFAULTS["reduce_bucket_size"]
    allgather_bucket: int = DEEPSPEED_DEFAULTS["allgather_bucket_size"]
    prefetch_bucket: int = DEEPSPEED_DEFAULTS["stage3_prefetch_bucket_size"]
    max_live_parameters: int = DEEPSPEED_DEFAULTS["stage3_max_live_parameters"]
    fsdp_reshard: bool = True
    fsdp_offload: bool = False
    fsdp_shard_size: int | None = None
    loss_chunk: int = 0           # tokens per chunk of the fused head + loss; 0: full logits

    @property
    def dp(self) -> int:
        """Data-parallel replicas (processes / (tp x pp x cp))."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp

    @property
    def fsdp_shards(self) -> int:
        return self.fsdp_shard_size or self.world_size

    def describe(self) -> str:
        parts = [f"engine={self.engine}", f"processes={self.world_size}", f"dp={self.dp}"]
        parts += [f"{name}={value}" for name, value in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp)) if value > 1]
        if self.engine == "deepspeed":
            parts.append(f"zero={self.zero_stage}" + (" offload_optimizer" if self.offload_optimizer else "")
                         + (" offload_parameters" if self.offload_parameters else ""))
        if self.engine == "fsdp":
            parts.append(f"reshard={self.fsdp_reshard}" + (" cpu_offload" if self.fsdp_offload else ""))
        parts += [f"micro_batch={self.micro_batch}", f"accumulation={self.accumulation}", f"seq={self.seq_length}",
                  f"recompute={self.recompute}", f"dtype={self.dtype}"]
        if self.loss_chunk:
            parts.append(f"loss_chunk={self.loss_chunk}")
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The `key=value` overrides that give this layout from any config of the same model and world (command
        line arguments: `shlex.join` them for a shell)."""
        keys = [f"engine={self.engine}", f"dp={self.dp}", f"micro_batch_size={self.micro_batch}",
                f"gradient_accumulation_steps={self.accumulation}", f"activation_checkpointing={self.recompute}"]
        if self.engine == "megatron":
            keys += [f"plugin_args.tp_degree={self.tp}", f"plugin_args.pp_degree={self.pp}",
                     f"plugin_args.sequence_parallelism={str(self.sequence_parallel).lower()}"]
        if self.engine == "deepspeed":
            zero = f"{{stage: {self.zero_stage}"
            if self.offload_optimizer:
                zero += ", offload_optimizer: {device: cpu}"
            if self.offload_parameters:
                zero += ", offload_param: {device: cpu}"
            keys.append(f"deepspeed={{zero_optimization: {zero}}}}}")
        if self.engine == "fsdp":
            keys += [f"fsdp_reshard_after_forward={str(self.fsdp_reshard).lower()}",
                     f"fsdp_cpu_offload={str(self.fsdp_offload).lower()}"]
        if self.engine in ("ddp", "fsdp", "megatron"):
            keys.append(f"context_parallel_degree={self.cp}")
        return keys

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)


def layout_from_args(args, world_size: int, devices_per_node: int, seq_length: int, num_layers: int, hidden: int,
                     loss_chunk: int = 0) -> Layout:
    """The layout of `args` run on `world_size` processes (`devices_per_node` to a machine)."""
    engine = select_engine(args, world_size)
    model_parallel = args.context_parallel_degree
    common = dict(engine=engine, world_size=world_size, devices_per_node=min(devices_per_node, world_size),
                  micro_batch=args.micro_batch_size, accumulation=args.gradient_accumulation_steps,
                  seq_length=seq_length, dtype=args.dtype, recompute=args.activation_checkpointing,
                  cp=args.context_parallel_degree, loss_chunk=loss_chunk)
    settings = read_settings(args, num_layers) if engine == "megatron" else None
    if settings is not None:
        model_parallel *= settings.model_parallel_size
    if world_size % model_parallel:
        raise ConfigError(f"--world-size {world_size}: not a multiple of the {model_parallel} processes that hold one "
                          "model replica (tp x pp x context_parallel_degree)")
    if settings is not None:
        return Layout(**{**common, "recompute": settings.recompute_granularity or "none"}, tp=settings.tp,
                      pp=settings.pp, sequence_parallel=settings.sequence_parallel, schedule=settings.schedule)
    if engine == "deepspeed":
        source = args.deepspeed if args.deepspeed is not None else config_from_accelerate_env()
        ds_config = load_deepspeed_config(source)
        fill_hidden_size(ds_config, hidden, {})  # "auto" bucket sizes, as the engine fills them
        zero = ds_config.get("zero_optimization") or {}
        offloaded = {kind: (zero.get(f"offload_{kind}") or {}).get("device", "none") not in ("none", None)
                     for kind in ("optimizer", "param")}

        def elements(key: str) -> int:
            value = zero.get(key, DEEPSPEED_DEFAULTS[key])
            return DEEPSPEED_DEFAULTS[key] if value == AUTO else int(value)

        return Layout(**common, zero_stage=int(zero.get("stage", 0)), offload_optimizer=offloaded["optimizer"],
                      offload_parameters=offloaded["param"], reduce_bucket=elements("reduce_bucket_size"),
                      allgather_bucket=elements("allgather_bucket_size"),
                      prefetch_bucket=elements("stage3_prefetch_bucket_size"),
                      max_live_parameters=elements("stage3_max_live_parameters"))
    if engine == "fsdp":
        return Layout(**common, fsdp_reshard=args.fsdp_reshard_after_forward, fsdp_offload=args.fsdp_cpu_offload,
                      fsdp_shard_size=args.fsdp_shard_size)
    return Layout(**common)
