"""DDP: every rank holds the whole model; gradients are averaged once per optimizer step."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from .distributed import DistributedEngine


class DDPEngine(DistributedEngine):
    name = "ddp"
    supports_context_parallel = True

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.prepare_layers(model)
        self.materialize_if_meta(model)  # same seeded init on every rank; DDP also broadcasts rank 0's weights
        model.to(self.device)
        device_ids = [self.device.index] if self.device.type != "cpu" else None
        # LLM buffers (rotary frequencies) are constants: no need to broadcast them every forward.
        return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)

    def no_sync(self, model: torch.nn.Module):
        return model.no_sync()  # accumulation micro-batches skip the all-reduce

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module
