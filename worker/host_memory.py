"""Keeps freed host memory in the process heap, so large per-step temporaries are not page-faulted in anew.

glibc serves allocations above its mmap threshold (128 KiB at start) with fresh mmap pages and returns
them to the kernel on free. A CPU forward pass allocates many activations of megabytes each step, and
touching fresh pages costs more than the arithmetic on them: an RMSNorm over 2048×576 fp32 takes about
13× longer with fresh pages than with reused ones. Raising both thresholds lets the heap keep and reuse them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations below 1 GiB come from the heap; free memory above 2 GiB at the top of the heap is trimmed.
_MMAP_THRESHOLD = 1 << 30
_TRIM_THRESHOLD = (1 << 31) - 1


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; False where the C library has no mallopt (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    applied = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if not applied:
        logger.warning("mallopt refused the heap thresholds; CPU steps will page-fault their temporaries")
    return applied
