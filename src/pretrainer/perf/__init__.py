"""Throughput accounting: model FLOPs per token, device peaks, MFU, and step-phase timing."""

from .flops import FlopsCount, flops_per_token
from .meter import IntervalMeter, memory_row
from .peak import DevicePeak, device_peak
from .timer import StepPhases

__all__ = ["DevicePeak", "FlopsCount", "IntervalMeter", "StepPhases", "device_peak", "flops_per_token", "memory_row"]
