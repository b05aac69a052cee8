"""Native CPU decode attention over the paged cache: compiled once per machine with the system C compiler.

The torch fallback gathers every context into a padded copy before SDPA, which moves each K/V byte about
three times; this kernel reads the blocks where they lie. It is built with `cc -O3 -march=native -fopenmp`
into the pagerail cache and loaded with ctypes, so it needs no torch headers and builds in about a second.
Without a compiler (or with PAGERAIL_CPU_ATTENTION=torch) the torch path is used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from worker.default_model import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
_ENV_SWITCH = "PAGERAIL_CPU_ATTENTION"


class NativeKernel:
    """ctypes handle on the compiled library, with the argument types spelled out once."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.paged_decode_attention_f32
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float]
        max_group, max_head_dim = ctypes.c_int64(), ctypes.c_int64()
        library.paged_attention_limits(ctypes.byref(max_group), ctypes.byref(max_head_dim))
        self.max_group = max_group.value
        self.max_head_dim = max_head_dim.value

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
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
    ) -> torch.Tensor:
        """q [n, heads, d]; caches [kv_heads, slots, d]; block_table [n, max_blocks] int64 → [n, heads, d]."""
        q = q.contiguous()
        out = torch.empty_like(q)
        n, num_heads, head_dim = q.shape
        num_kv_heads, num_slots, _ = key_cache.shape
        self._fn(
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
        )
        return out


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so ranks compiling at once never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True)
        os.replace(built, target)


@functools.cache
def native_kernel() -> NativeKernel | None:
    """The compiled kernel, building it on first use; None when disabled or when it cannot be built."""
    if os.environ.get(_ENV_SWITCH, "native").strip().lower() == "torch":
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    # The host name is part of the path: -march=native code must not be shared across machines via a volume.
    target = cache_root() / "kernels" / f"paged_attention_cpu-{platform.node() or 'host'}-{key}.so"
    try:
        if not target.exists():
            _build(target)
        # torch has already loaded libgomp.so.1, so the kernel joins torch's OpenMP thread pool.
        return NativeKernel(ctypes.CDLL(str(target)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("native CPU attention unavailable, using torch: %s %s", error, detail.decode(errors="replace"))
        return None
