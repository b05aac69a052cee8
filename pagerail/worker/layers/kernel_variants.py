"""The engine's Triton kernels by name, and how many compiled variants each holds in this process."""

from __future__ import annotations

import importlib

# Every module that defines an engine Triton kernel (a jit function named *_kernel).
KERNEL_MODULES = (
    "pagerail.worker.layers.triton_attention",
    "pagerail.worker.layers.triton_mixed_attention",
    "pagerail.worker.layers.triton_fused",
)


def is_kernel(value: object) -> bool:
    """A Triton jit function (compiled or interpreted) named *_kernel."""
    return type(value).__name__ in ("JITFunction", "InterpretedFunction") and value.fn.__name__.endswith("_kernel")


def kernel_attributes() -> dict[str, tuple[object, str]]:
    """Each engine kernel's name → (module, attribute) where it is defined."""
    found = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for attr, value in vars(module).items():
            if is_kernel(value):
                found[value.fn.__name__] = (module, attr)
    return found


def compiled_variants() -> dict[str, int]:
    """Each engine kernel's number of compiled variants, over every device of this process.

    A count that grows during a timed run means Triton compiled inside it (seconds each on a GPU). Interpreted
    kernels (TRITON_INTERPRET=1) and a process without Triton compile nothing: every count is 0.
    """
    counts = {}
    for name, (module, attr) in sorted(kernel_attributes().items()):
        caches = getattr(getattr(module, attr), "device_caches", None) or {}
        counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts
