"""DDP: every rank holds the whole model; gradients are averaged once per optimizer step."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from .context_parallel import context_parallel_degrees
from .distributed import DistributedEngine
from .layout import CostModel
from .parallelize import parallelize


class DDPEngine(DistributedEngine):
    name = "ddp"
    supports_context_parallel = True

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        def replicate(module: torch.nn.Module) -> torch.nn.Module:
            self.materialize_if_meta(module)  # same seeded init on every rank; DDP also broadcasts rank 0's weights
            module.to(self.device)
            device_ids = [self.device.index] if self.device.type != "cpu" else None
            # LLM buffers (rotary frequencies) are constants: no need to broadcast them every forward.
            return DistributedDataParallel(module, device_ids=device_ids, forward_sync_buffers=False)

        self.install_context_parallel(model)
        return parallelize(model, self.parallelism(data_parallel=replicate))

    def no_sync(self, model: torch.nn.Module):
        return model.no_sync()  # accumulation micro-batches skip the all-reduce

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module

    def measured_gradient_ranks(self, model: torch.nn.Module) -> int:
        return model.process_group.size()



class DDPCosts(CostModel):
    """The ddp engine's cost model: a plain torch engine's answers, over every context-parallel degree."""

    traits = DDPEngine

    @classmethod
    def layout_variants(cls, world_size: int, devices_per_node: int, shape, seq_length: int) -> list[dict]:
        if world_size == 1:
            return []
        return [{"dims": cls.traits.parallel_dims(world_size, cp, None)}
                for cp in context_parallel_degrees(world_size, seq_length)]
