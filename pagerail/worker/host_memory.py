"""Host memory tuning for CPU steps: reuse freed activations, and back the KV cache with huge pages.

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
import math
import mmap

import torch

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


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on a fresh anonymous mapping, which the kernel is asked to back with 2 MiB transparent
    huge pages.

    Paged attention jumps between scattered KV blocks of a few KiB each; with 4 KiB pages nearly every
    block costs a TLB miss (the native decode kernel runs about 15% faster on huge pages). The advice must
    come before the first touch. Nothing is written here: the kernel hands out an anonymous mapping's pages zeroed
    when they are first touched, so a cache costs the memory (and the page faults) of the blocks it has used, not
    of its whole size (zeroing a 2 GiB cache up front took seconds on every start). Where the advice is refused
    the tensor is simply on normal pages.
    """
    element = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * element
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Its own mapping, not the heap: glibc serves allocations below 1 GiB from reused heap memory here (see
    # keep_freed_memory), which is not zero. The tensor holds the mapping; it is unmapped with the tensor.
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
    start = tensor.data_ptr()
    first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if last > first:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise(first, last - first, _MADV_HUGEPAGE)
        except (OSError, AttributeError, TypeError):
            pass
    return tensor
