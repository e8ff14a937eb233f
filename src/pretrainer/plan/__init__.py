"""Planning a run before it starts: per-rank memory and step time of a layout, the layouts that fit, and the
check `train` makes before it builds the model (`pretrainer plan`)."""

from .estimate import estimate
from .memory_check import check_memory_before_build
from .model_shape import model_shape

__all__ = ["check_memory_before_build", "estimate", "model_shape"]
