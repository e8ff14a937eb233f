"""Throughput accounting: model FLOPs per token, device peaks, MFU, and step-phase timing."""

from .flops import FlopsCount, flops_per_token
from .meter import IntervalMeter, StepPhases
from .peak import device_peak

__all__ = ["FlopsCount", "IntervalMeter", "StepPhases", "device_peak", "flops_per_token"]
