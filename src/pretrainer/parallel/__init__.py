"""Engines: one module per way of running a model across processes, behind `Engine`."""

from .engine import Engine, Precision, SingleEngine, resolve_device
from .factory import create_engine, select_engine

__all__ = ["Engine", "Precision", "SingleEngine", "create_engine", "resolve_device", "select_engine"]
