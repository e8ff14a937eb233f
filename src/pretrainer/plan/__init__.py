"""Planning a run before it starts: per-rank memory and step time of a layout, the layouts that fit, and the
check `train` makes before it builds the model (`pretrainer plan`)."""

from .estimate import Estimate, estimate
from .memory_check import MemoryPlanError, PredictedMemory, check_memory_before_build
from .model_shape import ModelShape, model_shape
from .planner import Plan, make_plan
from .search import alternatives

__all__ = ["Estimate", "MemoryPlanError", "ModelShape", "Plan", "PredictedMemory", "alternatives",
           "check_memory_before_build", "estimate", "make_plan", "model_shape"]
