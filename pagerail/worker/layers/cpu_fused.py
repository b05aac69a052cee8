"""Native float32 CPU kernels for RMSNorm (with its residual add), rotary embedding, the gated activation and the
paged KV cache write.

At decode batch sizes these operations touch a few hundred kilobytes each, and the torch formulation spends a
chain of seven to ten dispatched operations (and as many temporaries) on each; one C call does the same
arithmetic in one pass. Results agree with the torch path to float rounding (the sums are ordered differently).
Built by `native_build` like the decode attention kernel; with PAGERAIL_CPU_FUSED=torch, without a compiler, or
when the build fails, the torch path runs (with a warning that carries the compiler's error).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagerail.worker.layers.native_build import CSRC, kernel_or_fallback, load_kernel

logger = logging.getLogger(__name__)

_SOURCE = CSRC / "fused_cpu.c"
_ENV_SWITCH = "PAGERAIL_CPU_FUSED"
_NULL = ctypes.c_void_p(0)
# Tests switch the kernels off to run the torch path they are checked against.
ENABLED = True


class FusedKernels:
    """ctypes handles on the compiled library, with the argument types spelled out once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._norm = library.rms_norm_f32
        self._norm.restype = None
        self._norm.argtypes = [pointer] * 5 + [size] * 3 + [ctypes.c_float]
        self._rotary = library.rotary_f32
        self._rotary.restype = None
        self._rotary.argtypes = [pointer] * 4 + [size] * 6
        self._write_kv = library.write_kv_f32
        self._write_kv.restype = size
        self._write_kv.argtypes = [pointer, pointer, size, size, pointer, pointer, pointer] + [size] * 4
        self._silu_and_mul = library.silu_and_mul_f32
        self._silu_and_mul.restype = None
        self._silu_and_mul.argtypes = [pointer, pointer] + [size] * 3

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(residual + x), residual + x); x [rows, dim] with unit stride along dim."""
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=torch.float32)
        if residual is None:
            self._norm(x.data_ptr(), _NULL, weight.data_ptr(), out.data_ptr(), _NULL, rows, dim, x.stride(0), eps)
            return out
        residual = residual.contiguous()
        total = torch.empty((rows, dim), dtype=torch.float32)
        self._norm(
            x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            total.data_ptr(),
            rows,
            dim,
            x.stride(0),
            eps,
        )
        return out, total

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
        """Rotate q [T, q_heads * head_dim] and k [T, k_heads * head_dim] in place; cos and sin [T, head_dim / 2]."""
        tokens = q.shape[0]
        self._rotary(
            q.data_ptr(),
            k.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            tokens,
            q.shape[1] // head_dim,
            k.shape[1] // head_dim,
            head_dim,
            q.stride(0),
            k.stride(0),
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * d] holding [gate | up] → silu(gate) * up, [rows, d]."""
        rows, width = x.shape
        out = torch.empty((rows, width // 2), dtype=torch.float32)
        self._silu_and_mul(x.data_ptr(), out.data_ptr(), rows, width // 2, x.stride(0))
        return out

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> None:
        """Each token's k and v rows [T, kv_heads * head_dim] into its slot of the caches [kv_heads, slots, dim]."""
        kv_heads, num_slots, head_dim = key_cache.shape
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        bad = self._write_kv(
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            v.stride(0),
            slots.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            k.shape[0],
            kv_heads,
            head_dim,
            num_slots,
        )
        if bad >= 0:
            raise IndexError(f"slot {int(slots[bad])} of token {bad} is outside the KV cache's {num_slots} slots")


def build_fused_kernels(source: Path | None = None, cache_dir: Path | None = None) -> FusedKernels:
    """The kernels compiled from `source` (default: the shipped ones); raises KernelBuildError with the compiler's
    output when there is no compiler or the build or load fails."""
    return load_kernel(source or _SOURCE, FusedKernels, cache_dir)


def fused_kernels() -> FusedKernels | None:
    """The kernels the CPU layers use; None (the torch path) when switched off or when they cannot be built."""
    return _shipped_kernels() if ENABLED else None


@functools.cache
def _shipped_kernels() -> FusedKernels | None:
    unavailable = "native CPU kernels for norm, rotary, activation and KV write unavailable, the torch path runs"
    return kernel_or_fallback(_ENV_SWITCH, build_fused_kernels, logger, unavailable)


def fits(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a float32 CPU matrix with unit stride along its rows (what the kernels read)."""
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1 for t in tensors
    )
