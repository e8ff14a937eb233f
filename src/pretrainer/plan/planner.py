"""A plan for one config: its layout's estimate and the alternatives, from what `train` resolves first (the
model config and tokenizer by `models.preflight`, the sequence length by the run plan), without building the
model."""

from __future__ import annotations

import functools

from ..config import resolve_seq_length
from ..models import reads_checkpoint_in_slices, resolve_chunk_size
from .device import DeviceSpec
from .estimate import Estimate, estimate
from .layout import Layout, layout_from_args
from .model_shape import ModelShape, model_shape
from .search import alternatives


class Plan:
    """The estimate of a config's own layout; the alternatives are searched when first asked for."""

    def __init__(self, shape: ModelShape, own: Estimate, search):
        self.shape, self.estimate, self._search = shape, own, search

    @property
    def layout(self) -> Layout:
        return self.estimate.layout

    @functools.cached_property
    def alternatives(self) -> list[Estimate]:
        return self._search()

    def fitting(self, count: int) -> list[Estimate]:
        return [e for e in self.alternatives if e.fits][:count]


def make_plan(args, spec, world_size: int, devices_per_node: int, device: DeviceSpec) -> Plan:
    """`spec`: `models.preflight`'s result for `args`."""
    config = spec.config
    vocab = spec.growth.new_size if spec.growth is not None else None
    shape = model_shape(config, vocab)
    seq_length = resolve_seq_length(args.seq_length, config, spec.config_source)
    layout = layout_from_args(args, world_size, devices_per_node, seq_length, shape.layers, shape.hidden)

    def loss_chunk(micro_batch: int) -> int:
        """`loss_chunk_size` as the run resolves it."""
        return resolve_chunk_size(args.loss_chunk_size, micro_batch, seq_length, shape.vocab)

    layout = layout.replace(loss_chunk=loss_chunk(layout.micro_batch))
    checkpoint = ("slices" if reads_checkpoint_in_slices(args, spec) else "whole") if spec.has_weights else "none"
    own = estimate(layout, shape, config, device, args.trainable_parameters, checkpoint)
    return Plan(shape, own, lambda: alternatives(layout, shape, config, device, loss_chunk, args.trainable_parameters,
                                                 checkpoint))
