"""The native fp32 matmul over packed weights (csrc/packed_linear_cpu.c) that CPU decode batches run on.

`cpu_matmul` decides per weight shape and batch size whether it beats MKL and oneDNN on this machine; this module
only builds, loads and calls it. PAGERAIL_CPU_MATMUL=mkl leaves it unused.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagerail.worker.layers.native_build import CSRC, KernelBuildError, load_kernel

logger = logging.getLogger(__name__)

_SOURCE = CSRC / "packed_linear_cpu.c"


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight [out_features, in_features] laid out in the kernel's panels of `panel` output features."""

    data: torch.Tensor
    out_features: int
    in_features: int
    address: int  # data's, read once: the call is on every layer of every step


class PackedLinearKernel:
    """ctypes handle on the compiled library, with the argument types spelled out once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        if not library.packed_linear_supported():
            raise KernelBuildError("the packed matmul needs AVX2 and FMA, which this CPU's build lacks")
        self.panel = int(library.packed_linear_panel())
        # 512: the AVX-512 build, 256: the AVX2 one (see the source's header).
        self.isa = int(library.packed_linear_isa())
        # Names this build (source, flags, host): matmul choices measured with another build are measured again.
        self.build = Path(library._name).stem
        self._pack = library.pack_linear_weight_f32
        self._pack.restype = None
        self._pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        self._run = library.packed_linear_f32
        self._run.restype = None
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 4

    def pack(self, weight: torch.Tensor) -> PackedWeight:
        """A packed copy of an fp32 CPU weight [out, in]; the weight itself is left as it is."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"packs 2-D float32 CPU weights, got {tuple(weight.shape)} {weight.dtype} {weight.device}")
        weight = weight.detach().contiguous()
        out_features, in_features = weight.shape
        panels = -(-out_features // self.panel)
        # torch's CPU allocator aligns to 64 bytes, and every panel is a multiple of 64 bytes long, so the kernel's
        # aligned loads hold for every panel.
        data = torch.empty(panels * in_features * self.panel, dtype=torch.float32)
        self._pack(weight.data_ptr(), data.data_ptr(), out_features, in_features)
        return PackedWeight(data, out_features, in_features, data.data_ptr())

    def linear(self, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        """x [rows, in_features] float32 → x @ weight^T [rows, out_features]."""
        rows, in_features = x.shape
        if in_features != weight.in_features or x.dtype != torch.float32:
            raise ValueError(f"expects [rows, {weight.in_features}] float32, got {tuple(x.shape)} {x.dtype}")
        if x.stride(1) != 1:
            x = x.contiguous()
        out_features = weight.out_features
        out = torch.empty(rows, out_features, dtype=torch.float32)
        if rows:
            address, stride = x.data_ptr(), x.stride(0)
            self._run(address, stride, weight.address, out.data_ptr(), out_features, rows, out_features, in_features)
        return out


def build_packed_linear(source: Path | None = None, cache_dir: Path | None = None) -> PackedLinearKernel:
    """The kernel compiled from `source` (default: the shipped one); raises KernelBuildError when it cannot be had."""
    return load_kernel(source or _SOURCE, PackedLinearKernel, cache_dir)


@functools.cache
def packed_linear_kernel() -> PackedLinearKernel | None:
    """The kernel CPU matmuls may choose; None, with a warning carrying the reason, when it cannot be built."""
    try:
        return build_packed_linear()
    except KernelBuildError as error:
        logger.warning("native packed CPU matmul unavailable, CPU matmuls use MKL and oneDNN only: %s", error)
        return None
