"""Keep freed host memory inside the process when training on the CPU.

glibc's malloc hands blocks above its mmap threshold (128 KB growing to at most 32 MB) back to the
kernel when they are freed, and trims the top of its heap once 128 KB there is free. A training step
allocates and frees the same activation, logit and gradient buffers every step, so on the CPU each
step faults all of them in again: on the 5M-parameter quickstart Llama that is ~40k page faults and
about 10% of the step spent zeroing pages in the kernel. Raising both thresholds lets malloc reuse
the blocks; peak RSS stays the same because the same sizes come back every step.

Environment variables a user sets (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, or a preloaded
jemalloc/tcmalloc) win: nothing is changed then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
KEEP_BELOW_BYTES = 1 << 30  # blocks under 1 GiB come from (and return to) malloc's heap
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def reuse_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; True when they were changed."""
    if not sys.platform.startswith("linux") or any(os.environ.get(name) for name in USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt thresholds)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    changed = mallopt(M_MMAP_THRESHOLD, KEEP_BELOW_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP_BELOW_BYTES) == 1
    if changed:
        logger.debug("malloc keeps freed blocks under %d MB for reuse", KEEP_BELOW_BYTES >> 20)
    return changed
