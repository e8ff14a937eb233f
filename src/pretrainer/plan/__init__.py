"""Planning a run before it starts: per-rank memory and step time of a layout, the layouts that fit, and the
check `train` makes before it builds the model (`pretrainer plan`)."""

from .estimate import Estimate, estimate
from .layout import Layout, layout_from_args
from .model_shape import ModelShape, model_shape
from .planner import Plan, make_plan
from .preflight import MemoryPlanError, PredictedMemory, check_memory_before_build
from .search import alternatives

__all__ = ["Estimate", "Layout", "MemoryPlanError", "ModelShape", "Plan", "PredictedMemory", "alternatives",
           "check_memory_before_build", "estimate", "layout_from_args", "make_plan", "model_shape"]
