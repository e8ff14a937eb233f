"""The device a plan is made for: its memory, its peak FLOP/s, the bandwidths between ranks, and what the
runtime itself takes before the model allocates anything.

Named devices come from a table (memory from the vendors' sheets, peaks from perf/peak.py's rated table); the
machine the command runs on is read directly: its GPU's memory, or on CPU the available RAM, shared by the
processes of one machine. Bandwidths are assumptions, stated in every plan.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, parse_size, torch_dtype
from ..parallel import SingleEngine
from ..perf.machine_cache import cached_measurement
from ..perf.peak import measured_peak, processor_name, rated_peak
from .hardware import DEFAULT_MEMORY_BYTES_PER_S, hardware, links_of

GIB = 2**30


def size(value: int) -> str:
    """Bytes as MiB below 1 GiB, else GiB (how the planner writes memory)."""
    return f"{value / GIB:,.1f} GiB" if value >= GIB else f"{value / 2**20:,.0f} MiB"
ACCELERATOR_RUNTIME_BYTES = int(1.0 * GIB)  # CUDA context, kernels, communicator buffers (assumed)
HOST_PER_DEVICE = 3  # host RAM per GPU, as a multiple of its memory (DGX H100: 2 TB for 8 x 80 GB; assumed)
ACCELERATOR_USABLE = 0.93  # the rest: allocator fragmentation (assumed)
CPU_BYTES_PER_S = 2e9            # gloo between processes of one machine (assumed)
FALLBACK_RUNTIME_BYTES = 400 * 2**20  # what such a process takes on Linux x86, when it cannot be measured
CPU_MFU = 0.60  # a CPU step's share of the measured GEMM peak (assumed; accelerators: plan/step_time.py)
KNOWN_DEVICES = "H200, H100, A100, A100-40GB, L40S, A10, L4, V100, MI300X, ..."


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: str                  # cpu | accelerator
    memory_bytes: int          # what one rank may use
    memory_source: str
    peak_tflops: float         # per device, in the run's compute dtype
    peak_source: str
    runtime_bytes: int         # the process before the model: interpreter, torch, context
    runtime_source: str
    host_memory_bytes: int = 0  # host RAM one rank may use for offloaded state and loading (accelerators)
    host_memory_source: str = ""
    memory_bandwidth: float = DEFAULT_MEMORY_BYTES_PER_S  # bytes/s of the device memory (accelerators)
    intra_node_bandwidth: float = CPU_BYTES_PER_S  # bytes/s one way to a rank of the same machine
    inter_node_bandwidth: float = CPU_BYTES_PER_S  # bytes/s one way to a rank of another machine
    link_source: str = "assumed: gloo between processes of one machine"

    def bandwidth(self, group_within_node: bool) -> float:
        return self.intra_node_bandwidth if group_within_node else self.inter_node_bandwidth

    def describe(self) -> str:
        return (f"{self.name}: {self.memory_bytes / GIB:,.1f} GiB per rank ({self.memory_source}); peak "
                f"{self.peak_tflops:,.3g} TFLOP/s ({self.peak_source})")


def device_spec(dtype: str, ranks_per_node: int, name: str | None = None, memory: str | None = None,
                baseline_engine: str = SingleEngine.name, memory_key: str = "--device-memory",
                host_memory: str | None = None, links: tuple[str | None, str | None] = (None, None)) -> DeviceSpec:
    """The device to plan for (`name`: e.g. H100, A100-40GB, cpu; None: this machine's), with the `pretrainer plan`
    flags' replacements (docs/plan.md); `baseline_engine`: the engine whose tiny run measures a CPU's runtime."""
    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    if name.lower() == "cpu":
        return _cpu_spec(dtype, ranks_per_node, memory, baseline_engine, memory_key)
    peak, row = rated_peak(name, torch_dtype(dtype)), hardware(name)
    if peak is None:
        raise ConfigError(f"--device {name!r}: not a device this planner knows ({KNOWN_DEVICES}); give --device-memory "
                          "and the config's peak_tflops, or plan for one of those")
    if memory is not None:
        total, source = parse_size(memory, memory_key), memory_key
    elif torch.cuda.is_available() and name == torch.cuda.get_device_name(0):
        total, source = torch.cuda.get_device_properties(0).total_memory, "this machine's GPU"
    else:
        if row is None:
            raise ConfigError(f"--device {name!r}: its memory is not in the table; give --device-memory")
        total, source = row.memory_gib * GIB, f"{name}'s rated memory"
    if host_memory is not None:
        host, host_source = parse_size(host_memory, "--host-memory") // ranks_per_node, "--host-memory"
    elif torch.cuda.is_available() and name == torch.cuda.get_device_name(0):
        host, host_source = available_ram() // ranks_per_node, "this machine's available RAM"
    else:
        host, host_source = HOST_PER_DEVICE * total, f"assumed {HOST_PER_DEVICE}x the device memory"
    if ranks_per_node > 1:
        host_source += f", shared by {ranks_per_node} processes"
    intra, inter, link_source = links_of(row, links)
    return DeviceSpec(name, "accelerator", int(total * ACCELERATOR_USABLE),
                      f"{source}, {ACCELERATOR_USABLE:.0%} usable", peak, f"rated dense {dtype}",
                      ACCELERATOR_RUNTIME_BYTES, "assumed: context and communicator buffers", host, host_source,
                      row.memory_bytes_per_s if row else DEFAULT_MEMORY_BYTES_PER_S, intra, inter, link_source)


def _cpu_spec(dtype: str, ranks_per_node: int, memory: str | None, baseline_engine: str,
              memory_key: str) -> DeviceSpec:
    total, source = ((parse_size(memory, memory_key), memory_key) if memory is not None else
                     (available_ram(), "this machine's available RAM"))
    per_rank = total // max(ranks_per_node, 1)
    share = f", shared by {ranks_per_node} processes" if ranks_per_node > 1 else ""
    peak = measured_peak(torch.device("cpu"), torch_dtype(dtype))
    runtime = runtime_baseline(baseline_engine)
    peak_source = peak.source + (f"; {peak.bound}" if peak.bound else "")  # the run's own peak (perf/peak.py)
    return DeviceSpec(f"cpu ({processor_name(torch.device('cpu'))})", "cpu", per_rank, source + share, peak.tflops,
                      peak_source, runtime, "measured once: two steps of a tiny model on one process")


def available_ram() -> int:
    """RAM a new process can have: the kernel's MemAvailable, or less under a container's cgroup limit."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = Path(limit_file).read_text().strip(), int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            available = min(available, int(limit) - usage)
        break
    return available


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_", "ROLE_", "ACCELERATE_", "CUDA_VISIBLE_DEVICES")


def runtime_baseline(kind: str) -> int:
    """Peak RSS of a training process with a tiny model on engine `kind` (`pretrainer.plan.baseline_run`: interpreter,
    torch, transformers, data pipeline, engine; one process), measured once per machine and torch version, cached."""

    def measure() -> float:
        env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
        env.update(OMP_NUM_THREADS="1", LOCAL_RANK="0")  # a process of its own (DeepSpeed asks for LOCAL_RANK)
        try:
            out = subprocess.run([sys.executable, "-m", "pretrainer.plan.baseline_run", kind], capture_output=True,
                                 text=True, timeout=600, env=env)
            return float(out.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError, OSError):
            return FALLBACK_RUNTIME_BYTES

    key = f"runtime of two tiny steps|{kind}|torch={torch.__version__}|python={sys.version[:4]}"
    return int(cached_measurement(key, measure))
