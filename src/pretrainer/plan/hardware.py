"""Accelerators and their links, as data: memory, memory bandwidth, the link between GPUs of one machine and the
network share of one GPU between machines. Peaks per dtype live in perf/peak.py (RATED_TFLOPS).

Figures are the vendors' per-direction numbers for the usual server of each part (SXM boards on an
NVLink/NVSwitch or Infinity Fabric mesh, one 400 Gb/s NIC per GPU for H100/H200, 800 Gb/s for B200,
200 Gb/s for A100); `pretrainer plan --intra-node-bandwidth/--inter-node-bandwidth` replace the links.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import ConfigError

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    pattern: str
    memory_gib: int
    memory_bytes_per_s: float     # HBM / GDDR
    intra_node_bytes_per_s: float  # to the other GPUs of the machine, one direction
    inter_node_bytes_per_s: float  # this GPU's share of the network between machines, one direction


# First match wins: specific names before their prefixes.
HARDWARE = (
    Hardware(r"H200", 141, 4800 * GB, 450 * GB, 50 * GB),
    Hardware(r"H100.*NVL", 94, 3900 * GB, 300 * GB, 50 * GB),    # NVLink bridges between pairs
    Hardware(r"H100.*96GB", 96, 2400 * GB, 450 * GB, 50 * GB),  # HBM2e boards (Meta's Grand Teton)
    Hardware(r"H100.*PCIe", 80, 2000 * GB, 64 * GB, 50 * GB),    # PCIe 5.0 x16
    Hardware(r"GH200", 96, 4000 * GB, 450 * GB, 50 * GB),
    Hardware(r"H100|H800", 80, 3350 * GB, 450 * GB, 50 * GB),    # NVLink 4 (900 GB/s both ways), NDR 400 Gb/s
    Hardware(r"GB200|B200", 180, 8000 * GB, 900 * GB, 100 * GB),  # NVLink 5, XDR 800 Gb/s
    Hardware(r"H20\b", 96, 4000 * GB, 450 * GB, 50 * GB),
    Hardware(r"A100.*40", 40, 1555 * GB, 300 * GB, 25 * GB),     # NVLink 3 (600 GB/s both ways), HDR 200 Gb/s
    Hardware(r"A100|A800", 80, 2039 * GB, 300 * GB, 25 * GB),
    Hardware(r"L40S|L40\b", 48, 864 * GB, 32 * GB, 25 * GB),     # PCIe 4.0 x16
    Hardware(r"A10G|A10\b|L4\b", 24, 600 * GB, 32 * GB, 12.5 * GB),
    Hardware(r"4090|3090", 24, 1000 * GB, 32 * GB, 12.5 * GB),
    Hardware(r"V100.*16", 16, 900 * GB, 150 * GB, 12.5 * GB),
    Hardware(r"V100", 32, 900 * GB, 150 * GB, 12.5 * GB),
    Hardware(r"MI300X", 192, 5300 * GB, 448 * GB, 50 * GB),      # 7 Infinity Fabric links of 64 GB/s
    Hardware(r"MI250X", 128, 3200 * GB, 200 * GB, 25 * GB),
)
# A GPU not in the table: links of an H100-class server.
DEFAULT_INTRA_NODE_BYTES_PER_S = 450 * GB
DEFAULT_INTER_NODE_BYTES_PER_S = 50 * GB
DEFAULT_MEMORY_BYTES_PER_S = 2000 * GB


def hardware(name: str) -> Hardware | None:
    return next((row for row in HARDWARE if re.search(row.pattern, name, re.I)), None)


def parse_rate(text: str, flag: str) -> float:
    """`450GB/s`, `50GB`, `400Gb/s` (bits) or a number of bytes per second; units are powers of 1000."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kKmMgGtT]?)([bB]?)(?:/s)?\s*", str(text))
    if not match:
        raise ConfigError(f"{flag} {text!r}: give a bandwidth such as 450GB/s, 400Gb/s (bits) or 50e9")
    value = float(match.group(1)) * 1000 ** "bkmgt".index(match.group(2).lower() or "b")
    value = value / 8 if match.group(3) == "b" else value
    if value <= 0:
        raise ConfigError(f"{flag} {text!r}: must be above 0")
    return value


def links_of(row: Hardware | None, links: tuple[str | None, str | None]) -> tuple[float, float, str]:
    """Bandwidths within and between machines: the flags', else the device table's, else an H100 server's."""
    table = (row.intra_node_bytes_per_s, row.inter_node_bytes_per_s) if row else (
        DEFAULT_INTRA_NODE_BYTES_PER_S, DEFAULT_INTER_NODE_BYTES_PER_S)
    given = [parse_rate(value, flag) if value is not None else None
             for value, flag in zip(links, ("--intra-node-bandwidth", "--inter-node-bandwidth"))]
    intra, inter = (g if g is not None else t for g, t in zip(given, table))
    source = "--intra/--inter-node-bandwidth" if any(g is not None for g in given) else (
        "the device table" if row else "assumed: an H100 server's")
    return float(intra), float(inter), source
