"""Engines: one module per way of running a model across processes, behind `Engine`."""

from .engine import Engine, Precision, SingleEngine, create_engine, resolve_device

__all__ = ["Engine", "Precision", "SingleEngine", "create_engine", "resolve_device"]
