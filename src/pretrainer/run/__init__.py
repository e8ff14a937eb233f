"""The run, resolved once: from the loaded arguments, the launch (or a planned world) and the model's config
to frozen parts that the engine, the data, the optimizer, the planner and the export each take."""

from .device import resolve_device, resolve_dtype
from .resolve import ResolvedRun, described_world_size, launch_world, resolve_run

__all__ = ["ResolvedRun", "described_world_size", "launch_world", "resolve_device", "resolve_dtype", "resolve_run"]
