"""A plan for one resolved run: its layout's estimate and the alternatives, from what `train` resolves first
(`run.resolve_run`: the engine's settings and dimensions, the model config, the sizes, the loss chunk),
without building the model."""

from __future__ import annotations

import functools

from ..run import ResolvedRun
from .device_spec import DeviceSpec
from .estimate import Estimate, estimate
from .model_shape import ModelShape, model_shape
from .search import alternatives


class Plan:
    """The estimate of a run's own layout; the alternatives are searched when first asked for."""

    def __init__(self, shape: ModelShape, own: Estimate, search):
        self.shape, self.estimate, self._search = shape, own, search

    @property
    def layout(self):
        return self.estimate.layout

    @functools.cached_property
    def alternatives(self) -> list[Estimate]:
        return self._search()

    def fitting(self, count: int) -> list[Estimate]:
        return [e for e in self.alternatives if e.fits][:count]


def make_plan(run: ResolvedRun, devices_per_node: int, device: DeviceSpec) -> Plan:
    config = run.model_config
    shape = model_shape(config, run.vocab_size)
    layout = run.layout(devices_per_node)
    own = estimate(layout, shape, config, device, run.trainable, run.weights)
    return Plan(shape, own, lambda: alternatives(layout, shape, config, device, run.loss_chunk_for, run.trainable,
                                                 run.weights))
