"""Compiling pagerail's C kernels once per machine with the system C compiler and loading them with ctypes.

Each kernel is one C file under `csrc/`, built with `cc -O3 -march=native -ffast-math -fopenmp` and linked without
-ffast-math into the pagerail cache, keyed by its source, the flags and the host. The kernels need no torch
headers, so a build takes about a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pagerail.common.default_model import cache_root

Kernel = TypeVar("Kernel")

CSRC = Path(__file__).with_name("csrc")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked without -ffast-math: with it gcc links crtfastmath.o, whose constructor turns on flush-to-zero for the
# whole process that loads the library (torch's and the caller's own float arithmetic lose their subnormals).
LINK_FLAGS = ("-shared", "-fopenmp")


class KernelBuildError(RuntimeError):
    """A native kernel could not be compiled or loaded; the message carries the compiler's own output."""


def find_compiler() -> str | None:
    """The C compiler kernels are built with: $CC, else cc or gcc on PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(source: Path, cache_dir: Path | None = None) -> Path:
    """Where the library built from `source` lives, keyed by source, flags and host."""
    try:
        code = source.read_bytes()
    except OSError as error:
        raise KernelBuildError(f"cannot read the kernel source: {error}") from error
    flags = " ".join(COMPILE_FLAGS) + " | " + " ".join(LINK_FLAGS)
    key = hashlib.sha256(code + flags.encode() + platform.machine().encode()).hexdigest()[:16]
    # The host name is part of the path: -march=native code must not be shared across machines via a volume.
    directory = cache_dir if cache_dir is not None else cache_root() / "kernels"
    return directory / f"{source.stem}-{platform.node() or 'host'}-{key}.so"


def load_library(source: Path, cache_dir: Path | None = None) -> ctypes.CDLL:
    """The library compiled from `source` (built on first use, then cached); raises KernelBuildError."""
    target = library_path(source, cache_dir)
    if not target.exists():
        _build(source, target)
    try:
        # torch has already loaded libgomp.so.1, so the kernel joins torch's OpenMP thread pool.
        return ctypes.CDLL(str(target))
    except OSError as error:
        raise KernelBuildError(f"cannot load the native kernel {target}: {error}") from error


def load_kernel(source: Path, wrap: Callable[[ctypes.CDLL], Kernel], cache_dir: Path | None = None) -> Kernel:
    """`wrap` (a kernel's ctypes handle class) around the library compiled from `source`; raises KernelBuildError,
    also when the library lacks an entry point `wrap` looks up."""
    library = load_library(source, cache_dir)
    try:
        return wrap(library)
    except AttributeError as error:
        raise KernelBuildError(f"the native kernel {library._name} lacks an entry point: {error}") from error


def kernel_or_fallback(
    switch: str, build: Callable[[], Kernel], logger: logging.Logger, unavailable: str
) -> Kernel | None:
    """`build()`, or None (the caller's torch path) when the environment variable `switch` says "torch" or the build
    fails; a failure is logged on `logger` as "<unavailable>: <the compiler's error>"."""
    if os.environ.get(switch, "native").strip().lower() == "torch":
        return None
    try:
        return build()
    except KernelBuildError as error:
        logger.warning("%s: %s", unavailable, error)
        return None


def _build(source: Path, target: Path) -> None:
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError("no C compiler on PATH (install cc or gcc, or set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so ranks compiling at once never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        compiled = Path(scratch) / f"{source.stem}.o"
        _run_compiler(compiler, [*COMPILE_FLAGS, "-c", str(source), "-o", str(compiled)])
        _run_compiler(compiler, [*LINK_FLAGS, str(compiled), "-o", str(built), "-lm"])
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
