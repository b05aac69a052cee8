"""The engine's Triton launches as an sm_90 build would see them: specialisation keys and Hopper builds, no GPU.

`LaunchRecorder` stands in for every kernel of `worker/layers/triton_*.py` while the engine (or a wrapper) runs
on the CPU. Each launch is bound by Triton's own argument binder for an sm_90 target, which yields the key that
decides whether a GPU process compiles a new variant (argument types, "divisible by 16" and "== 1"
specialisations of plain ints, 16-byte alignment of pointers, constexprs, launch options). With `forward=True`
the launch then runs (under TRITON_INTERPRET=1 on the CPU), so the engine's results stay real.

`build_for_hopper` compiles one recorded launch for `GPUTarget("cuda", 90, 32)` with whatever Triton is imported,
and reads registers and spills from Triton's own ptxas run and shared memory from the compiled metadata.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# Every launchable engine kernel by name → (module, attribute).
from pagerail.worker.layers.kernel_variants import kernel_attributes as engine_kernels

# sm_90 with 32-thread warps: the H100 and H200.
HOPPER_CAPABILITY = 90
# Shared memory one block may opt into on sm_90 (227 KiB).
HOPPER_SHARED_MEMORY = 232448


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", HOPPER_CAPABILITY, 32)


class _WrappedLaunch:
    """Stands in for one kernel object: `kernel[grid](...)` calls `around(kernel[grid], args, kwargs)`."""

    def __init__(self, kernel, around) -> None:
        self.kernel, self.around = kernel, around

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.around(self.kernel[grid], args, kwargs)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


@contextlib.contextmanager
def around_kernel_launches(around):
    """Within the block every engine kernel launch runs as `around(launch, args, kwargs)`."""
    patched = []
    for module, attr in engine_kernels().values():
        kernel = getattr(module, attr)
        setattr(module, attr, _WrappedLaunch(kernel, around))
        patched.append((module, attr, kernel))
    try:
        yield
    finally:
        for module, attr, kernel in patched:
            setattr(module, attr, kernel)


def _as_jit(kernel):
    """A JITFunction of the kernel's Python function, specialised as the kernel is (also under the interpreter)."""
    from triton.runtime.jit import JITFunction

    if type(kernel).__name__ == "JITFunction":
        return kernel
    options = getattr(kernel, "kwargs", {})
    return JITFunction(
        kernel.fn,
        do_not_specialize=options.get("do_not_specialize"),
        do_not_specialize_on_alignment=options.get("do_not_specialize_on_alignment"),
    )


@dataclass
class Launch:
    """One recorded launch: the kernel, its sm_90 cache key, and what compiling it needs."""

    kernel: str
    key: str
    jit: object
    bound_args: dict
    specialization: list
    launch_options: dict
    kwargs: dict = field(repr=False)


class _Recording:
    """Replaces one kernel object: `kernel[grid](*args, **kwargs)` records the launch, then runs it if asked."""

    def __init__(self, recorder: LaunchRecorder, name: str, kernel) -> None:
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        self.recorder, self.name, self.kernel = recorder, name, kernel
        self.jit = _as_jit(kernel)
        self.backend = make_backend(_target())
        self.binder = create_function_from_signature(self.jit.signature, self.jit.params, self.backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound, specialization, options = self.binder(*args, **kwargs)
            key = str(specialization) + str(options)
            self.recorder.launches.append(Launch(self.name, key, self.jit, bound, specialization, options, kwargs))
            if self.recorder.forward:
                return self.kernel[grid](*args, **kwargs)
            return None

        return launch

    def __getattr__(self, name):
        return getattr(self.kernel, name)


class LaunchRecorder:
    """Within the `with` block every engine kernel is recorded (and run when `forward`)."""

    def __init__(self, forward: bool = True) -> None:
        self.forward = forward
        self.launches: list[Launch] = []
        self._patched: list[tuple[object, str, object]] = []

    def __enter__(self) -> LaunchRecorder:
        for name, (module, attr) in engine_kernels().items():
            kernel = getattr(module, attr)
            setattr(module, attr, _Recording(self, name, kernel))
            self._patched.append((module, attr, kernel))
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, kernel in self._patched:
            setattr(module, attr, kernel)
        self._patched.clear()

    def keys(self) -> dict[str, set[str]]:
        """The distinct sm_90 cache keys each kernel was launched with: the variants a GPU would compile."""
        keys: dict[str, set[str]] = {}
        for launch in self.launches:
            keys.setdefault(launch.kernel, set()).add(launch.key)
        return keys

    def distinct(self) -> list[Launch]:
        """One launch per distinct (kernel, key), in first-seen order."""
        seen, out = set(), []
        for launch in self.launches:
            if (launch.kernel, launch.key) not in seen:
                seen.add((launch.kernel, launch.key))
                out.append(launch)
        return out


@dataclass
class HopperBuild:
    """What ptxas and the compiler say of one kernel variant built for sm_90."""

    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    num_warps: int
    constexprs: dict


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


# ptxas's report (-v) of each compiled kernel by Triton's hash: a kernel found in Triton's cache has no new report.
_PTXAS_LOGS: dict[str, str] = {}


def _ptxas_log(compiled) -> str:
    """ptxas's -v report of a compiled kernel: the one Triton's own ptxas run printed (its flags, its cubin), or
    for a kernel Triton had cached before this process, a second ptxas run on its PTX."""
    if compiled.hash in _PTXAS_LOGS:
        return _PTXAS_LOGS[compiled.hash]
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        command = [get_ptxas(HOPPER_CAPABILITY).path, "-lineinfo", "-v", f"--gpu-name=sm_{HOPPER_CAPABILITY}a"]
        done = subprocess.run(
            [*command, str(ptx), "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, check=True
        )
    return done.stdout + done.stderr


def build_for_hopper(launch: Launch) -> HopperBuild:
    """Compile a recorded launch for sm_90 (no GPU needed) and read its resource usage."""
    import io
    import os

    import triton
    from triton.compiler import ASTSource, make_backend

    backend = make_backend(_target())
    kwargs = {**launch.kwargs}
    options, signature, constexprs, attrs = launch.jit._pack_args(
        backend, kwargs, launch.bound_args, launch.specialization, launch.launch_options
    )
    # Triton runs ptxas with -v itself and prints that report when asked to (TRITON_DUMP_PTXAS_LOG, read at each
    # compile): registers and spills come from the very run that built the cubin, without a second ptxas.
    printed, previous = io.StringIO(), os.environ.get("TRITON_DUMP_PTXAS_LOG")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    try:
        with contextlib.redirect_stdout(printed):
            compiled = triton.compile(
                ASTSource(launch.jit, signature, constexprs, attrs), target=_target(), options=options.__dict__
            )
    finally:
        if previous is None:
            del os.environ["TRITON_DUMP_PTXAS_LOG"]
        else:
            os.environ["TRITON_DUMP_PTXAS_LOG"] = previous
    if _PTXAS_USED.search(printed.getvalue()):
        _PTXAS_LOGS[compiled.hash] = printed.getvalue()
    log = _ptxas_log(compiled)
    spills = _PTXAS_SPILLS.search(log)
    named = {launch.jit.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
    return HopperBuild(
        kernel=launch.kernel,
        registers=int(_PTXAS_USED.search(log).group(1)),
        spill_stores=int(spills.group(1)) if spills else 0,
        spill_loads=int(spills.group(2)) if spills else 0,
        shared_bytes=int(compiled.metadata.shared),
        num_warps=int(options.num_warps),
        constexprs={k: str(v) for k, v in named.items()},
    )
