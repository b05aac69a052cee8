"""Native CPU decode attention over the paged cache: compiled once per machine with the system C compiler.

The torch fallback gathers every context into a padded copy before SDPA, which moves each K/V byte about
three times; this kernel reads the blocks where they lie. It is built and loaded by `native_build` (compiled
with -ffast-math, linked without it, so the loading process keeps its subnormals).
With PAGERAIL_CPU_ATTENTION=torch the torch path is used; without a compiler, or when the build fails, it is used
too, with a warning that carries the compiler's error (`build_native_kernel` raises it instead).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagerail.worker.layers.kv_quant import FP8_DTYPES
from pagerail.worker.layers.native_build import CSRC, KernelBuildError, find_compiler, kernel_or_fallback, load_kernel

__all__ = ["KernelBuildError", "NativeKernel", "build_native_kernel", "find_compiler", "native_kernel"]

logger = logging.getLogger(__name__)

_SOURCE = CSRC / "paged_attention_cpu.c"
_ENV_SWITCH = "PAGERAIL_CPU_ATTENTION"


class NativeKernel:
    """ctypes handle on the compiled library, with the argument types spelled out once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.paged_decode_attention_f32
        self._fn.restype = None
        # 6 pointers, 7 sizes, the scale, the sliding window, the softcap and the sinks (a nullable pointer).
        self._fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float]
        self._fn.argtypes += [ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
        # The fp8-cache entry point: the same arguments, then the byte → float table and the two scale pointers.
        # None in a library built from a source without it (bench/cpu_attention.py --against).
        self._fp8 = getattr(library, "paged_decode_attention_fp8", None)
        if self._fp8 is not None:
            self._fp8.restype = None
            self._fp8.argtypes = self._fn.argtypes + [ctypes.c_void_p] * 3
        max_group, max_head_dim = ctypes.c_int64(), ctypes.c_int64()
        library.paged_attention_limits(ctypes.byref(max_group), ctypes.byref(max_head_dim))
        self.max_group = max_group.value
        self.max_head_dim = max_head_dim.value
        # 512: the build with AVX-512 paths for the common head shapes; 0: the generic loop only (also a source
        # from before those paths, as `bench/cpu_attention.py --against` may load).
        isa = getattr(library, "paged_attention_isa", None)
        self.isa = int(isa()) if isa is not None else 0

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether queries of `dtype` (the compute dtype; the cache may be fp32 or fp8) and this shape run here."""
        return dtype == torch.float32 and num_heads // num_kv_heads <= self.max_group and head_dim <= self.max_head_dim

    def decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [n, heads, d]; caches [kv_heads, slots, d]; block_table [n, max_blocks] int64 → [n, heads, d].

        With `sliding_window` > 0 each query attends only to the last that many positions of its context; with
        `softcap` > 0 its scores pass through softcap * tanh(score / softcap) first; `sinks` [heads] adds
        exp(sinks[h]) to head h's softmax denominator (a logit with no value). An fp8 cache holds value / scale:
        `k_scale` and `v_scale` (float32 scalars) are then required."""
        q = q.contiguous()
        out = torch.empty_like(q)
        n, num_heads, head_dim = q.shape
        num_kv_heads, num_slots, _ = key_cache.shape
        if sinks is not None:
            if sinks.shape != (num_heads,):
                raise ValueError(f"sinks must be [num_heads={num_heads}], got shape {tuple(sinks.shape)}")
            sinks = sinks.to(torch.float32).contiguous()
        fp8 = key_cache.dtype in FP8_DTYPES
        if fp8 and (self._fp8 is None or k_scale is None or v_scale is None or value_cache.dtype != key_cache.dtype):
            raise ValueError("an fp8 cache needs k_scale, v_scale, an fp8 value cache and a kernel built with fp8")
        call = self._fp8 if fp8 else self._fn
        extra = (fp8_table(key_cache.dtype).data_ptr(), _scalar(k_scale), _scalar(v_scale)) if fp8 else ()
        call(
            q.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_table.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            n,
            num_heads,
            num_kv_heads,
            head_dim,
            num_slots,
            block_table.shape[1],
            block_size,
            scale,
            sliding_window,
            softcap,
            None if sinks is None else sinks.data_ptr(),
            *extra,
        )
        return out


def _scalar(scale: torch.Tensor) -> int:
    """The address of a float32 scale the kernel reads in place (no host copy of its value per call)."""
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device.type != "cpu":
        raise ValueError(f"fp8 cache scales must be one float32 on the CPU, got {scale.dtype} {tuple(scale.shape)}")
    return scale.data_ptr()


@functools.cache
def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] float32: every byte of the fp8 format `dtype` decoded, which the kernel indexes instead of bit-twiddling.
    Cached for the life of the process, so its address stays valid across calls."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)


def build_native_kernel(source: Path | None = None, cache_dir: Path | None = None) -> NativeKernel:
    """The kernel compiled from `source` (default: the shipped kernel; built on first use, then cached).

    The strict variant: raises KernelBuildError, with the compiler's output, when there is no compiler or the
    build or load fails. Decode attention goes through `native_kernel`, which logs that error and falls back.
    """
    return load_kernel(source or _SOURCE, NativeKernel, cache_dir)


@functools.cache
def native_kernel() -> NativeKernel | None:
    """The kernel CPU decode attention uses; None (the torch path) when switched off or when it cannot be built."""
    unavailable = "native CPU attention unavailable, decode attention uses the slower torch path"
    return kernel_or_fallback(_ENV_SWITCH, build_native_kernel, logger, unavailable)
