"""What glibc's malloc does with freed host memory when training on the CPU (`host_malloc_reuse`).

glibc hands blocks above its mmap threshold (128 KB growing to at most 32 MB) back to the kernel when they are freed,
and trims the top of its heap once 128 KB there is free. Two policies replace that:

- `reuse`: both thresholds raised to 1 GiB, so freed blocks stay for the next request. A step that allocates and frees
  the same activation, logit and gradient buffers every step then stops faulting them in again (on the 5M-parameter
  quickstart Llama ~40k page faults and about 10% of the step), at the same peak RSS, because the same sizes come back.
- `return`: blocks of RETURN_ABOVE_BYTES and more are mapped on their own and given back when freed. For engines that
  gather each layer's parameters or reduce-scatter its gradients every micro-batch (FSDP, megatron's sharded data
  parallelism), `reuse` keeps what sharding saves: activations are carved out of the freed layer-sized buffers, the next
  gather cannot reuse them, and the heap grows until a rank holds about what an unsharded one does (82M model, 4 FSDP
  ranks: 2,975 MB; with `return` 1,265 MB, the step about 20% slower from page faults).

`auto` picks `return` where the engine says so for the layout (`returns_freed_blocks`), else `reuse`. Settings a user
made (`USER_SETTINGS`: the malloc environment variables, or a preloaded jemalloc/tcmalloc) win: nothing is changed then.
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
# such blocks are freed); smaller blocks, most activations of a small model, stay in the heap. 64 KB held the
# 4-rank FSDP rank above at 1,045 MB, its step 40% slower.
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
