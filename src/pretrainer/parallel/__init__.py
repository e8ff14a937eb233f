"""Engines: one module per way of running a model across processes, behind `Engine`; the world they run on
(`world`), the parallelism they apply (`parallelize`), and what they answer the planner (`layout`)."""

from .engine import Engine, EngineOptions
from .layout import Layout
from .registry import ENGINES, EngineEntry, create_engine, engine_entry, select_engine
from .torch_backend import SingleEngine
from .world import World, join_world, planned_world

__all__ = ["ENGINES", "Engine", "EngineEntry", "EngineOptions", "Layout", "SingleEngine", "World", "create_engine",
           "engine_entry", "join_world", "planned_world", "select_engine"]
