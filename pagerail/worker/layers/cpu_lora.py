"""The native fp32 LoRA kernel (csrc/lora_cpu.c) that CPU steps serving adapters run on: one call per adapted
projection adds every adapter row's delta, where the grouped torch formulation dispatches four or five operations.

Built by `native_build` like the other CPU kernels; with PAGERAIL_CPU_LORA=torch, without a compiler, or when the
build fails, the grouped torch path runs (with a warning that carries the compiler's error).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagerail.worker.layers.native_build import CSRC, kernel_or_fallback, load_kernel

logger = logging.getLogger(__name__)

_SOURCE = CSRC / "lora_cpu.c"
_ENV_SWITCH = "PAGERAIL_CPU_LORA"
# Tests switch the kernel off to run the grouped torch path it is checked against.
ENABLED = True


class LoRAKernel:
    """ctypes handle on the compiled library, with the argument types spelled out once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._delta = library.lora_delta_f32
        self._delta.restype = None
        self._delta.argtypes = [pointer, size, pointer, size, pointer, pointer, size, size, size]
        self._delta.argtypes += [pointer, pointer, size, pointer, size]

    def delta(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        a_t: torch.Tensor,
        b: torch.Tensor,
        rows: torch.Tensor,
        segments: torch.Tensor,
        parts: torch.Tensor,
    ) -> None:
        """out[r] += x[r] a_t[s] b[s] in place for each listed row r of slot s.

        x [R, k] and out [R, n]: float32 CPU with unit stride along a row; a_t [slots, k, w] and b [slots, w, n]
        contiguous float32; rows: int64 row indices grouped by slot; segments: int64 [groups, 3] rows of (slot,
        first, end) into `rows`; parts: int64 [parts, 4] rows of (first h column, h columns, first out column, end
        out column), the diagonal blocks of b (the rest of b is never read)."""
        slots, k, w = a_t.shape
        n = b.shape[2]
        if x.shape[1] != k or out.shape[1] != n or x.stride(1) != 1 or out.stride(1) != 1:
            raise ValueError(f"x [rows, {k}] and out [rows, {n}] need unit stride, got {x.shape} and {out.shape}")
        self._delta(
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            a_t.data_ptr(),
            b.data_ptr(),
            k,
            w,
            n,
            rows.data_ptr(),
            segments.data_ptr(),
            segments.shape[0],
            parts.data_ptr(),
            parts.shape[0],
        )


def build_lora_kernel(source: Path | None = None, cache_dir: Path | None = None) -> LoRAKernel:
    """The kernel compiled from `source` (default: the shipped one); raises KernelBuildError with the compiler's
    output when there is no compiler or the build or load fails."""
    return load_kernel(source or _SOURCE, LoRAKernel, cache_dir)


def lora_kernel() -> LoRAKernel | None:
    """The kernel CPU LoRA uses; None (the grouped torch path) when switched off or when it cannot be built."""
    return _shipped_kernel() if ENABLED else None


@functools.cache
def _shipped_kernel() -> LoRAKernel | None:
    unavailable = "native CPU LoRA kernel unavailable, adapters run on the grouped torch path"
    return kernel_or_fallback(_ENV_SWITCH, build_lora_kernel, logger, unavailable)
