"""What glibc's malloc does with freed host memory when training on the CPU (`host_malloc_reuse`; the policies and
their measurements: docs/configuration.md and docs/performance.md).

`return` exists because, where an engine gathers each layer's parameters or reduce-scatters its gradients every
micro-batch, a heap that keeps freed blocks carves activations out of the freed layer-sized buffers, the next gather
cannot reuse them, and the heap grows until a rank holds about what an unsharded one does. Settings a user made
(`USER_SETTINGS`) win: nothing is changed then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
KEEP_BELOW_BYTES = 1 << 30  # reuse: blocks under 1 GiB come from (and return to) malloc's heap
# return: a layer's weight matrix and up is mapped on its own (a fixed threshold also stops glibc raising it as
# such blocks are freed); smaller blocks, most activations of a small model, stay in the heap (64 KB: docs/plan.md).
RETURN_ABOVE_BYTES = 4 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def heap_policy(setting: str, returns_under_auto: bool) -> str:
    """`reuse`, `return` or `system` (glibc's own) for `host_malloc_reuse: setting`; `returns_under_auto`: the
    layout is one whose freed blocks `auto` returns (its engine's answer)."""
    if setting == "off":
        return "system"
    return "return" if setting == "auto" and returns_under_auto else "reuse"


def apply_heap_policy(policy: str) -> bool:
    """Set glibc's thresholds for `policy`; True when they were changed."""
    if policy == "system" or not sys.platform.startswith("linux") or any(os.environ.get(name) for name in
                                                                        USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt thresholds)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    threshold = KEEP_BELOW_BYTES if policy == "reuse" else RETURN_ABOVE_BYTES
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1 and mallopt(M_TRIM_THRESHOLD, threshold) == 1
