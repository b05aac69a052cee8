"""Native CPU decode attention over the paged cache: compiled once per machine with the system C compiler.

The torch fallback gathers every context into a padded copy before SDPA, which moves each K/V byte about
three times; this kernel reads the blocks where they lie. It is compiled with `cc -O3 -march=native -ffast-math
-fopenmp` and linked without -ffast-math (which would switch the loading process to flush-to-zero) into the
pagerail cache and loaded with ctypes, so it needs no torch headers and builds in about a second.
With PAGERAIL_CPU_ATTENTION=torch the torch path is used; without a compiler, or when the build fails, it is used
too, with a warning that carries the compiler's error (`build_native_kernel` raises it instead).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from worker.default_model import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked without -ffast-math: with it gcc links crtfastmath.o, whose constructor turns on flush-to-zero for the
# whole process that loads the library (torch's and the caller's own float arithmetic lose their subnormals).
_LINK_FLAGS = ("-shared", "-fopenmp")
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


class KernelBuildError(RuntimeError):
    """The native kernel could not be compiled or loaded; the message carries the compiler's own output."""


def find_compiler() -> str | None:
    """The C compiler the kernel is built with: $CC, else cc or gcc on PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def kernel_library_path(source: Path | None = None, cache_dir: Path | None = None) -> Path:
    """Where the library built from `source` (default: the shipped kernel) lives, keyed by source, flags and host."""
    source = source or _SOURCE
    try:
        code = source.read_bytes()
    except OSError as error:
        raise KernelBuildError(f"cannot read the kernel source: {error}") from error
    flags = " ".join(_COMPILE_FLAGS) + " | " + " ".join(_LINK_FLAGS)
    key = hashlib.sha256(code + flags.encode() + platform.machine().encode()).hexdigest()[:16]
    # The host name is part of the path: -march=native code must not be shared across machines via a volume.
    directory = cache_dir if cache_dir is not None else cache_root() / "kernels"
    return directory / f"paged_attention_cpu-{platform.node() or 'host'}-{key}.so"


def _build(source: Path, target: Path) -> None:
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler on PATH (install cc or gcc, or set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so ranks compiling at once never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        compiled = Path(scratch) / "paged_attention_cpu.o"
        _run_compiler(compiler, [*_COMPILE_FLAGS, "-c", str(source), "-o", str(compiled)])
        _run_compiler(compiler, [*_LINK_FLAGS, str(compiled), "-o", str(built), "-lm"])
        os.replace(built, target)


def _run_compiler(compiler: str, arguments: list[str]) -> None:
    command = [compiler, *arguments]
    try:
        result = subprocess.run(command, capture_output=True, text=True, errors="replace")
    except OSError as error:
        raise KernelBuildError(f"cannot run the C compiler {compiler!r}: {error}") from error
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip()
        raise KernelBuildError(f"{shlex.join(command)} failed with exit status {result.returncode}:\n{output}")


def build_native_kernel(source: Path | None = None, cache_dir: Path | None = None) -> NativeKernel:
    """The kernel compiled from `source` (default: the shipped kernel; built on first use, then cached).

    The strict variant: raises KernelBuildError, with the compiler's output, when there is no compiler or the
    build or load fails. Decode attention goes through `native_kernel`, which logs that error and falls back.
    """
    source = source or _SOURCE
    target = kernel_library_path(source, cache_dir)
    if not target.exists():
        _build(source, target)
    try:
        # torch has already loaded libgomp.so.1, so the kernel joins torch's OpenMP thread pool.
        return NativeKernel(ctypes.CDLL(str(target)))
    except (OSError, AttributeError) as error:
        raise KernelBuildError(f"cannot load the native kernel {target}: {error}") from error


@functools.cache
def native_kernel() -> NativeKernel | None:
    """The kernel CPU decode attention uses; None (the torch path) when switched off or when it cannot be built."""
    if os.environ.get(_ENV_SWITCH, "native").strip().lower() == "torch":
        return None
    try:
        return build_native_kernel()
    except KernelBuildError as error:
        logger.warning("native CPU attention unavailable, decode attention uses the slower torch path: %s", error)
        return None
