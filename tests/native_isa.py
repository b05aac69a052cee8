"""What the native kernels' -march=native build targets on this machine, and their builds without AVX-512."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pagerail.worker.layers.native_build import CSRC, find_compiler


def compiler_targets_avx512() -> bool:
    """Whether -march=native gives this machine's compiler AVX-512 (what selects the kernels' AVX-512 paths)."""
    defines = subprocess.run(
        [find_compiler(), "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True, check=True
    ).stdout
    return "#define __AVX512F__ 1" in defines


def source_without_avx512(name: str, switch: str, directory: Path) -> Path:
    """A copy of csrc/`name` with `switch` defined, which keeps its build off AVX-512 also on an AVX-512 CPU."""
    source = directory / f"{Path(name).stem}_no_avx512.c"
    source.write_text(f"#define {switch} 1\n" + (CSRC / name).read_text())
    return source
