"""FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the data-parallel ranks.

Each decoder layer is its own unit (all-gathered just before use, resharded after), the root holds the
embeddings and head. A meta-device model is sharded first and materialised afterwards, so no rank ever
holds the whole model.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from ..config import ConfigError
from .activation_checkpoint import decoder_layers
from .distributed import DistributedEngine

logger = logging.getLogger(__name__)


class FSDPEngine(DistributedEngine):
    name = "fsdp"
    shards_parameters = True
    reads_weight_slices = True
    supports_context_parallel = True

    def __init__(self, args):
        super().__init__(args)
        self.reshard_after_forward = args.fsdp_reshard_after_forward
        self.cpu_offload = args.fsdp_cpu_offload
        self.mesh = self._device_mesh(args.fsdp_shard_size)

    def _device_mesh(self, shard_size: int | None):
        """1-D mesh: shard over all ranks. 2-D (hybrid): replicate across groups, shard within each group."""
        shard = shard_size or self.world_size
        if self.world_size % shard:
            raise ConfigError(f"key 'fsdp_shard_size': {shard} does not divide the {self.world_size} processes")
        if shard == self.world_size:
            return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("shard",))
        return init_device_mesh(self.device.type, (self.world_size // shard, shard),
                                mesh_dim_names=("replicate", "shard"))

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.prepare_layers(model)
        options = {"reshard_after_forward": self.reshard_after_forward, "mesh": self.mesh}
        if self.precision.dtype != "fp32":
            # Compute in the low precision, keep fp32 shards and reduce gradients in fp32.
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.precision.compute_dtype,
                                                        reduce_dtype=torch.float32)
        if self.cpu_offload:
            # pin_memory needs an accelerator; without one it must be off.
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type != "cpu")
        if not any(p.is_meta for p in model.parameters()) and not self.cpu_offload:
            model.to(self.device)
        for layer in decoder_layers(model):
            fully_shard(layer, **options)
        fully_shard(model, **options)
        self.materialize_if_meta(model)
        return model

    def materialize_if_meta(self, model: torch.nn.Module) -> None:
        if self.cpu_offload and any(p.is_meta for p in model.parameters()):
            from ..models import materialize

            materialize(model, torch.device("cpu"), self.args.seed)
            return
        super().materialize_if_meta(model)

    @property
    def exports_tensor_by_tensor(self) -> bool:
        # Shards offloaded to host memory cannot be gathered over an accelerator's process group one by one.
        return not (self.cpu_offload and self.device.type != "cpu")

    def autocast(self):
        return contextlib.nullcontext()  # FSDP's mixed-precision policy casts parameters itself

    def no_sync(self, model: torch.nn.Module):
        @contextlib.contextmanager
        def skip_reduce_scatter():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)

        return skip_reduce_scatter()

    def describe(self) -> str:
        mesh = " x ".join(f"{name}={size}" for name, size in zip(self.mesh.mesh_dim_names, self.mesh.shape))
        return (super().describe() + f" mesh=({mesh}) reshard_after_forward={self.reshard_after_forward}"
                f" cpu_offload={self.cpu_offload}")
